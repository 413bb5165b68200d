"""The library's persistent compilation cache: on by default, DSV4_JAX_CACHE moves it or turns it off, and a
directory the user set for JAX wins. Each case imports dsv4_jax in a fresh process (the setting is made at import)."""

import os
import subprocess
import sys

import pytest

PRINT_DIR = "import jax, dsv4_jax; print(jax.config.jax_compilation_cache_dir)"


def _cache_dir(env_changes: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", PRINT_DIR], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("env,want", [
    ({}, os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "jit")),
    ({"DSV4_JAX_CACHE": "/tmp/dsv4-elsewhere"}, "/tmp/dsv4-elsewhere"),
    ({"DSV4_JAX_CACHE": "off"}, "None"),
    ({"JAX_COMPILATION_CACHE_DIR": "/tmp/users-own", "DSV4_JAX_CACHE": "/tmp/dsv4-elsewhere"}, "/tmp/users-own"),
])
def test_cache_directory(env, want):
    assert _cache_dir(env) == want


def test_compile_timer_counts_a_new_program_once():
    import jax
    import jax.numpy as jnp

    from dsv4_jax.compile_time import CompileTimer
    calls = []
    f = jax.jit(lambda x: jnp.tanh(x) * 3 + 1)
    x = jnp.arange(7.0)
    with CompileTimer(on_first=lambda: calls.append(1)) as timer:
        f(x).block_until_ready()
        f(x).block_until_ready()                    # in memory now: no second compile
    assert calls == [1] and timer.seconds > 0
    assert timer.compiled + timer.cache_hits >= 1
    with CompileTimer() as again:
        f(x).block_until_ready()
    assert (again.seconds, again.compiled, again.cache_hits) == (0.0, 0, 0)
