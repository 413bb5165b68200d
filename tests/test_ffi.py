"""The XLA FFI CUDA kernels of ffi/: the build (CPU, where nvcc exists: the source compiles for sm_90a, the
cache is keyed by content) and, on the GPU (`-m gpu`), each kernel against float64 math."""

import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import ffi
from ffi import build
from dsv4_jax.quant import Mxfp4Weight

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile only)")
def test_sources_compile_for_hopper_and_are_cached(tmp_path):
    path = build.build_library("mxfp4_gemv.cu", arch="sm_90a", cache_dir=str(tmp_path))
    assert os.path.getsize(path) > 0 and path.startswith(str(tmp_path))
    stamp = os.path.getmtime(path)
    assert build.build_library("mxfp4_gemv.cu", arch="sm_90a", cache_dir=str(tmp_path)) == path
    assert os.path.getmtime(path) == stamp                                # not rebuilt


def _mxfp4(rng, n, k):
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8),
                       jnp.asarray(rng.integers(112, 132, (n, k // 32)), jnp.uint8))


def test_bad_shapes_are_rejected_before_any_build():
    rng = np.random.default_rng()
    w = _mxfp4(rng, 64, 256)
    with pytest.raises(ValueError, match="1..8 rows"):
        ffi.mxfp4_gemv(jnp.ones((9, 256), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="K % 128"):
        ffi.mxfp4_gemv(jnp.ones((2, 192), jnp.bfloat16), _mxfp4(rng, 64, 192))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k,m", [(2048, 4096, 1), (2048, 4096, 8), (1024, 7168, 3), (4096, 1024, 5)])
def test_mxfp4_gemv_gpu(n, k, m):
    rng = np.random.default_rng()
    w = _mxfp4(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = np.asarray(jax.jit(ffi.mxfp4_gemv)(x, w), np.float64)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.dequantize(jnp.float32), np.float64).T
    assert y.shape == (m, n) and np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5
