"""Shared test setup: a persistent compilation cache (CI compiles the same small programs every run) and
float32 matmuls at full precision so comparisons with the float64 references are meaningful."""

import os
import sys

import jax

from dsv4_jax import compile_cache   # importing dsv4_jax turns the cache on, as it does for users

if compile_cache.enable():                     # None: DSV4_JAX_CACHE=off
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)   # the suite's many tiny programs stay out
jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, os.path.dirname(__file__))   # tests import their own helpers (ckpt_writer, reference_np)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

TINY_SEQ = 300   # crosses the 128 window twice and completes two HCA (ratio 128) entries


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop the compiled programs of a test module once it is done (later modules read theirs back from the
    persistent cache). With every program of the suite alive in one process, XLA:CPU crashed (a segfault or an
    abort) serializing or loading a further executable late in the run, at whichever test came there."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny-preset checkpoint in the official on-disk format (2 shards) and its float64 logical weights."""
    from ckpt_writer import write_checkpoint
    from dsv4_jax import presets
    directory = tmp_path_factory.mktemp("tiny_ckpt")
    weights = write_checkpoint(str(directory), presets.tiny(), seed=1, num_shards=2)
    return str(directory), weights


@pytest.fixture(scope="session")
def tiny_tokens():
    """Fresh random token ids [1, TINY_SEQ] for the tiny model."""
    from dsv4_jax import presets
    return np.random.default_rng(1234).integers(0, presets.tiny().vocab_size, (1, TINY_SEQ)).astype(np.int32)


@pytest.fixture(scope="session")
def tiny_f32(tiny_checkpoint):
    import dsv4_jax
    return dsv4_jax.load(tiny_checkpoint[0], dtype="float32", max_seq_len=320)
