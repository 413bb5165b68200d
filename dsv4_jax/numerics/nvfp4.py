"""NVFP4 on device (docs/model.md 7): the standard two-level quantization recipe and the lossless MXFP4 -> NVFP4 cast.

Standard recipe (NVIDIA ModelOpt `NVFP4QTensor`, the one behind NVIDIA's NVFP4 checkpoints), all in float32:
    global_scale = amax(|x|) / (6 * 448)
    block scale  = e4m3(clamp(block_amax / (6 * global_scale), 2^-9, 448)), blocks whose ratio is 0 get 1.0
    y            = x / (float(block scale) * global_scale)
    code         = e2m1 round-to-nearest-even of |y| (ties 0.25, 1.25, 2.5, 5 down; 0.75, 1.75, 3.5 up; > 6 -> 6),
                   sign bit set iff y < 0 (so -0.0 stays code 0, a small negative rounds to code 8, "-0")
The lower clamp at e4m3's smallest subnormal keeps tiny blocks from a zero scale (a later ModelOpt fix); the
upper clamp is e4m3 saturation (hardware `satfinite`), which only matters when the global scale does not come
from the same data (see activations.py).

Exactness on every backend: roundings are float32 arithmetic (fake_quant.round_to_float_grid), because XLA drops
convert(convert(x, e4m3), f32) pairs on GPU; weight quantization divides with correctly_rounded_divide, so stored
bytes equal the recipe's on CPU and GPU alike; the per-token activation path (activations.py) uses the cheaper
exact_divide (IEEE on CPU; XLA GPU's `div.full`, <= 2 ulp, can flip a value lying on a rounding tie).

Lossless cast (docs/model.md 7.3): per matrix with E8M0 exponents k_j, m = max_j k_j - 8, global scale 2^m, and each
32-block becomes two 16-blocks with e4m3 scale 2^(k_j - m), exact while max k - k_j <= 17; nibbles unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .fake_quant import correctly_rounded_divide, exact_divide, round_to_e2m1, round_to_e4m3
from .formats import NVFP4_BLOCK, Mxfp4Weight, Nvfp4Weight

FP4_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
# Smallest amax that keeps amax / (6 * 448) a normal float32 (an all-zero tensor would otherwise divide 0 by 0).
_MIN_AMAX = FP4_MAX * E4M3_MAX * 2.0 ** -126


def global_scale_from_amax(amax: jax.Array, divide=exact_divide) -> jax.Array:
    """amax / (6 * 448) in float32 (amax floored so the scale stays a positive normal number)."""
    return divide(jnp.maximum(amax.astype(jnp.float32), _MIN_AMAX), jnp.float32(FP4_MAX * E4M3_MAX))


def e2m1_magnitude(y: jax.Array) -> jax.Array:
    """|y| rounded to the nearest e2m1 value (ties to the even code), saturating at 6, as float32."""
    return round_to_e2m1(jnp.abs(y))


def e2m1_codes(y: jax.Array) -> jax.Array:
    """float32 -> 4-bit e2m1 codes (uint8, bit 3 = sign): round-to-nearest-even, saturating at 6."""
    magnitude = e2m1_magnitude(y).astype(jnp.float4_e2m1fn)                     # exact: already on the grid
    code = jax.lax.bitcast_convert_type(magnitude, jnp.uint4).astype(jnp.uint8)
    return jnp.where(y < 0, code | 8, code)


def pack_fp4_codes(codes: jax.Array) -> jax.Array:
    """codes uint8 [..., n] -> packed uint8 [..., n/2]; element 2k in the low nibble, 2k+1 in the high one."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def scale_blocks(x: jax.Array, global_scale: jax.Array, block: int = NVFP4_BLOCK, divide=exact_divide):
    """Steps 2-3 of the recipe without the final rounding: x [..., K] (K a multiple of `block`), global_scale
    broadcastable to [..., 1] -> (e4m3 block scales [..., K/block], y = x / (scale * global) [..., K/block, block]).
    `divide`: exact_divide (IEEE on CPU, `div.full` on GPU) or correctly_rounded_divide (exact everywhere)."""
    if x.shape[-1] % block:
        raise ValueError(f"NVFP4 quantization needs the last dim to be a multiple of {block}, got {x.shape[-1]}")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    gs = jnp.asarray(global_scale, jnp.float32)
    block_amax = jnp.max(jnp.abs(xb), axis=-1)                                    # [..., K/block]
    ratio = divide(block_amax, jnp.float32(FP4_MAX) * gs)
    ratio = jnp.where(ratio == 0, jnp.float32(1.0), ratio)
    scale = round_to_e4m3(jnp.clip(ratio, E4M3_MIN_SUBNORMAL, E4M3_MAX))
    return scale.astype(jnp.float8_e4m3fn), divide(xb, (scale * gs)[..., None])


def quantize_blocks(x: jax.Array, global_scale: jax.Array, block: int = NVFP4_BLOCK, divide=exact_divide):
    """x [..., K] (K a multiple of `block`), global_scale broadcastable to [..., 1] -> (codes uint8 [..., K],
    e4m3 block scales [..., K/block]) by the standard recipe."""
    scale, y = scale_blocks(x, global_scale, block, divide)
    return e2m1_codes(y).reshape(x.shape), scale


def quantize_nvfp4(w: jax.Array, global_scale: jax.Array | None = None) -> Nvfp4Weight:
    """A float weight [..., out, in] -> Nvfp4Weight by the standard recipe; the global scale is per matrix
    (amax over the last two axes) unless given. Runs on device (jit it; no host sync), with correctly rounded
    divisions so the stored bytes are the recipe's on every backend."""
    if w.ndim < 2:
        raise ValueError(f"quantize_nvfp4 expects a weight [..., out, in], got shape {w.shape}")
    if global_scale is None:
        global_scale = global_scale_from_amax(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1)),
                                              correctly_rounded_divide)
    codes, scale = quantize_blocks(w, jnp.asarray(global_scale, jnp.float32)[..., None, None],
                                   divide=correctly_rounded_divide)
    return Nvfp4Weight(pack_fp4_codes(codes), scale, jnp.asarray(global_scale, jnp.float32))


def nvfp4_scales_from_e8m0(scale_bytes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 E8M0 bytes [..., out, in/32] -> (e4m3 block scales [..., out, in/16], global scale [...] float32) of
    the lossless cast (docs/model.md 7.3), per matrix. Block scales outside e4m3's powers of two (2^-9 .. 2^8) are
    clamped, which is exact only for all-zero blocks (`mxfp4_to_nvfp4_is_exact`)."""
    k = scale_bytes.astype(jnp.int32) - 127                                      # [..., out, in/32]
    m = jnp.max(k, axis=(-2, -1)) - 8                                            # [...]
    rel = jnp.clip(k - m[..., None, None], -9, 8)
    block_scale = jnp.ldexp(jnp.float32(1.0), rel).astype(jnp.float8_e4m3fn)
    block_scale = jnp.repeat(block_scale, 2, axis=-1)                            # one 32-block -> two 16-blocks
    return block_scale, jnp.ldexp(jnp.float32(1.0), m)


def mxfp4_to_nvfp4(w: Mxfp4Weight) -> Nvfp4Weight:
    """The lossless cast of docs/model.md 7.3, per matrix (stacked experts each get their own global scale); the nibbles
    are reused as they are."""
    block_scale, global_scale = nvfp4_scales_from_e8m0(w.scale)
    return Nvfp4Weight(w.packed, block_scale, global_scale)


def mxfp4_to_nvfp4_is_exact(w: Mxfp4Weight) -> jax.Array:
    """Per matrix ([...] bool): the cast reproduces every value. Each block either fits e4m3's scale range after
    the cast (max k - k_j <= 17) or holds only zeros, no scale byte is 0xFF (NaN), and the global scale 2^(max k - 8)
    is a normal float32 (unless the whole matrix is zero)."""
    k = w.scale.astype(jnp.int32) - 127
    k_max = jnp.max(k, axis=(-2, -1), keepdims=True)
    codes = jnp.stack([w.packed & 0x7, (w.packed >> 4) & 0x7], axis=-1)           # magnitudes
    zero_block = jnp.all(codes.reshape(*w.scale.shape, -1) == 0, axis=-1)
    ok = ((k_max - k <= 17) | zero_block) & (w.scale != 255)
    normal_global = (k_max[..., 0, 0] - 8 >= -126) | jnp.all(zero_block, axis=(-2, -1))
    return jnp.all(ok, axis=(-2, -1)) & normal_global
