"""The model's fake-quant roundings (numerics/fake_quant.py) inside Pallas kernels: Pallas's Triton lowering has no
`round`, so the integer rounding is written with floor (ties to even by hand). Values equal fake_quant.py's but
for the sign of a zero result (+0 for -0); the Hadamard transform's float32 sums (hadamard_fp4) are in another
order than XLA's dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..numerics.fake_quant import FP4_MAX, FP8_MAX, pow2_ceil

_F32 = jnp.float32


def round_to_float_grid(y, mantissa_bits: int, min_exponent: int, limit: float):
    """numerics/fake_quant.round_to_float_grid of float32 y clipped to +-limit: round to nearest even onto the values of
    a float format with `mantissa_bits` explicit mantissa bits and smallest normal exponent `min_exponent`."""
    y = jnp.clip(y, -limit, limit)
    exponent = ((jax.lax.bitcast_convert_type(y, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - 127
    step = jnp.maximum(exponent, min_exponent) - mantissa_bits              # the grid spacing is 2^step
    quantum = jax.lax.bitcast_convert_type(((step + 127) << 23).astype(jnp.uint32), _F32)
    inverse = jax.lax.bitcast_convert_type(((127 - step) << 23).astype(jnp.uint32), _F32)
    v = y * inverse                # |v| < 2^(mantissa_bits + 2) with at most 24 significant bits: v + 0.5 is exact
    r = jnp.floor(v + 0.5)
    odd = r - 2.0 * jnp.floor(r * 0.5) == 1.0
    r = jnp.where((r - v == 0.5) & odd, r - 1.0, r)                          # a tie goes to the even neighbour
    return r * quantum


def round_to_e4m3(y):
    """numerics/fake_quant.round_to_e4m3: e4m3fn values, saturating at +-448."""
    return round_to_float_grid(y, 3, -6, FP8_MAX)


def fp8_fake_quant(x):
    """numerics/fake_quant.fp8_fake_quant of float32 blocks x [rows, 64] (one scale block per row)."""
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax / FP8_MAX)
    return round_to_e4m3(x / scale) * scale


def fp4_fake_quant(x, block: int = 32):
    """numerics/fake_quant.fp4_fake_quant of a float32 vector x [C] (C a multiple of `block`, each block its own
    power-of-two scale): e2m1 values, saturating at +-6. The blocks' maxima are taken through lane masks (no
    reshape of a register tile)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) // block
    scale = jnp.zeros_like(x)
    for b in range(x.shape[0] // block):
        amax = jnp.maximum(jnp.max(jnp.where(lane == b, jnp.abs(x), 0.0)), FP4_MAX * 2.0 ** -126)
        scale = jnp.where(lane == b, pow2_ceil(amax / FP4_MAX), scale)
    return round_to_float_grid(x / scale, 1, 0, FP4_MAX) * scale


def hadamard_fp4(chunks: list, hadamard_ref, dtype) -> list:
    """The indexer's rounding (layers/attention.py, ops/compressor_step.py: fake_quant.hadamard, then fp4_fake_quant)
    of a vector held as float32 chunks [C] each: the normalised Hadamard transform (hadamard_ref: the [n, n] matrix,
    n = its length) summed chunk by chunk in float32, rounded to dtype as `hadamard` returns it, then FP4 per
    32-value block. Returns the chunks, float32 on dtype's grid."""
    width = chunks[0].shape[0]

    def transformed(j):
        return sum(jnp.sum(c[:, None] * hadamard_ref[pl.ds(i * width, width), pl.ds(j * width, width)], axis=0)
                   for i, c in enumerate(chunks))
    return [fp4_fake_quant(transformed(j).astype(dtype).astype(_F32)).astype(dtype).astype(_F32)
            for j in range(len(chunks))]
