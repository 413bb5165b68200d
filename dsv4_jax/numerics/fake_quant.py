"""Quantize-dequantize ("fake quant") sites that are part of the trained model (docs/model.md 3.2, 3.3).

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


def exact_divide(a: jax.Array, b) -> jax.Array:
    """a / b as one float32 division, not a * (1 / b): XLA rewrites a / broadcast(b) and a / constant into a
    multiplication by the reciprocal, which can differ in the last bit and so move a value across a rounding tie or
    a power-of-two boundary; a barrier on the full-shape divisor keeps the division. IEEE-exact on CPU; XLA's GPU
    backend lowers f32 division to `div.full` (up to 2 ulp), see `correctly_rounded_divide`."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    return jnp.asarray(a, jnp.float32) / jax.lax.optimization_barrier(b)


def correctly_rounded_divide(a: jax.Array, b) -> jax.Array:
    """a / b in float32, correctly rounded (ties to even) on every backend, for results that must be bit-exact
    everywhere (stored NVFP4 weights). The 24-bit significands are divided with integer long division and rounded
    once. Quotients outside the normal float32 range, zero / inf / NaN operands and subnormal numerators fall back
    to `a / b`; b must be positive. About 40 integer ops per element: not for the per-token hot path."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.broadcast_shapes(a.shape, jnp.shape(b)))
    a_bits = jax.lax.bitcast_convert_type(jnp.abs(a), jnp.uint32)
    b_bits = jax.lax.bitcast_convert_type(b, jnp.uint32)
    a_exp, b_exp = (a_bits >> 23).astype(jnp.int32), (b_bits >> 23).astype(jnp.int32)
    a_man, b_man = (a_bits & 0x7FFFFF) | 0x800000, (b_bits & 0x7FFFFF) | 0x800000
    shift = (a_man < b_man).astype(jnp.uint32)                 # make the significand ratio lie in [1, 2)
    remainder = a_man << shift
    exponent = a_exp - b_exp - shift.astype(jnp.int32) + 127
    quotient = jnp.zeros_like(remainder)
    for bits in (7, 7, 7, 4):                                   # 25 fraction bits, 7 at a time (fits in uint32)
        remainder = remainder << bits
        digit = remainder // b_man
        quotient = (quotient << bits) | digit
        remainder = remainder - digit * b_man
    # quotient = floor(ratio * 2^25), 26 bits; keep 24 and round to nearest even on the 2 dropped bits + sticky.
    dropped, kept = quotient & 3, quotient >> 2
    up = (dropped > 2) | ((dropped == 2) & ((remainder != 0) | ((kept & 1) == 1)))
    kept = kept + up.astype(jnp.uint32)
    carry = kept >> 24                                          # rounding overflowed to 2.0
    exponent = exponent + carry.astype(jnp.int32)
    result = (exponent.astype(jnp.uint32) << 23) | ((kept >> carry) & 0x7FFFFF)
    result = jax.lax.bitcast_convert_type(result, jnp.float32)
    result = jnp.where(a < 0, -result, result)
    exact = (a_exp > 0) & (a_exp < 255) & (b_exp > 0) & (b_exp < 255) & (exponent > 0) & (exponent < 255)
    return jnp.where(exact, result, a / b)


def pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2(x)) for positive normal float32 x, exactly: from the bits (exponent + 1 unless the mantissa is
    zero), as the reference's ue8m0 rounding does; cheaper to compile and run than frexp / ldexp."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def round_to_float_grid(y: jax.Array, mantissa_bits: int, min_exponent: int) -> jax.Array:
    """Round-to-nearest-even of float32 y onto the values of a small float format with `mantissa_bits` explicit
    mantissa bits and smallest normal exponent `min_exponent` (subnormals below it); no range limit, callers clip.
    Pure float32 arithmetic on purpose: XLA may elide a convert(convert(y, narrow type), f32) pair (it does on GPU,
    where excess precision is allowed), which would silently skip the rounding."""
    y = y.astype(jnp.float32)
    exponent = ((jax.lax.bitcast_convert_type(y, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - 127
    step = jnp.maximum(exponent, min_exponent) - mantissa_bits                  # the grid spacing is 2^step
    quantum = jax.lax.bitcast_convert_type(((step + 127) << 23).astype(jnp.uint32), jnp.float32)
    inverse = jax.lax.bitcast_convert_type(((127 - step) << 23).astype(jnp.uint32), jnp.float32)
    return jnp.round(y * inverse) * quantum                                     # exact scalings, ties to even


def round_to_e4m3(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even onto float8 e4m3fn values, saturating at +-448 (float32 in/out)."""
    return round_to_float_grid(jnp.clip(y, -FP8_MAX, FP8_MAX), 3, -6)


def _blocked(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_fake_quant(x: jax.Array, block: int = 64) -> jax.Array:
    """Round each block of `block` elements to e4m3 under a power-of-two scale; returns x.dtype."""
    xb = _blocked(x.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4)
    scale = pow2_ceil(exact_divide(amax, FP8_MAX))
    return (round_to_e4m3(xb / scale) * scale).reshape(x.shape).astype(x.dtype)


def round_to_e2m1(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (float32 in/out)."""
    return round_to_float_grid(jnp.clip(y, -FP4_MAX, FP4_MAX), 1, 0)


def fp4_fake_quant(x: jax.Array, block: int = 32) -> jax.Array:
    """Round each block of `block` elements to e2m1 under a power-of-two scale; returns x.dtype."""
    xb = _blocked(x.astype(jnp.float32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126)
    scale = pow2_ceil(exact_divide(amax, FP4_MAX))
    return (round_to_e2m1(xb / scale) * scale).reshape(x.shape).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard(x: jax.Array) -> jax.Array:
    """Normalised Sylvester-ordered Walsh-Hadamard transform over the last dim (computed in float32)."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def straight_through(fn):
    """fn's value forward, the identity backward (the straight-through estimator): the derivative JAX gives a cast
    to float8 / float4 is zero, so a rounding site would otherwise stop every gradient."""
    @jax.custom_vjp
    def rounded(x):
        return fn(x)

    rounded.defvjp(lambda x: (fn(x), None), lambda _, g: (g,))
    return rounded


def trained_rounding(fn, x: jax.Array, ctx) -> jax.Array:
    """The model's rounding `fn` (fp8_fake_quant, or fp4_fake_quant after the Hadamard) at one site under the run
    context: straight-through when training asks for it."""
    if ctx.training is not None and ctx.training.straight_through:
        return straight_through(fn)(x)
    return fn(x)
