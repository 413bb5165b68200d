"""Prefill matmul on FP8 tensor cores with per-128 block scales (DeepSeek's FP8 GEMM recipe, for many rows).

    fp8_block_matmul(xq, sx, wq, sw)    y[m, n] = sum_j (xq[m, J] . wq[n, J]) * sx[m, j] * sw[n, j]

where J is the j-th block of 128 inputs: xq e4m3 [M, K] with float32 scales sx [M, K/128] (the `fp8` activation
quantizer, dsv4_jax.quant.activations.quantize_fp8), wq e4m3 [N, K] with float32 per-row block scales
sw [N, K/128]. Weight formats reach it through:

    fp8_weight_operand(Fp8BlockWeight)   the stored e4m3 bytes; the 128x128 block scale repeated per row
    mxfp4_weight_operand(Mxfp4Weight)    e2m1 x 2^(e - r + 6) in e4m3, r = the largest E8M0 exponent of the
                                         row's four 32-blocks in each 128 block; scale 2^(r - 127 - 6). Exact
                                         while a row's 32-block exponents in one 128 block differ by <= 14
                                         (e4m3 subnormals reach 2^-9); a block further below its neighbours
                                         rounds to e4m3 (its contribution is < 2^-14 of theirs).

(NVFP4 is not offered: e2m1 x an e4m3 block scale has up to 5 significant bits, e4m3 holds 4.)

Backend: Pallas Triton (as gemv.py, whose docstring says why): tt.dot on e4m3 operands is Hopper's FP8 wgmma,
Triton pipelines the [BM, 128] / [BN, 128] tile loads. Each 128-wide K step's float32 product is scaled by
sx[:, j] x sw[:, j] and added to the accumulator (one FMA per output element per 128 MACs: "promotion" every
block, as DeepGEMM does). The oracle is dsv4_jax.quant.linear(x, w, act_quant="fp8") on the dequantized parts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv4_jax.quant.formats import E2M1_VALUES, Fp8BlockWeight, Mxfp4Weight, e8m0_to_float, unpack_fp4_codes

BK = 128        # inputs per scale block and per K step


def _kernel(x_ref, sx_ref, w_ref, sw_ref, o_ref, *, n_steps):
    def body(j, acc):
        a = x_ref[:, pl.ds(j * BK, BK)]                                   # [BM, 128] e4m3
        b = w_ref[:, pl.ds(j * BK, BK)]                                   # [BN, 128] e4m3
        part = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * (sx_ref[j, :][:, None] * sw_ref[j, :][None, :])

    acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def fp8_block_matmul(xq: jax.Array, sx: jax.Array, wq: jax.Array, sw: jax.Array, out_dtype=jnp.bfloat16, *,
                     block_m: int = 128, block_n: int | None = None, num_warps: int = 8, num_stages: int = 4,
                     interpret: bool = False) -> jax.Array:
    """y [M, N] (out_dtype) from xq e4m3 [M, K], sx f32 [M, K/128], wq e4m3 [N, K], sw f32 [N, K/128]."""
    what = "fp8_block_matmul"
    (m, k), (n, kw) = xq.shape, wq.shape
    if xq.dtype != jnp.float8_e4m3fn or wq.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{what}: xq and wq must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}")
    if k != kw or k % BK:
        raise ValueError(f"{what}: x [{m}, {k}] and w [{n}, {kw}] need the same K, a multiple of {BK}")
    if sx.shape != (m, k // BK) or sw.shape != (n, k // BK):
        raise ValueError(f"{what}: scales {sx.shape}, {sw.shape}; expected {(m, k // BK)} and {(n, k // BK)}")
    block_n = block_n or (128 if n % 128 == 0 else 64)
    if n % block_n:
        raise ValueError(f"{what}: N={n} must be a multiple of block_n={block_n}")
    m_pad = -m % block_m
    if m_pad:                                        # whole row tiles; padded rows are zeros and are cut off
        xq = jnp.pad(xq, ((0, m_pad), (0, 0)))
        sx = jnp.pad(sx, ((0, m_pad), (0, 0)))
    mp = m + m_pad
    y = pl.pallas_call(
        functools.partial(_kernel, n_steps=k // BK),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k // BK, block_m), lambda i, j: (0, i)),
                  pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
                  pl.BlockSpec((k // BK, block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsv4_fp8_block_matmul",
    )(xq, sx.astype(jnp.float32).T, wq, sw.astype(jnp.float32).T)
    return y[:m]


def _pow2(p: jax.Array) -> jax.Array:
    """2^p for integer p as float32 built from the exponent field (exact on every backend; p clipped to the
    normal range, where the callers' values are either exact or far below anything that matters)."""
    biased = (jnp.clip(p, -126, 127) + 127).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


def fp8_weight_operand(w: Fp8BlockWeight):
    """(e4m3 [N, K], per-row block scales f32 [N, K/128]) of a 2-D FP8-block weight (no copy of the bytes)."""
    n, _ = w.weight.shape
    return w.weight, jnp.repeat(e8m0_to_float(w.scale), BK, axis=0)[:n]


def mxfp4_weight_operand(w: Mxfp4Weight):
    """(e4m3 [N, K], f32 [N, K/128]) for a 2-D MXFP4 weight (module docstring: exactness)."""
    n, kh = w.packed.shape
    k = 2 * kh
    values = jnp.asarray(E2M1_VALUES)[unpack_fp4_codes(w.packed).astype(jnp.int32)].reshape(n, k // 32, 32)
    e = w.scale.astype(jnp.int32).reshape(n, k // BK, BK // 32)
    r = jnp.max(e, axis=-1, keepdims=True)                                  # [N, K/128, 1]
    wq = (values * _pow2(e - r + 6).reshape(n, k // 32, 1)).reshape(n, k).astype(jnp.float8_e4m3fn)
    return wq, _pow2(r[..., 0] - 127 - 6)
