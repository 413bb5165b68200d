"""Quantize-dequantize ("fake quant") sites that are part of the trained model (spec 3.2, 3.3).

The model was trained with these roundings in place, so they run by default (`simulate_quant=True`):
window / main-compressor KV nope dims -> FP8 e4m3 (block 64) and indexer q / keys -> Hadamard + FP4 e2m1
(block 32), both with power-of-two scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0


def pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2(x)) for x > 0, exactly (frexp instead of a rounded log2)."""
    mantissa, exponent = jnp.frexp(x)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.ldexp(jnp.ones_like(x), exponent)


def _blocked(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_fake_quant(x: jax.Array, block: int = 64) -> jax.Array:
    """Round each block of `block` elements to e4m3 under a power-of-two scale; returns x.dtype."""
    xb = _blocked(x.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax / FP8_MAX)
    q = jnp.clip(xb / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def round_to_e2m1(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (float32 in/out)."""
    return jnp.clip(y, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)


def fp4_fake_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """Round each block of `block` elements to e2m1 under a power-of-two scale; returns x.dtype."""
    xb = _blocked(x.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126)
    scale = pow2_ceil(amax / FP4_MAX)
    return (round_to_e2m1(xb / scale) * scale).reshape(x.shape).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(n: int) -> np.ndarray:
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard(x: jax.Array) -> jax.Array:
    """Normalised Sylvester-ordered Walsh-Hadamard transform over the last dim (computed in float32)."""
    h = jnp.asarray(_hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
