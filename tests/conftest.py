"""Shared test setup: a persistent compilation cache (CI compiles the same small programs every run) and
float32 matmuls at full precision so comparisons with the float64 references are meaningful."""

import os
import sys

import jax

jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "DSV4_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "jit")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, os.path.dirname(__file__))   # tests import their own helpers (ckpt_writer, reference_np)
