"""Activation quantizers for the `act_quant` modes of the run context (table in linear.py), pure jnp, on device.

Both quantizers work per row (one token's input vector of one linear), so a token's numerics never depend on
the other tokens in the batch: batch composition, padding rows and prefill-vs-decode chunking cannot change it.

fp8   (docs/model.md 3.1, 3.3; the reference's `act_quant`): blocks of 128 consecutive inputs, amax floored at 1e-4,
      power-of-two ("ue8m0") scale s = 2^ceil(log2(amax / 448)), q = e4m3(clamp(x / s, -448, 448)).
nvfp4 (docs/model.md 7.2, W4A4): global scale gsa = amax(row) / (6 * 448) computed from the live activation, per-16 e4m3
      block scales and e2m1 codes by the same recipe as weights (nvfp4.quantize_blocks). The checkpoint's
      `input_scale` is never used: it is a calibrated constant (for FP8 activations in NVIDIA's checkpoints)
      and as gsa it asks for block scales far above e4m3's 448, which saturate and clip every block.

Each quantizer returns the dequantized activation without its global factor, which is exact in bf16 (e4m3 x 2^k,
or e2m1 x e4m3: at most 6 significant bits), plus the per-row factor the GEMM output is multiplied by (nvfp4:
gsa; fp8: none, its power-of-two block scales are already inside the exact values). A trailing partial block
(only in small test models, K not a multiple of 128) is a block of its own, as the weights' scale grid is.

Exactness: on CPU every step is IEEE arithmetic and matches the numpy recipe bit for bit. XLA's GPU backend lowers
float32 division to `div.full` (<= 2 ulp), so on GPU a scaled value lying exactly on an e2m1 / e4m3 rounding tie --
common with bf16 activations, which carry 8 significant bits -- may round the other way (seen on an H200: the
global scale 1 ulp off in a quarter of the rows; a few codes flipped in the matmul tests). Weight quantization uses
the slower correctly_rounded_divide and is exact on both. The GPU kernels will define their own rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .fake_quant import exact_divide, pow2_ceil, round_to_e4m3
from .formats import NVFP4_BLOCK
from .nvfp4 import e2m1_magnitude, global_scale_from_amax, quantize_blocks, scale_blocks

FP8_ACT_BLOCK = 128
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4


def _pad_last(x: jax.Array, block: int) -> jax.Array:
    pad = -x.shape[-1] % block
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _fp8_blocks(x: jax.Array, block: int):
    """(e4m3 values as float32 [..., nb, block], power-of-two scales [..., nb]) of the zero-padded x."""
    xb = _pad_last(x.astype(jnp.float32), block).reshape(*x.shape[:-1], -1, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), FP8_AMAX_FLOOR)
    scale = pow2_ceil(exact_divide(amax, FP8_MAX))
    return round_to_e4m3(xb / scale[..., None]), scale


def quantize_fp8(x: jax.Array, block: int = FP8_ACT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (e4m3 values [..., K], power-of-two float32 scales [..., ceil(K/block)])."""
    q, scale = _fp8_blocks(x, block)
    return q.reshape(*x.shape[:-1], -1)[..., :x.shape[-1]].astype(jnp.float8_e4m3fn), scale


def fp8_activation(x: jax.Array, block: int = FP8_ACT_BLOCK) -> jax.Array:
    """The FP8-quantized activation as exact x.dtype values e4m3 x 2^k (what the FP8 GEMM multiplies)."""
    q, scale = _fp8_blocks(x, block)
    values = (q * scale[..., None]).reshape(*x.shape[:-1], -1)
    return values[..., :x.shape[-1]].astype(x.dtype)


def nvfp4_global_scale(x: jax.Array) -> jax.Array:
    """Runtime NVFP4 activation global scale of each row: amax(|x[..., :]|) / (6 * 448), shape [..., 1]. NaN for a
    row holding a NaN (e2m1 has no NaN code, and XLA's CPU max-reductions may skip NaNs), so a NaN activation
    still shows up in the GEMM output."""
    x = x.astype(jnp.float32)
    gsa = global_scale_from_amax(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    return jnp.where(jnp.any(jnp.isnan(x), axis=-1, keepdims=True), jnp.float32(jnp.nan), gsa)


def quantize_nvfp4(x: jax.Array, global_scale: jax.Array | None = None):
    """x [..., K] -> (e2m1 codes uint8 [..., K], e4m3 block scales [..., ceil(K/16)], global scale [..., 1]).
    `global_scale` defaults to the runtime per-row value; pass one only for experiments."""
    gsa = nvfp4_global_scale(x) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    codes, scale = quantize_blocks(_pad_last(x, NVFP4_BLOCK), gsa)
    return codes[..., :x.shape[-1]], scale, gsa


def nvfp4_activation(x: jax.Array, global_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(e2m1 x e4m3 block scale as exact x.dtype values [..., K], global scale [..., 1] float32)."""
    gsa = nvfp4_global_scale(x) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    scale, y = scale_blocks(_pad_last(x, NVFP4_BLOCK), gsa)
    values = jnp.where(y < 0, -e2m1_magnitude(y), e2m1_magnitude(y)) * scale.astype(jnp.float32)[..., None]
    return values.reshape(*x.shape[:-1], -1)[..., :x.shape[-1]].astype(x.dtype), gsa
