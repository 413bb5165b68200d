"""Activation quantization, the op: an activation's FP8 (per-128, power-of-two scales) or NVFP4 (per-16 e4m3 scales
under a runtime global scale) quantization on its way into a quantized weight (ops/matmul.py's `act_quant` table).

Its reference is numerics/activations.py; its kernels, pallas_kernels/quantize.py, are bit-identical to it (the
definition; XLA:GPU's own run of the jnp reference is not, docs/kernels_quantize.md), so they serve every phase and
both paths see the same exact operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..numerics import activations
from ..numerics.formats import e4m3_to_float, fp4_codes_to_float, unpack_fp4_codes
from ..pallas_kernels.quantize import quantize_fp8_kernel, quantize_nvfp4_kernel
from . import choice


ACT_QUANTIZE = choice.Kernel("act_quantize", "quantize", phases=choice.ALL_PHASES)


def _act_quantize_backend(ctx) -> str | None:
    """The backend whose quantize kernel quantizes this activation, or None: the reference."""
    return ctx.kernels.backend if choice.takes_kernel(ACT_QUANTIZE, ctx) else None


def quantize_fp8(x: jax.Array, ctx) -> tuple[jax.Array, jax.Array]:
    """FP8 per-128 activation quantization (e4m3 [..., K], power-of-two float32 scales [..., K/128]): the Pallas
    quantize kernel on a kernel backend (bit-identical to the reference, dsv4_jax/pallas_kernels/quantize.py), else the
    reference (activations.quantize_fp8)."""
    backend = _act_quantize_backend(ctx)
    if backend is None:
        return activations.quantize_fp8(x)
    return quantize_fp8_kernel(x, interpret=backend == "interpret")


def fp8_activation(x: jax.Array, ctx) -> jax.Array:
    """The FP8-quantized activation as exact x.dtype values (activations.fp8_activation), quantized by the kernel
    on a kernel backend."""
    backend = _act_quantize_backend(ctx)
    if backend is None:
        return activations.fp8_activation(x)
    q, scale = quantize_fp8_kernel(x, interpret=backend == "interpret")
    scale = jnp.repeat(scale, activations.FP8_ACT_BLOCK, axis=-1)[..., :x.shape[-1]]
    return (q.astype(jnp.float32) * scale).astype(x.dtype)


def nvfp4_activation(x: jax.Array, ctx) -> tuple[jax.Array, jax.Array] | None:
    """(NVFP4-quantized activation as exact x.dtype values, runtime per-row global scale [..., 1]) from the Pallas
    quantize kernel on a kernel backend (the same amax / (6 * 448) rule, computed in the kernel); None on the
    reference path (the caller quantizes with activations.nvfp4_activation)."""
    backend = _act_quantize_backend(ctx)
    if backend is None:
        return None
    packed, scale, gsa = quantize_nvfp4_kernel(x, interpret=backend == "interpret")
    scale = jnp.repeat(e4m3_to_float(scale), 16, axis=-1)[..., :x.shape[-1]]
    return (fp4_codes_to_float(unpack_fp4_codes(packed)) * scale).astype(x.dtype), gsa
