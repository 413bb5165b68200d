"""The installed distribution claims one top-level name, dsv4_jax: its kernels install as dsv4_jax.ffi (with their
CUDA sources) and dsv4_jax.pallas_kernels, not as generic top-level packages."""

import fnmatch
import os
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_config():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_installed_package_is_under_dsv4_jax():
    include = _setuptools_config()["packages"]["find"]["include"]
    top_level = [d for d in sorted(os.listdir(REPO)) if os.path.isfile(os.path.join(REPO, d, "__init__.py"))]
    installed = [d for d in top_level if any(fnmatch.fnmatch(d, pattern) for pattern in include)]
    assert installed == ["dsv4_jax"], installed
    for kernels in ("ffi", "pallas_kernels"):
        assert os.path.isfile(os.path.join(REPO, "dsv4_jax", kernels, "__init__.py"))


def test_cuda_sources_ship_as_package_data():
    patterns = _setuptools_config()["package-data"]["dsv4_jax.ffi"]
    sources = [f for f in os.listdir(os.path.join(REPO, "dsv4_jax", "ffi")) if f.endswith((".cu", ".cuh"))]
    assert sources and all(any(f.endswith(p.lstrip("*")) for p in patterns) for f in sources)
