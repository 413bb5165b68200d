"""CUDA C++ kernels called through XLA FFI (built on first use by ffi/build.py, cached by source hash).

    mxfp4_gemv(x [M <= 8, K] bf16, w: Mxfp4Weight [N, K]) -> float32 [M, N]     (ffi/mxfp4_gemv.cu)

Status and measurements: ffi/README.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4_jax.quant.formats import Mxfp4Weight

from .build import FfiBuildError, register  # noqa: F401

MAX_ROWS = 8


def mxfp4_gemv(x: jax.Array, w: Mxfp4Weight) -> jax.Array:
    """x [M, K] (M <= 8, cast to bf16) @ dequant(W [N, K])^T with float32 accumulation -> float32 [M, N].
    Needs N % 16 == 0 and K % 128 == 0 (one launch, deterministic)."""
    if not isinstance(w, Mxfp4Weight) or w.packed.ndim != 2:
        raise TypeError("mxfp4_gemv: w must be a 2-D Mxfp4Weight")
    (m, k), (n, kh) = x.shape, w.packed.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"mxfp4_gemv: x must have 1..{MAX_ROWS} rows, got {m}")
    if k != 2 * kh or k % 128 or n % 16 or w.scale.shape != (n, k // 32):
        raise ValueError(f"mxfp4_gemv: x [{m}, {k}], packed {w.packed.shape}, scale {w.scale.shape}: need "
                         "packed [N, K/2], scale [N, K/32], N % 16 == 0, K % 128 == 0")
    register("mxfp4_gemv.cu", {"dsv4_mxfp4_gemv": "DSV4Mxfp4Gemv"})
    call = jax.ffi.ffi_call("dsv4_mxfp4_gemv", jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.bfloat16), w.packed, w.scale)
