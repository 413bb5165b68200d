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
