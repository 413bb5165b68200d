"""Prefill matmul on FP8 tensor cores with per-128 block scales (DeepSeek's FP8 GEMM recipe, for many rows).

    fp8_block_matmul(xq, sx, wq, sw)    y[m, n] = sum_j (xq[m, J] . wq[n, J]) * sx[m, j] * sw[n, j]

where J is the j-th block of 128 inputs: xq e4m3 [M, K] with float32 scales sx [M, K/128] (the `fp8` activation
quantizer, dsv4_jax.numerics.activations.quantize_fp8), wq e4m3 [N, K] with float32 per-row block scales
sw [N, K/128] (or one per 128x128 block, [ceil(N/128), K/128]). Weight formats reach it through:

    fp8_weight_operand(Fp8BlockWeight)   the stored e4m3 bytes and 128x128 block scales [ceil(N/128), K/128]
    mxfp4_weight_operand(Mxfp4Weight)    e2m1 x 2^(e - r + 6) in e4m3, r = the largest E8M0 exponent of the
                                         row's four 32-blocks in each 128 block; scale 2^(r - 127 - 6). Exact
                                         while a row's 32-block exponents in one 128 block differ by <= 14
                                         (e4m3 subnormals reach 2^-9); a block further below its neighbours
                                         rounds to e4m3 (its contribution is < 2^-14 of theirs).

(NVFP4 is not offered: e2m1 x an e4m3 block scale has up to 5 significant bits, e4m3 holds 4.)

Backend: Pallas Triton (as gemv.py, whose docstring says why): tt.dot on e4m3 operands is Hopper's FP8 wgmma
(see fp8_dot_nt_p for the attribute that takes), Triton pipelines the [BM, 128] / [BN, 128] tile loads
(cp.async, num_stages deep). Each 128-wide K step's float32 product is scaled by sx[:, j] x sw[:, j] and added
to the float32 accumulator ("promotion" every block, as DeepGEMM does): one FMA per output element per 128 MACs
with block scales (the tile's weight scale is a scalar), two multiplies and an add with per-row scales.
The oracle is dsv4_jax.ops.matmul(x, w, act_quant="fp8") on the dequantized parts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics.formats import E2M1_VALUES, Fp8BlockWeight, Mxfp4Weight, e8m0_to_float, unpack_fp4_codes
from .tiles import pow2

BK = 128        # inputs per scale block and per K step


def _make_fp8_dot_primitive():
    """acc + a [BM, k] . b [BN, k]^T -> float32 [BM, BN] as one FP8 wgmma chain (k = BK, or dots chained through
    `acc` whose k sum to BK: moe_fp8.py's low and high nibbles, 64 inputs each). Pallas' own dot lowering leaves
    tt.dot's maxNumImpreciseAcc at 0, and for e4m3 operands with a float32 result Triton then refuses Hopper's
    FP8 wgmma (whose accumulator keeps fewer bits than float32) and falls back to mma.sync on operands upcast to
    f16, at about a third of the FP8 rate. Here the product of one 128-wide K block is an exact-enough wgmma
    partial that the kernel promotes into its float32 accumulator right away (DeepSeek's recipe), so the
    imprecise accumulation is bounded by BK. (Hopper's FP8 wgmma keeps ~14 significant bits in its accumulator,
    DeepSeek-V3 report 3.3.2: the kernel's result differs from exact float32 sums by ~1e-4 relative, measured.)"""
    from jax._src.pallas.triton import lowering as triton_lowering
    from jaxlib.triton import dialect as tt

    prim = jax_core.Primitive("dsv4_fp8_dot_nt")

    def _impl(a, b, acc):
        return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    prim.def_abstract_eval(lambda a, b, acc: jax_core.ShapedArray(acc.shape, jnp.float32))
    prim.def_impl(_impl)
    mlir.register_lowering(prim, mlir.lower_fun(_impl, multiple_results=False))
    triton_lowering.register_lowering(prim)(
        lambda ctx, a, b, acc: tt.dot(a, tt.trans(b, (1, 0)), acc, max_num_imprecise_acc=BK))
    return prim


fp8_dot_nt_p = _make_fp8_dot_primitive()


def _kernel(x_ref, sx_ref, w_ref, sw_ref, o_ref, *, n_steps, per_row_scales):
    def body(j, acc):
        part = fp8_dot_nt_p.bind(x_ref[:, pl.ds(j * BK, BK)], w_ref[:, pl.ds(j * BK, BK)],
                                 jnp.zeros(acc.shape, jnp.float32))                      # [BM, BN] f32
        if per_row_scales:                                                # MXFP4 operand: a scale per row
            return acc + (part * sx_ref[j, :][:, None]) * sw_ref[j, :][None, :]
        # FP8-block operand: one scale for the whole tile, folded into the row scales (one FMA per element)
        return acc + part * (sx_ref[j, :] * sw_ref[j, 0])[:, None]

    acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def fp8_block_matmul(xq: jax.Array, sx: jax.Array, wq: jax.Array, sw: jax.Array, out_dtype=jnp.bfloat16, *,
                     block_m: int = 64, block_n: int | None = None, num_warps: int = 4, num_stages: int = 3,
                     interpret: bool = False) -> jax.Array:
    """y [M, N] (out_dtype) from xq e4m3 [M, K], sx f32 [M, K/128], wq e4m3 [N, K] and its f32 scales sw, either
    per row [N, K/128] or per 128x128 block [ceil(N/128), K/128].

    Default tile: 64 x 128, one warpgroup, 3 stages (48 KB of SMEM: several CTAs per SM, so one CTA's promotion
    FMAs overlap another's wgmma). Measured on the H200 against 128 x 128 with 8 warps and 4 stages (one CTA per
    SM): 683 vs 417 TFLOP/s by wall time on 4096 x 4096 x 8192 (docs/bench/h200_2026-11-30_prefill.json)."""
    what = "fp8_block_matmul"
    (m, k), (n, kw) = xq.shape, wq.shape
    if xq.dtype != jnp.float8_e4m3fn or wq.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{what}: xq and wq must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}")
    if k != kw or k % BK:
        raise ValueError(f"{what}: x [{m}, {k}] and w [{n}, {kw}] need the same K, a multiple of {BK}")
    per_row = sw.shape == (n, k // BK)
    if sx.shape != (m, k // BK) or not (per_row or sw.shape == (-(-n // BK), k // BK)):
        raise ValueError(f"{what}: scales {sx.shape}, {sw.shape}; expected {(m, k // BK)} and {(n, k // BK)} "
                         f"or {(-(-n // BK), k // BK)}")
    block_n = block_n or (128 if n % 128 == 0 else 64)
    if n % block_n or (not per_row and BK % block_n):
        raise ValueError(f"{what}: N={n} must be a multiple of block_n={block_n} (<= 128 with block scales)")
    m_pad = -m % block_m
    if m_pad:                                        # whole row tiles; padded rows are zeros and are cut off
        xq = jnp.pad(xq, ((0, m_pad), (0, 0)))
        sx = jnp.pad(sx, ((0, m_pad), (0, 0)))
    mp = m + m_pad
    if per_row:
        sw_spec = pl.BlockSpec((k // BK, block_n), lambda i, j: (0, j))
    else:
        tiles_per_block = BK // block_n
        sw_spec = pl.BlockSpec((k // BK, 1), lambda i, j: (0, j // tiles_per_block))
    y = pl.pallas_call(
        functools.partial(_kernel, n_steps=k // BK, per_row_scales=per_row),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k // BK, block_m), lambda i, j: (0, i)),
                  pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
                  sw_spec],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsv4_fp8_block_matmul",
    )(xq, sx.astype(jnp.float32).T, wq, sw.astype(jnp.float32).T)
    return y[:m]


def fp8_weight_operand(w: Fp8BlockWeight):
    """(e4m3 [N, K], block scales f32 [ceil(N/128), K/128]) of a 2-D FP8-block weight (no copy of the bytes)."""
    return w.weight, e8m0_to_float(w.scale)


def mxfp4_weight_operand(w: Mxfp4Weight):
    """(e4m3 [N, K], f32 [N, K/128]) for a 2-D MXFP4 weight (module docstring: exactness)."""
    n, kh = w.packed.shape
    k = 2 * kh
    values = jnp.asarray(E2M1_VALUES)[unpack_fp4_codes(w.packed).astype(jnp.int32)].reshape(n, k // 32, 32)
    e = w.scale.astype(jnp.int32).reshape(n, k // BK, BK // 32)
    r = jnp.max(e, axis=-1, keepdims=True)                                  # [N, K/128, 1]
    wq = (values * pow2(e - r + 6).reshape(n, k // 32, 1)).reshape(n, k).astype(jnp.float8_e4m3fn)
    return wq, pow2(r[..., 0] - 127 - 6)
