"""Weight storage formats, kept in device memory exactly as stored in the checkpoint.

Each format is a pytree (flax.struct dataclass) whose leaves are the stored arrays; `dequantize` is the pure-jnp
reference math (the oracle for the GPU kernels). Shapes follow the checkpoint: a weight is [..., out, in] with the
reduction (input) dimension last; leading axes stack experts.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FP8_BLOCK = 128      # FP8 weights: one E8M0 scale per 128x128 block
MXFP4_BLOCK = 32     # MXFP4: one E8M0 scale per 32 consecutive inputs
NVFP4_BLOCK = 16     # NVFP4: one e4m3 scale per 16 consecutive inputs

# e2m1 code -> value; bit 3 is the sign (spec 6.2).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e8m0_to_float(scale_bytes: jax.Array) -> jax.Array:
    """E8M0 exponent bytes -> float32 2^(b-127); 0xFF is NaN. Never a numeric copy of the byte."""
    b = scale_bytes.astype(jnp.int32)
    value = jnp.ldexp(jnp.float32(1.0), b - 127)
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


@flax.struct.dataclass
class Mxfp4Weight:
    """OCP MXFP4: packed e2m1 pairs uint8 [..., out, in/2] (low nibble first), E8M0 bytes [..., out, in/32]."""
    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        values = fp4_codes_to_float(unpack_fp4_codes(self.packed))
        scale = jnp.repeat(e8m0_to_float(self.scale), MXFP4_BLOCK, axis=-1)
        return (values * scale).astype(dtype)


def dequantize(weight, dtype=jnp.float32) -> jax.Array:
    """Any stored weight (a format object or a plain array) as a dense `dtype` array."""
    if isinstance(weight, jax.Array | np.ndarray):
        return jnp.asarray(weight).astype(dtype)
    return weight.dequantize(dtype)


def weight_shape(weight) -> tuple[int, ...]:
    return tuple(weight.shape)
