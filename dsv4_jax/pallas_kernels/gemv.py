"""Decode and verify matmuls (M <= 256 activation rows) that stream FP8-block / MXFP4 / NVFP4 weights as stored.

    fp8_matmul(x, w: Fp8BlockWeight)   y = x @ dequant(W)^T     W e4m3 [N, K], E8M0 per 128x128 block
    mxfp4_matmul(x, w: Mxfp4Weight)    y = x @ dequant(W)^T     W e2m1 pairs [N, K/2], E8M0 per 32 inputs
    nvfp4_matmul(x, w: Nvfp4Weight)    y = x @ dequant(W)^T     W e2m1 pairs, e4m3 per 16 inputs, fp32 global

x is [M, K] bf16 or float32 (M <= 256 for bf16, <= 128 for float32), accumulation is float32, the result is
[M, N] in `out_dtype` (default x.dtype). The oracle is dsv4_jax.ops.matmul(x, w) (act_quant="none").

Backend: Pallas **Triton** (`pl.pallas_call` + `triton.CompilerParams`), not Mosaic GPU. Why: a decode GEMV has
few rows (16 or fewer up to batch 16), and its hot loop is the FP4 nibble decode feeding the tensor cores from
registers. Mosaic GPU's wgmma path wants 64-row tiles in SMEM and its FP4 converts are Blackwell `cvt`s; expressing
a register-level nibble decode there needs the low-level `inline_mgpu` API. Triton lays out registers itself: the
weights are the wgmma A operand (64-row tiles of output features, decoded in registers), the activation rows are
the N = 16..128 B operand, and a custom inline-PTX primitive decodes two packed bytes at a time. (The Triton backend is
deprecated in JAX 0.11 but present and working in the pinned 0.11.2.)

Kernel design (see docs/kernels.md for measurements):
  * The activation rows are the dot's columns: 16 (Triton's minimum), 32, 64 or 128 of them per program (the
    rows padded to a power of two), and above 128 rows tiles of 128 columns (`activation_tiling`). So a decode
    step of batch 32 or 64, or a verify step of up to 256 rows, reads each weight once from memory instead of
    dequantizing it to bf16 for XLA's dot: the column tiles are the grid's fastest axis, so the programs that
    share a weight tile run together and the second reads it from L2.
  * grid = (column tiles, N / block_n, split_k): each program owns block_n output features and 1/split_k of K,
    loops over K in steps of `unroll` scale blocks; Triton software-pipelines the weight loads (cp.async,
    num_stages deep). Each program stores its tile transposed, so the output is [split_k, rows, N], row-major as
    the caller wants it; split-K partials are summed in the wrapper's epilogue fusion (one split: no pass at all),
    and the split is capped so the partials stay smaller than the weight (`_split_cap`). From 64 columns the
    tiles hold 64 weight rows (the accumulator is block_n x columns float32 in registers).
  * FP4 decode (MXFP4 and NVFP4 share it): the packed tile is viewed [block_n, blocks, bytes_per_block] so the
    per-(row, block) scale broadcasts over the last axis. The PTX primitive takes 2 bytes (4 weights) and the
    scale factor and returns (low nibbles, high nibbles) as bf16 pairs with, per pair of nibbles,
        y   = prmt(bytes) -> byte 0 in bits 0-7, byte 1 in bits 16-23
        lo  = ((y & 0x000F000F) * 0x1040) & 0x81C081C0     (sign -> bit 15, e2m1 exponent+mantissa -> bits 6-8)
        hi  = ((y & 0x00F000F0) * 0x0104) & 0x81C081C0
    which is the e2m1 value times 2^-126 as a bf16 (e = 0 codes land on bf16 subnormals), then one
    mul.rn.bf16x2 by the block scale times 2^126 (exact: at most 6 significant bits). The low nibbles multiply
    the even inputs of x, the high nibbles the odd ones: two dots, no interleave.
  * E8M0 scale bytes become a bf16 exponent field directly (`(b + 126 - 32) << 7`, never a numeric copy of
    the byte); 2^32 is taken back in the epilogue so scales from 2^-99 to 2^33 stay exact in bf16.
    NVFP4's e4m3 block scale is converted exactly (e4m3 -> bf16) times 2^118; 2^8 and the fp32 global scale are
    applied in the epilogue.
  * FP8: Triton's native e4m3 -> f16 convert (cvt.rn.f16x2.e4m3x2) feeds f16 wgmma; the kernel reads the bf16
    rows as they are and turns them into f16 after a per-row power-of-two prescale from their largest magnitude in
    the program's K range (bf16 values are exact in f16 in range; the prescale is undone before the store), and
    the 128x128 block scale multiplies each 128-wide K step's float32 partial product. So an FP8 matmul is one
    launch (two with split-K): the prescale, the f16 copy of x transposed, and the transposed output were three
    more XLA passes per matmul (the FP8 family's launches in a 4-layer Flash decode step at batch 64, compiled for an
    H200: 122 of 291 before, 50 of 219 after). But every program of a weight tile reads its activation columns
    twice (the amax pass, the loop) and converts them every step: at 64 columns and 64-row tiles twice the weight
    tile's bytes per step. So at 32-64 columns the weight tiles are 128 rows on 8 warps (_fp8_tiling: half the
    programs read the columns; faster for 13 of Flash's 14 dense projections on an H100, 2026-12-07). Two options
    the GPU sweep times beside it (`bash benchmarks/gpu_runs.sh dense`): `row_prescale=True`, the rows prescaled
    and converted to f16 once before the launch (f16_rows, a launch of its own: faster only for wq_b so far), and
    256-row tiles (two 128-row scale blocks per tile; slower so far).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics.formats import E2M1_VALUES, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, split_f32
from .tiles import pow2

MP = 16                 # activation rows per tensor-core dot at least (Triton's minimum dot width)
MAX_COLS = 128          # activation columns per program; more rows take several column tiles
MAX_ROWS = 256          # bf16 activation rows per call (float32: half, as hi + lo parts)
FP8_BLOCK = 128
MX_SHIFT = 32           # MXFP4 factors are 2^(scale - 1 - MX_SHIFT); the epilogue multiplies by 2^MX_SHIFT
NV_SHIFT = 8            # NVFP4 factors are e4m3 scale * 2^(126 - NV_SHIFT)

# ---- the FP4 decode: constants shared by the PTX and its numpy/jnp emulation ---------------------------------
PRMT_SPREAD = 0x4140            # bytes (b0, b1) of a 16-bit value -> b0 in bits 0-7, b1 in bits 16-23
LO_FIELD, LO_MUL = 0x000F000F, 0x1040
HI_FIELD, HI_MUL = 0x00F000F0, 0x0104
BF16_E2M1_MASK = 0x81C081C0

FP4_DECODE_PTX = f"""{{
.reg .b32 t, y, a;
cvt.u32.u16 t, $2;
prmt.b32 y, t, 0, {PRMT_SPREAD:#x};
and.b32 a, y, {LO_FIELD:#x}; mul.lo.u32 a, a, {LO_MUL:#x}; and.b32 a, a, {BF16_E2M1_MASK:#x};
mul.rn.bf16x2 $0, a, $3;
and.b32 a, y, {HI_FIELD:#x}; mul.lo.u32 a, a, {HI_MUL:#x}; and.b32 a, a, {BF16_E2M1_MASK:#x};
mul.rn.bf16x2 $1, a, $3;
}}"""


def fp4_decode_bits_np(two_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy emulation of the integer part of FP4_DECODE_PTX: uint16 (b0 | b1 << 8) -> (lo, hi) uint32 bf16 pairs
    (low half: byte 0's nibble, high half: byte 1's) holding e2m1 value * 2^-126. Used by the tests to check the
    constants against the e2m1 table for every byte."""
    t = two_bytes.astype(np.uint32)
    y = (t & 0xFF) | ((t >> 8) & 0xFF) << 16                         # prmt 0x4140
    lo = ((y & LO_FIELD) * LO_MUL & 0xFFFFFFFF) & BF16_E2M1_MASK
    hi = ((y & HI_FIELD) * HI_MUL & 0xFFFFFFFF) & BF16_E2M1_MASK
    return lo.astype(np.uint32), hi.astype(np.uint32)


def _factor_exponent(f_bits: jax.Array) -> jax.Array:
    return ((f_bits >> 7) & 0xFF).astype(jnp.int32)


def _fp4_decode_emulated(w: jax.Array, f_bits: jax.Array):
    """What the PTX computes, elementwise and exactly, in plain jnp (interpret mode and CPU)."""
    table = jnp.asarray(E2M1_VALUES)
    f = jax.lax.bitcast_convert_type((f_bits & 0xFFFF).astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)
    # value * 2^-126 * f, computed without a float32 subnormal intermediate (XLA flushes those)
    f = f * jnp.float32(2.0 ** -63) * jnp.float32(2.0 ** -63)
    lo = table[(w & 0xF).astype(jnp.int32)] * f
    hi = table[(w >> 4).astype(jnp.int32)] * f
    return lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)


def _make_fp4_decode_primitive():
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering
    from jaxlib.triton import dialect as tt

    prim = jax_core.Primitive("dsv4_fp4_decode")
    prim.multiple_results = True

    @prim.def_abstract_eval
    def _abstract(w, f):
        return [jax_core.ShapedArray(w.shape, jnp.bfloat16)] * 2

    prim.def_impl(lambda w, f: _fp4_decode_emulated(w, f))
    mlir.register_lowering(prim, mlir.lower_fun(_fp4_decode_emulated, multiple_results=True))

    @triton_lowering.register_lowering(prim)
    def _triton(ctx, w, f):
        types = [ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(jnp.dtype(a.dtype))) for a in ctx.avals_out]
        # pack=2: each instance sees two consecutive elements (one 16-bit register of bytes, two 32-bit factor
        # registers) and writes two bf16 pairs; element order is preserved, so any Triton layout is correct.
        res = tt.elementwise_inline_asm(types, FP4_DECODE_PTX, constraints="=r,=r,h,r,r", pure=True,
                                        packed_element=2, args=[w, f])
        return list(res)

    return prim


fp4_decode_p = _make_fp4_decode_primitive()


def _make_dot_acc_primitive():
    """acc + a @ b as one tensor-core op (Triton's tt.dot with its accumulator operand), so the running sum stays
    in the wgmma accumulator registers instead of a separate float32 add per element per step."""
    from jax._src.pallas.triton import lowering as triton_lowering
    from jaxlib.triton import dialect as tt

    prim = jax_core.Primitive("dsv4_dot_acc")

    def _impl(a, b, acc):
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    prim.def_abstract_eval(lambda a, b, acc: jax_core.ShapedArray(acc.shape, jnp.float32))
    prim.def_impl(_impl)
    mlir.register_lowering(prim, mlir.lower_fun(_impl, multiple_results=False))
    triton_lowering.register_lowering(prim)(lambda ctx, a, b, acc: tt.dot(a, b, acc))
    return prim


dot_acc_p = _make_dot_acc_primitive()


# ---- scale factors (bf16 pairs as uint32 bits) ----------------------------------------------------------------
def mx_factor_bits(scale: jax.Array) -> jax.Array:
    """E8M0 byte b -> bf16 2^(b - 1 - MX_SHIFT) (times 2^126 this undoes the decode's 2^-126) in both halves.
    Exact for b in [MX_SHIFT - 4, 128 + MX_SHIFT] (2^-99 .. 2^33: any real checkpoint). Not handled: the NaN
    byte 0xFF (a per-element select here costs 0.25 instructions per weight in the hot loop)."""
    e = scale.astype(jnp.uint32) + jnp.uint32(126 - MX_SHIFT)
    return e * jnp.uint32(0x00800080)


def nv_factor_bits(scale_bits: jax.Array) -> jax.Array:
    """e4m3 block-scale bits -> bf16 s * 2^(126 - NV_SHIFT) in both halves with one integer multiply-add: the
    e4m3 exponent and mantissa slide into the bf16 fields, (byte << 4) + ((238) << 7), replicated by * 0x10001.
    Exact for every normal positive e4m3 scale (2^-6 .. 448). Subnormal scales (< 2^-6, blocks over 2^15 below
    the matrix maximum) come out as 2^-6 * (1 + m/8) instead of m * 2^-9: `nvfp4_kernel_exact` tells whether a
    weight has any (the exact conversion costs ~5 instructions per scale use in the hot loop)."""
    return scale_bits.astype(jnp.uint32) * jnp.uint32(0x00100010) + jnp.uint32(0x77007700)


def nvfp4_kernel_exact(w: Nvfp4Weight) -> jax.Array:
    """True where the NVFP4 kernel reproduces dequantize(w) exactly: no block scale is an e4m3 subnormal, zero,
    negative or NaN (check once at load time, not per step)."""
    bits = jax.lax.bitcast_convert_type(w.scale, jnp.uint8)
    return jnp.all((bits >= 0x08) & (bits < 0x7F))


# ---- kernels ----------------------------------------------------------------------------------------------------
def _store_rows(o_ref, acc, m_valid):
    """acc [block_n, columns] of this program's column tile (grid axis 0) -> o_ref [columns, block_n], transposed so
    the output is [activation rows, N] as the caller wants it (stored as computed, XLA added a transposing pass over
    the output after the kernel: a launch and, for wide N, more bytes than the weight's), writing only the rows
    that are one of the first m_valid activation rows."""
    out = acc.T
    rows = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0) + pl.program_id(0) * out.shape[0]
    pltriton.store(o_ref, out, mask=rows < m_valid)


def _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, *, block_n, unroll, n_steps, bytes_per_block, factor_fn,
                   w_index=(), row0=None, blk0=0):
    """Sum over this program's K range of decode(W tile) @ x tiles -> float32 [block_n, cols] (cols = the x refs'
    last dim: MP activation rows for decode, more for the MoE prefill). Without w_index the refs are this
    program's blocks; with it (stacked experts) they are whole arrays indexed at
    [*w_index, row0:row0 + block_n, blk0 + ...]."""
    step_k2 = unroll * bytes_per_block                 # packed bytes (= lo / hi elements) per step
    rows = slice(None) if row0 is None else pl.ds(row0, block_n)

    def body(i, acc):
        blks = pl.ds(blk0 + i * unroll, unroll)
        w = w_ref[(*w_index, rows, blks, slice(None))]                                  # [bn, unroll, B] u8
        s = s_ref[(*w_index, rows, blks)]                                               # [bn, unroll]
        f = jnp.broadcast_to(factor_fn(s)[:, :, None], w.shape)
        lo, hi = fp4_decode_p.bind(w, f)
        lo = lo.reshape(block_n, step_k2)
        hi = hi.reshape(block_n, step_k2)
        xl = xlo_ref[pl.ds(i * step_k2, step_k2), :]
        xh = xhi_ref[pl.ds(i * step_k2, step_k2), :]
        return dot_acc_p.bind(hi, xh, dot_acc_p.bind(lo, xl, acc))

    return jax.lax.fori_loop(0, n_steps, body, jnp.zeros((block_n, xlo_ref.shape[-1]), jnp.float32))


def _fp4_kernel(xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *, m_valid, **kw):
    _store_rows(o_ref, _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, **kw), m_valid)


def f16_prescale_exponent(amax: jax.Array) -> jax.Array:
    """The power p with amax * 2^p in [2^13, 2^14) (0 for amax 0; clipped to [-100, 100]): bf16 values times 2^p
    are exact f16 values down to amax * 2^-27 (below, f16 subnormals; their contribution is under float32 rounding).
    From amax's exponent field, as the kernel computes it (no log2 on the GPU's special-function unit)."""
    e = ((jax.lax.bitcast_convert_type(amax, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - 127
    return jnp.where(amax > 0, jnp.clip(13 - e, -100, 100), 0)


def _fp8_steps(x_step, w_ref, s_ref, *, block_n, cols, n_steps):
    """The float32 sums over this program's K range of the e4m3 weight tile times the f16 activation columns
    x_step(i) [columns, 128] of K step i, each step's product times its 128x128 block scale: one [min(block_n, 128),
    columns] sum per 128-row scale block of the tile (a 256-row tile: two, each step's x loaded once for both)."""
    sub = min(block_n, FP8_BLOCK)

    def body(i, accs):
        x = x_step(i)
        out = []
        for h, acc in enumerate(accs):
            w = w_ref[pl.ds(h * sub, sub), pl.ds(i * FP8_BLOCK, FP8_BLOCK)].astype(jnp.float16)     # [sub, 128]
            part = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            b = s_ref[h, i].astype(jnp.uint32)
            out.append(acc + part * jax.lax.bitcast_convert_type(b << 23, jnp.float32))      # 2^(b-127)
        return tuple(out)

    return jax.lax.fori_loop(0, n_steps, body, tuple(jnp.zeros((sub, cols), jnp.float32)
                                                     for _ in range(block_n // sub)))


def _store_parts(o_ref, accs, undo, m_valid):
    """Each scale block's sum [sub, columns] times undo [columns] into its columns of o_ref [columns, block_n]."""
    sub = accs[0].shape[0]
    for h, acc in enumerate(accs):
        _store_rows(o_ref.at[:, pl.ds(h * sub, sub)], acc * undo[None, :], m_valid)


def _fp8_kernel(x_ref, w_ref, s_ref, o_ref, *, block_n, n_steps, m_valid):
    """x_ref [columns, K range] bf16 activation rows, w_ref [block_n, K range] e4m3, s_ref [1, K range / 128] E8M0
    -> o_ref [columns, block_n] float32.

    The rows become the f16 operand of f16 tensor-core dots (Triton's native e4m3 -> f16 convert feeds the weight
    side) after a power-of-two prescale per row, from the row's largest magnitude in this program's K range (one
    pass over that slice of x, which is small and in L2, before the main loop). The prescale is undone on the
    float32 sum: powers of two leave every product and sum bit for bit what they are without them, so the result
    does not depend on the split."""
    cols = x_ref.shape[0]

    def row_amax(i, amax):
        x = x_ref[:, pl.ds(i * FP8_BLOCK, FP8_BLOCK)].astype(jnp.float32)
        return jnp.maximum(amax, jnp.max(jnp.abs(x), axis=1))

    p = f16_prescale_exponent(jax.lax.fori_loop(0, n_steps, row_amax, jnp.zeros((cols,), jnp.float32)))
    up = pow2(p)

    def x_step(i):
        return (x_ref[:, pl.ds(i * FP8_BLOCK, FP8_BLOCK)].astype(jnp.float32) * up[:, None]).astype(jnp.float16)

    accs = _fp8_steps(x_step, w_ref, s_ref, block_n=block_n, cols=cols, n_steps=n_steps)
    _store_parts(o_ref, accs, pow2(-p), m_valid)


def _fp8_prescaled_kernel(x_ref, undo_ref, w_ref, s_ref, o_ref, *, block_n, n_steps, m_valid):
    """_fp8_kernel on rows the wrapper prescaled once over the whole of K (`row_prescale`): x_ref [columns, K
    range] f16, undo_ref [columns] float32 (2^-p of each row). No amax pass and no per-step convert of x: with many
    activation columns those, repeated by every program of a weight tile, read x from L2 twice per program and
    convert it once per step (at 64 columns x is twice the weight tile's bytes per step)."""
    cols = x_ref.shape[0]
    accs = _fp8_steps(lambda i: x_ref[:, pl.ds(i * FP8_BLOCK, FP8_BLOCK)], w_ref, s_ref, block_n=block_n, cols=cols,
                      n_steps=n_steps)
    _store_parts(o_ref, accs, undo_ref[...], m_valid)


def f16_rows_reference(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """bf16 rows [M, K] -> (f16 rows prescaled by 2^p, p from each row's largest magnitude over all of K
    (f16_prescale_exponent), and 2^-p float32 [M] to undo it): exact, as bf16 values times a power of two that
    keeps them in f16's range (those under 2^-27 of the row's largest become f16 subnormals, below float32
    rounding of the row's products). The definition of f16_rows' kernel."""
    x = rows.astype(jnp.float32)
    p = f16_prescale_exponent(jnp.max(jnp.abs(x), axis=1))
    return (x * pow2(p)[:, None]).astype(jnp.float16), pow2(-p)


F16_ROWS_PER_PROGRAM = 4
F16_ROWS_STEP = 512       # inputs per row and loop step


def _f16_rows_kernel(x_ref, o_ref, undo_ref, *, n_steps):
    """x_ref [rows, K] bf16 -> o_ref [rows, K] f16 prescaled, undo_ref [rows] float32: f16_rows_reference in two
    passes over the program's rows (the largest magnitude, then the scaled copy), the second from L2."""
    def step(i):
        return x_ref[:, pl.ds(i * F16_ROWS_STEP, F16_ROWS_STEP)].astype(jnp.float32)

    amax = jax.lax.fori_loop(0, n_steps, lambda i, m: jnp.maximum(m, jnp.max(jnp.abs(step(i)), axis=1)),
                             jnp.zeros((x_ref.shape[0],), jnp.float32))
    p = f16_prescale_exponent(amax)
    up = pow2(p)

    def write(i, carry):
        o_ref[:, pl.ds(i * F16_ROWS_STEP, F16_ROWS_STEP)] = (step(i) * up[:, None]).astype(jnp.float16)
        return carry

    jax.lax.fori_loop(0, n_steps, write, 0)
    undo_ref[...] = pow2(-p)


def f16_rows(rows: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """f16_rows_reference in one launch (XLA made it three: the rows' largest magnitudes, the scaled copy and the
    undo factors). Rows a multiple of F16_ROWS_PER_PROGRAM and K of F16_ROWS_STEP (fp8_matmul pads its rows to
    whole column tiles; K is a multiple of 128: otherwise the reference)."""
    m, k = rows.shape
    if m % F16_ROWS_PER_PROGRAM or k % F16_ROWS_STEP:
        return f16_rows_reference(rows)
    block = F16_ROWS_PER_PROGRAM
    return pl.pallas_call(
        functools.partial(_f16_rows_kernel, n_steps=k // F16_ROWS_STEP),
        out_shape=(jax.ShapeDtypeStruct((m, k), jnp.float16), jax.ShapeDtypeStruct((m,), jnp.float32)),
        grid=(m // block,),
        in_specs=[pl.BlockSpec((block, k), lambda r: (r, 0))],
        out_specs=(pl.BlockSpec((block, k), lambda r: (r, 0)), pl.BlockSpec((block,), lambda r: (r,))),
        compiler_params=_params(4, 2),
        interpret=interpret,
        name="dsv4_f16_rows",
    )(rows.astype(jnp.bfloat16))


# ---- wrappers ---------------------------------------------------------------------------------------------------
def _params(num_warps, num_stages):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _activation_columns(x: jax.Array, what: str):
    """x [M, K] -> (bf16 operand [M', K] of exact parts, number of rows used M', how to fold rows back).
    float32 x is split into bf16 hi + lo rows (x = hi + lo to 2^-16 relative), so its error stays near float32's."""
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be [M, K], got shape {x.shape}")
    m = x.shape[0]
    if x.dtype == jnp.float32:
        if 2 * m > MAX_ROWS:
            raise ValueError(f"{what}: float32 x supports at most {MAX_ROWS // 2} rows, got {m}")
        hi, lo = split_f32(x)
        rows = jnp.concatenate([hi, lo], axis=0)
        return rows, 2 * m, lambda y: y[:m] + y[m:2 * m]
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: x must be bfloat16 or float32, got {x.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"{what}: at most {MAX_ROWS} rows, got {m} (use the prefill path)")
    return x.astype(jnp.bfloat16), m, lambda y: y[:m]


def activation_tiling(rows: int) -> tuple[int, int]:
    """(columns per program, column tiles) for `rows` activation rows (bf16 rows, or float32 hi + lo parts): the
    smallest power of two from MP that holds them, up to MAX_COLS; above that, tiles of MAX_COLS."""
    cols = MP
    while cols < min(rows, MAX_COLS):
        cols *= 2
    return cols, -(-rows // cols)


def _split_cap(k_bytes_per_row: float, cols: int) -> int:
    """The largest split of K whose float32 partials (split x N x cols x 4 bytes) stay under the weight's bytes
    (N x k_bytes_per_row): beyond it the epilogue moves more bytes than the kernel saves."""
    return max(1, int(k_bytes_per_row // (4 * cols)))


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def _sum_split(part: jax.Array, m: int) -> jax.Array:
    """The first m rows of the split-K partials [split, rows, N] summed (one split: the rows themselves, no pass)."""
    return part[0, :m] if part.shape[0] == 1 else jnp.sum(part[:, :m], axis=0)


def _pick_split(n_tiles: int, k_steps: int, target_programs: int = 264, max_split: int | None = None) -> int:
    split = 1
    while (n_tiles * split < target_programs and k_steps % (split * 2) == 0 and k_steps // (split * 2) >= 2
           and (max_split is None or split * 2 <= max_split)):
        split *= 2
    return split


def _default_block_n(n: int, cols: int = MP) -> int:
    """64 weight rows per tile from 64 activation columns (the float32 accumulator block_n x cols lives in
    registers), else 128 where N allows."""
    return 128 if n % 128 == 0 and cols < 64 else 64


WIDE_TILE_COLS = (32, 64)  # activation columns per program at which an FP8 GEMV takes 128-row weight tiles on 8 warps


def _fp8_tiling(n: int, cols: int, col_tiles: int, block_n, num_warps, row_prescale) -> tuple[int, int, bool]:
    """fp8_matmul's (block_n, num_warps, row_prescale), each given or by default. At WIDE_TILE_COLS activation
    columns (a serving batch's 17-64 rows): tiles of 128 weight rows on 8 warps, faster than the tiling before
    (64-row tiles on 4 warps at 64 columns, 128-row tiles on 4 warps at 32) for 13 of Flash's 14 dense
    projections at 32 and 64 rows, by 0.2-11 us a call (one H100, 2026-12-07; docs/performance.md, "Timed:
    128-row weight tiles"). With more than one column tile (129-256 rows): the same tiles with the rows' f16
    prescale made once before the launch, 106 us a layer faster than the default tiling over six of Flash's seven
    dense projections at 256 rows (wq_b 107 -> 68 us, wo_a 108 -> 73, wo_b 112 -> 82, shared_w1 31 -> 27; wq_a and
    wkv 2-3 us slower; at 128 rows it was slower: one H100, 2026-12-07, docs/performance.md "Batch 256").
    Otherwise _default_block_n's tiles on 4 warps (the step at batch 128 was 2% slower with 128-row tiles). Each
    program prescales its own slice of the rows unless `row_prescale`."""
    wide = col_tiles > 1
    if row_prescale is None:
        row_prescale = wide
    if block_n is None:
        block_n = 128 if n % 128 == 0 and (cols in WIDE_TILE_COLS or wide) else _default_block_n(n, cols)
    if num_warps is None:
        num_warps = 8 if block_n == 128 and (cols in WIDE_TILE_COLS or wide) else 4
    return block_n, num_warps, row_prescale


def _split_k(split_k, n_tiles: int, steps: int, what: str, max_split: int | None = None) -> int:
    """The requested split of the K steps, or enough of one to fill the GPU (at most max_split); it must divide
    the steps."""
    if split_k is None:
        split_k = _pick_split(n_tiles, steps, max_split=max_split)
    if steps % split_k:
        raise ValueError(f"{what}: split_k={split_k} does not divide the {steps} K steps")
    return split_k


def _check_fp4(w, what):
    n, kh = w.packed.shape[-2:]
    k = 2 * kh
    block = w.block
    if k % block or w.scale.shape[-1] != k // block or w.scale.shape[-2] != n:
        raise ValueError(f"{what}: scale shape {w.scale.shape} does not match weight [{n}, {k}]")
    return n, k, block


def _fp4_config(n, k, block, block_n, unroll, split_k, num_warps, num_stages, cols=MP, max_split=None):
    bytes_per_block = block // 2
    if unroll is None:
        unroll = max(1, 128 // bytes_per_block)          # 128 packed bytes (256 inputs) per row per step
    blocks = k // block
    block_n = block_n or _default_block_n(n, cols)
    if n % block_n or blocks % unroll:
        raise ValueError(f"FP4 matmul needs N % {block_n} == 0 and K % {block * unroll} == 0, got N={n}, K={k}")
    if num_warps >= 8 and num_stages > 1 and unroll * bytes_per_block == 32:
        # H200, jax 0.11.2's Triton: 128-row tiles on 8 warps with 32 packed bytes per row per K step and a
        # pipelined loop wrote non-finite values into up to 4% of the outputs, varying by shape; 4 warps, 1 stage,
        # 16 or 64 bytes per step were exact (benchmarks/probe_moe_tilings.py, docs/kernels.md). Refused rather
        # than risked (64-row tiles with these settings were not tried).
        raise ValueError(f"FP4 matmul: {num_warps} warps with {num_stages} pipeline stages and 32 packed bytes per "
                         f"row per K step (unroll={unroll}) gave wrong results on the H200; use 4 warps, "
                         f"num_stages=1 or another unroll")
    split_k = _split_k(split_k, n // block_n, blocks // unroll, "FP4 matmul", max_split)
    return block_n, unroll, split_k, bytes_per_block, blocks


def _fp4_matmul(x, w, *, shift, factor_fn, global_scale, out_dtype, interpret, block_n, unroll, split_k,
                num_warps, num_stages, what):
    n, k, block = _check_fp4(w, what)
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has {x.shape[-1]} features, weight expects {k}")
    rows, m_used, fold = _activation_columns(x, what)
    cols, col_tiles = activation_tiling(m_used)
    block_n, unroll, split_k, bpb, blocks = _fp4_config(n, k, block, block_n, unroll, split_k, num_warps,
                                                        num_stages, cols, _split_cap(k / 2, cols * col_tiles))
    xp = _pad_rows(rows, cols * col_tiles)
    xlo = xp[:, 0::2].T                                   # [K/2, columns]: inputs that meet the low nibbles
    xhi = xp[:, 1::2].T
    w3 = w.packed.reshape(n, blocks, bpb)                 # free reshape: one row per (feature, scale block)
    kh_split, blocks_split = k // 2 // split_k, blocks // split_k
    kernel = functools.partial(_fp4_kernel, m_valid=m_used, block_n=block_n, unroll=unroll,
                               n_steps=blocks_split // unroll, bytes_per_block=bpb, factor_fn=factor_fn)
    part = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, cols * col_tiles, n), jnp.float32),
        grid=(col_tiles, n // block_n, split_k),
        in_specs=[pl.BlockSpec((kh_split, cols), lambda c, i, s: (s, c)),
                  pl.BlockSpec((kh_split, cols), lambda c, i, s: (s, c)),
                  pl.BlockSpec((block_n, blocks_split, bpb), lambda c, i, s: (i, s, 0)),
                  pl.BlockSpec((block_n, blocks_split), lambda c, i, s: (i, s))],
        out_specs=pl.BlockSpec((None, cols, block_n), lambda c, i, s: (s, c, i)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name=f"dsv4_{what}",
    )(xlo, xhi, w3, w.scale)
    y = _sum_split(part, m_used) * jnp.float32(2.0 ** shift)                       # [m_used, N]
    if global_scale is not None:
        y = y * global_scale.astype(jnp.float32)
    return fold(y).astype(out_dtype or x.dtype)


def mxfp4_matmul(x: jax.Array, w: Mxfp4Weight, out_dtype=None, *, interpret: bool = False, block_n=None,
                 unroll=None, split_k=None, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """x [M, K] @ dequant(W [N, K])^T for an MXFP4 weight, float32 accumulation -> [M, N] out_dtype."""
    return _fp4_matmul(x, w, shift=MX_SHIFT, factor_fn=mx_factor_bits, global_scale=None, out_dtype=out_dtype,
                       interpret=interpret, block_n=block_n, unroll=unroll, split_k=split_k,
                       num_warps=num_warps, num_stages=num_stages, what="mxfp4_matmul")


def nvfp4_matmul(x: jax.Array, w: Nvfp4Weight, out_dtype=None, *, interpret: bool = False, block_n=None,
                 unroll=None, split_k=None, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """x [M, K] @ dequant(W [N, K])^T for an NVFP4 weight (global scale included) -> [M, N] out_dtype."""
    if jnp.ndim(w.global_scale) != 0:
        raise ValueError("nvfp4_matmul: expected a single matrix (scalar global scale); use moe_matmul for stacks")
    w = Nvfp4Weight(w.packed, jax.lax.bitcast_convert_type(w.scale, jnp.uint8), w.global_scale)
    return _fp4_matmul(x, w, shift=NV_SHIFT, factor_fn=nv_factor_bits, global_scale=w.global_scale,
                       out_dtype=out_dtype, interpret=interpret, block_n=block_n, unroll=unroll, split_k=split_k,
                       num_warps=num_warps, num_stages=num_stages, what="nvfp4_matmul")


def fp8_matmul(x: jax.Array, w: Fp8BlockWeight, out_dtype=None, *, interpret: bool = False, block_n=None,
               split_k=None, num_warps=None, num_stages: int = 3, row_prescale=None) -> jax.Array:
    """x [M, K] @ dequant(W [N, K])^T for an FP8 weight with 128x128 E8M0 block scales -> [M, N] out_dtype.
    `row_prescale`: the rows' f16 prescale computed once over all of K before the launch (f16_rows, a launch of
    its own) instead of in every program over its K range (_fp8_prescaled_kernel); the
    same values up to f16 subnormals of entries under 2^-27 of their row's largest. Defaults: _fp8_tiling."""
    what = "fp8_matmul"
    n, k = w.weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has {x.shape[-1]} features, weight expects {k}")
    if k % FP8_BLOCK:
        raise ValueError(f"{what}: K must be a multiple of {FP8_BLOCK}, got {k}")
    if w.scale.shape != (math.ceil(n / FP8_BLOCK), k // FP8_BLOCK):
        raise ValueError(f"{what}: scale shape {w.scale.shape} does not match weight [{n}, {k}]")
    rows, m_used, fold = _activation_columns(x, what)
    cols, col_tiles = activation_tiling(m_used)
    block_n, num_warps, row_prescale = _fp8_tiling(n, cols, col_tiles, block_n, num_warps, row_prescale)
    if (FP8_BLOCK % block_n if block_n <= FP8_BLOCK else block_n % FP8_BLOCK) or n % block_n:
        raise ValueError(f"{what}: block_n={block_n} must divide 128 or be a multiple of it, and divide N={n}")
    steps = k // FP8_BLOCK
    split_k = _split_k(split_k, n // block_n, steps, what, _split_cap(k, cols * col_tiles))
    k_split = k // split_k
    static = dict(block_n=block_n, n_steps=steps // split_k, m_valid=m_used)
    x_spec = pl.BlockSpec((cols, k_split), lambda c, i, s: (c, s))
    if block_n <= FP8_BLOCK:                # the tile's one row of block scales
        tiles_per_block = FP8_BLOCK // block_n
        scale_spec = pl.BlockSpec((1, steps // split_k), lambda c, i, s: (i // tiles_per_block, s))
    else:                                   # block_n / 128 rows of them
        scale_spec = pl.BlockSpec((block_n // FP8_BLOCK, steps // split_k), lambda c, i, s: (i, s))
    w_specs = [pl.BlockSpec((block_n, k_split), lambda c, i, s: (i, s)), scale_spec]
    rows = _pad_rows(rows, cols * col_tiles)
    if row_prescale:
        x16, undo = f16_rows(rows, interpret=interpret)
        kernel, operands = functools.partial(_fp8_prescaled_kernel, **static), (x16, undo, w.weight, w.scale)
        in_specs = [x_spec, pl.BlockSpec((cols,), lambda c, i, s: (c,)), *w_specs]
    else:
        kernel, operands = functools.partial(_fp8_kernel, **static), (rows, w.weight, w.scale)
        in_specs = [x_spec, *w_specs]
    part = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, cols * col_tiles, n), jnp.float32),
        grid=(col_tiles, n // block_n, split_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, cols, block_n), lambda c, i, s: (s, c, i)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name=f"dsv4_{what}",
    )(*operands)
    return fold(_sum_split(part, m_used)).astype(out_dtype or x.dtype)


def quantized_matmul(x: jax.Array, w, out_dtype=None, *, interpret: bool = False) -> jax.Array:
    """Dispatch on the weight format (one entry point for the lead's dispatcher)."""
    if isinstance(w, Mxfp4Weight):
        return mxfp4_matmul(x, w, out_dtype, interpret=interpret)
    if isinstance(w, Nvfp4Weight):
        return nvfp4_matmul(x, w, out_dtype, interpret=interpret)
    if isinstance(w, Fp8BlockWeight):
        return fp8_matmul(x, w, out_dtype, interpret=interpret)
    raise TypeError(f"quantized_matmul: unsupported weight {type(w).__name__}")
