"""The persistent compilation cache, on by default: a program compiled once (seconds to minutes on a CPU) is read
back from disk in later processes.

Importing dsv4_jax calls `enable()`: programs go to $DSV4_JAX_CACHE, default ~/.cache/dsv4_jax/jit;
DSV4_JAX_CACHE=off turns it off. A cache directory the user has set for JAX already (jax_compilation_cache_dir, e.g.
JAX_COMPILATION_CACHE_DIR) is left as it is.
"""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "jit")
MIN_COMPILE_SECONDS = 0.0      # every program: a CLI run has ~14, the small ones < 0.5 s each but many


def enable() -> str | None:
    """Turn the cache on unless the user chose otherwise; returns the directory in use (None: off)."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    directory = os.environ.get("DSV4_JAX_CACHE") or DEFAULT_DIR
    if directory.lower() == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return directory


def disable() -> None:
    """Turn the cache off for this process (before its first compile)."""
    jax.config.update("jax_compilation_cache_dir", None)
