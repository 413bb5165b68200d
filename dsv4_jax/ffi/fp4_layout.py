"""The FP4 decode GEMV's own layout of packed e2m1 weights: the same bytes and block scales, permuted once at load
(dsv4_jax/ffi/fp4_gemv.cu, "The GEMV layout"):
* packed: the 32 bits of every 32-bit word (8 consecutive weights) permuted so that the kernel turns each weight
  pair into a bf16 pair with 10 instructions per word instead of 13, in input order;
* scale: within each 16-row tile, the bytes one kernel thread needs for one 128-input step (rows g and g + 8, its
  32 inputs: 1 E8M0 byte per row for MXFP4, 2 e4m3 bytes for NVFP4) made adjacent, and a warp's 32 threads'
  bytes contiguous: one 2- or 4-byte load per thread per step over 2 sectors per warp, instead of two 1- or 2-byte
  loads per thread over 16 sectors (measured: the checkpoint-order scale loads cost the kernel ~20%,
  benchmarks/probe_gemv.py). Scale order [..., N/16, K/128 steps, 8 (g), 4 (quad lane q), 2 (row g, g + 8),
  B' (bytes per 32 inputs: 1 MXFP4, 2 NVFP4)], flattened back to the [..., N, K/B] shape.

    to_gemv_layout(w: Mxfp4Weight | Nvfp4Weight) -> GemvLayoutFp4     lossless, one elementwise pass
    GemvLayoutFp4.to_checkpoint_layout() / .dequantize()               the inverse, and the reference math

Bit b of weight j of a word (weight j = nibble j counting from the word's least significant bits, i.e. byte j // 2,
low nibble first, as the checkpoint packs them; b = 0..2 the magnitude bits m, e0, e1 and b = 3 the sign) moves to
bit DEST[j][b]. The kernel's decode reads weights 2p and 2p + 1 at bf16 positions (6, 7, 8, 15) and (22, 23, 24,
31) after: nothing (p = 0), a left rotation by 13 (p = 1), a multiply by 2^3 + 2^14 of the bits (1, 3, 4, 5, 17,
19, 20, 21) (p = 2), a right rotation by 6 and a multiply by 2^0 + 2^5 (p = 3).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ..numerics.formats import Mxfp4Weight, Nvfp4Weight

DEST = ((6, 7, 8, 15), (22, 23, 24, 31),        # r0 = w & 0x81C081C0
        (25, 26, 27, 2), (9, 10, 11, 18),       # r1 = rotl(w, 13) & ...
        (3, 4, 5, 1), (19, 20, 21, 17),         # r2 = ((w & 0x003A003A) * 0x4008) & ...
        (12, 13, 14, 16), (28, 29, 30, 0))      # r3 = ((rotr(w, 6) & 0x05C005C0) * 0x21) & ...
assert sorted(d for dest in DEST for d in dest) == list(range(32))


def _permute_bits(words: jax.Array, source_of: dict[int, int]) -> jax.Array:
    """uint32 words -> words whose bit d is the input's bit source_of[d]."""
    out = jnp.zeros_like(words)
    for d, src in source_of.items():
        out = out | (((words >> src) & 1) << d)
    return out


_TO_GEMV = {DEST[j][b]: 4 * j + b for j in range(8) for b in range(4)}
_TO_CHECKPOINT = {src: dst for dst, src in _TO_GEMV.items()}


def _map_words(packed: jax.Array, source_of: dict[int, int]) -> jax.Array:
    """uint8 [..., K/2] viewed as little-endian uint32 words, each permuted; back to uint8 [..., K/2]."""
    if packed.shape[-1] % 4:
        raise ValueError(f"packed FP4 rows must hold whole 32-bit words (K % 8 == 0), got {packed.shape}")
    words = jax.lax.bitcast_convert_type(packed.reshape(*packed.shape[:-1], -1, 4), jnp.uint32)   # byte 0 lowest
    out = _permute_bits(words, source_of)
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(packed.shape)


def _map_scales(scale: jax.Array, block: int, to_gemv: bool) -> jax.Array:
    """Block scales [..., N, K/block] from checkpoint order to the GEMV layout's order (or back), same shape."""
    *lead, n, blocks = scale.shape
    per_32 = 32 // block                                          # scale bytes per row per 32 inputs
    if n % 16 or blocks % (4 * per_32):
        raise ValueError(f"the GEMV layout needs N % 16 == 0 and K % 128 == 0, got a scale of shape {scale.shape}")
    checkpoint = (*lead, n // 16, 2, 8, blocks // (4 * per_32), 4, per_32)      # tile, h, g, step, q, byte
    gemv = (*lead, n // 16, blocks // (4 * per_32), 8, 4, 2, per_32)            # tile, step, g, q, h, byte
    t = len(lead)
    if to_gemv:
        out = scale.reshape(checkpoint).transpose(*range(t), t, t + 3, t + 2, t + 4, t + 1, t + 5)
    else:
        out = scale.reshape(gemv).transpose(*range(t), t, t + 4, t + 2, t + 1, t + 3, t + 5)
    return out.reshape(scale.shape)


@flax.struct.dataclass
class GemvLayoutFp4:
    """An MXFP4 / NVFP4 weight whose packed bytes and block scales are in the GEMV layout (only ffi.gemv /
    grouped_gemv / moe_gemv read it directly; everything else goes through to_checkpoint_layout)."""
    weight: Mxfp4Weight | Nvfp4Weight

    @property
    def shape(self):
        return self.weight.shape

    def to_checkpoint_layout(self) -> Mxfp4Weight | Nvfp4Weight:
        w = self.weight
        return w.replace(packed=_map_words(w.packed, _TO_CHECKPOINT), scale=_map_scales(w.scale, w.block, False))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.to_checkpoint_layout().dequantize(dtype)


def to_gemv_layout(w: Mxfp4Weight | Nvfp4Weight) -> GemvLayoutFp4:
    if not isinstance(w, (Mxfp4Weight, Nvfp4Weight)):
        raise TypeError(f"to_gemv_layout: MXFP4 / NVFP4 weight expected, got {type(w).__name__}")
    return GemvLayoutFp4(w.replace(packed=_map_words(w.packed, _TO_GEMV), scale=_map_scales(w.scale, w.block, True)))
