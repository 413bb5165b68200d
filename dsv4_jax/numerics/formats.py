"""Weight storage formats, kept in device memory exactly as stored in the checkpoint.

Each format is a pytree (flax.struct dataclass) whose leaves are the stored arrays; `dequantize` is the pure-jnp
reference math (the oracle for the GPU kernels). Shapes follow the checkpoint: a weight is [..., out, in] with the
reduction (input) dimension last; leading axes stack experts.

    Fp8BlockWeight  e4m3 [..., out, in] + E8M0 bytes [..., ceil(out/128), ceil(in/128)]
    Mxfp4Weight     packed e2m1 pairs uint8 [..., out, in/2] + E8M0 bytes [..., out, in/32]
    Nvfp4Weight     packed e2m1 pairs uint8 [..., out, in/2] + e4m3 [..., out, in/16] + fp32 global scale [...]
    plain array     bf16 / fp32 [..., out, in]

Every quantized format splits into a "block-scaled" part that is exact in bf16 (an e2m1 or e4m3 value times a
power of two or an e4m3 scale has at most 6 significant bits) and an optional per-matrix fp32 global scale
(`dequantize_blocks`); matmuls multiply the global scale into the fp32 GEMM output instead of rounding
value x global scale to bf16.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FP8_BLOCK = 128      # FP8 weights: one E8M0 scale per 128x128 block
MXFP4_BLOCK = 32     # MXFP4: one E8M0 scale per 32 consecutive inputs
NVFP4_BLOCK = 16     # NVFP4: one e4m3 scale per 16 consecutive inputs

# e2m1 code -> value; bit 3 is the sign (docs/model.md 6.2).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e8m0_to_float(scale_bytes: jax.Array) -> jax.Array:
    """E8M0 exponent bytes -> float32 2^(b-127); 0xFF is NaN. Never a numeric copy of the byte: the byte becomes
    the float's exponent field (b = 0, 2^-127, is a float32 subnormal: 0 where denormals flush, e.g. XLA CPU)."""
    b = scale_bytes.astype(jnp.uint32)
    value = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    return jnp.where(b == 255, jnp.float32(jnp.nan), value)


def unpack_fp4_codes(packed: jax.Array) -> jax.Array:
    """uint8 [..., n/2] -> 4-bit codes uint8 [..., n]; element 2k is the low nibble, 2k+1 the high one."""
    packed = packed.astype(jnp.uint8)
    low = packed & 0xF
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fp4_codes_to_float(codes: jax.Array) -> jax.Array:
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def _expand_blocks(scale: jax.Array, rows: int, cols: int, block_rows: int, block_cols: int) -> jax.Array:
    scale = jnp.repeat(scale, block_rows, axis=-2)[..., :rows, :] if block_rows > 1 else scale
    return jnp.repeat(scale, block_cols, axis=-1)[..., :cols]


def e4m3_to_float(scale: jax.Array) -> jax.Array:
    return scale.astype(jnp.float32)


@flax.struct.dataclass
class Fp8BlockWeight:
    """float8 e4m3 weight [..., out, in] with E8M0 scales [..., ceil(out/128), ceil(in/128)] (uint8 bytes)."""
    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        rows, cols = self.weight.shape[-2:]
        scale = _expand_blocks(e8m0_to_float(self.scale), rows, cols, FP8_BLOCK, FP8_BLOCK)
        return (self.weight.astype(jnp.float32) * scale).astype(dtype)

    dequantize_blocks = dequantize
    global_scale = None


def _fp4_times_block_scales(packed: jax.Array, block_scales: jax.Array, block: int, dtype) -> jax.Array:
    """Packed e2m1 pairs times float32 scales, one per `block` consecutive inputs (MXFP4 and NVFP4 share this)."""
    values = fp4_codes_to_float(unpack_fp4_codes(packed))
    return (values * jnp.repeat(block_scales, block, axis=-1)).astype(dtype)


@flax.struct.dataclass
class Mxfp4Weight:
    """OCP MXFP4: packed e2m1 pairs uint8 [..., out, in/2] (low nibble first), E8M0 bytes [..., out, in/32]."""
    packed: jax.Array
    scale: jax.Array
    block = MXFP4_BLOCK                                # inputs per block scale (a class constant, not a field)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _fp4_times_block_scales(self.packed, e8m0_to_float(self.scale), MXFP4_BLOCK, dtype)

    dequantize_blocks = dequantize
    global_scale = None


@flax.struct.dataclass
class Nvfp4Weight:
    """NVFP4 (docs/model.md 7.1): packed e2m1 pairs uint8 [..., out, in/2] (low nibble first), float8_e4m3fn block
    scales [..., out, in/16], float32 global scale (`weight_scale_2`) of shape [...] (one per matrix: [] for a single
    weight, [E] for stacked experts). W = e2m1 x block scale x global scale.

    `input_scale` is the checkpoint's static activation scale ([...] float32, or None when the checkpoint has
    none). It is kept only so device bytes equal checkpoint bytes and for diagnostics: it is a calibration
    constant, never used as the NVFP4 activation global scale (ops/matmul.py; tests/test_act_quant.py shows
    what it would do).
    """
    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    input_scale: jax.Array | None = None
    block = NVFP4_BLOCK                                # inputs per block scale (a class constant, not a field)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize_blocks(self, dtype=jnp.float32) -> jax.Array:
        """e2m1 x e4m3 block scale, without the global scale (exact in bf16)."""
        return _fp4_times_block_scales(self.packed, e4m3_to_float(self.scale), NVFP4_BLOCK, dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        gs = self.global_scale.astype(jnp.float32)[..., None, None]
        return (self.dequantize_blocks(jnp.float32) * gs).astype(dtype)


QUANTIZED_FORMATS = (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight)


def is_quantized(weight) -> bool:
    return isinstance(weight, QUANTIZED_FORMATS)


def check_weight(weight, what: str = "weight") -> None:
    """One-line error for anything that is not a stored weight format."""
    if is_quantized(weight) or isinstance(weight, jax.Array | np.ndarray):
        return
    raise TypeError(f"{what} must be a jax/numpy array, Fp8BlockWeight, Mxfp4Weight or Nvfp4Weight, "
                    f"got {type(weight).__name__}")


def dequantize(weight, dtype=jnp.float32) -> jax.Array:
    """Any stored weight (a format object or a plain array) as a dense `dtype` array (global scale included)."""
    check_weight(weight)
    if isinstance(weight, jax.Array | np.ndarray):
        return jnp.asarray(weight).astype(dtype)
    return weight.dequantize(dtype)


def dequantize_blocks(weight, dtype=jnp.float32) -> tuple[jax.Array, jax.Array | None]:
    """(dense `dtype` weight without its global scale, global scale [...] float32 or None). For every quantized
    format the dense part is exact in bf16, so a bf16 GEMM on it loses nothing."""
    check_weight(weight)
    if isinstance(weight, jax.Array | np.ndarray):
        return jnp.asarray(weight).astype(dtype), None
    gs = weight.global_scale
    return weight.dequantize_blocks(dtype), (None if gs is None else gs.astype(jnp.float32))


def weight_shape(weight) -> tuple[int, ...]:
    """Logical shape [..., out, in] of any stored weight."""
    return tuple(weight.shape)


def weight_bytes(weight) -> int:
    """Bytes the stored weight occupies (all its leaves)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(weight))


def split_f32(x: jax.Array):
    """float32 x -> bf16 (hi, lo) with x = hi + lo + O(2^-16 |x|). hi truncates through the bits: XLA on GPU
    (excess precision allowed) folds x - f32(bf16(x)) to 0, which silently dropped lo."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    hi = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    hi32 = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
    return hi, (x - hi32).astype(jnp.bfloat16)
