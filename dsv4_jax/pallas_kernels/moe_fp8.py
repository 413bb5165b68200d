"""The routed experts of a prefill chunk on FP8 tensor cores (W4A8): a grouped GEMM over the chunk's rows sorted
by expert, reading the stored MXFP4 bytes once per tile and converting them to e4m3 in the kernel.

    moe_fp8_matmul(xq e4m3 [R, K], sx f32 [R, K/128], w Mxfp4Weight [E, N, K], expert_ids [R]) -> f32 [R, N]
    y[r, n] = sum_j (xq[r, J] . W[e_r][n, J]) * sx[r, j]        (J: the j-th block of 128 inputs)

The activation is the `fp8` quantizer's (numerics.activations.quantize_fp8: e4m3 values, a power-of-two scale
per 128 inputs), the weight the expert's stored e2m1 nibbles and E8M0 scales. In the kernel each 128-input block
of a weight row becomes e4m3 as prefill.mxfp4_weight_operand defines it: e2m1 x 2^(e - r + 6), r the largest
E8M0 exponent of the row's four 32-blocks there, with 2^(r - 133) promoted with the activation's scale. That is
exact while a row's 32-block exponents in one 128 block differ by at most 14 (e4m3 subnormals reach 2^-9; a
block further below its neighbours rounds, its contribution under 2^-14 of theirs), as prefill.py's FP8 GEMM.
NVFP4 experts are not offered: e2m1 x an e4m3 block scale has up to 5 significant bits, e4m3 holds 4.

Schedule: moe.moe_schedule puts the rows of each expert into slots of `block_m` rows (the rows of a chunk are
not sorted in memory: the slots' rows are gathered once, in e4m3, before the launch); a program computes one
slot's output tile (accumulated as weight rows x the slot's rows, stored transposed so the rows come back to their
order by whole-row gathers), looping over K in 128-input steps: one FP8 wgmma chain of two 64-input dots (the even
and the odd inputs, which are the low and high nibbles of the packed bytes, so the decode needs no interleave) with
the decoded weight as the A operand in registers, then the chain's float32 result scaled by the weight's and the
activation's block scales into the float32 accumulator (DeepSeek's promotion per 128 inputs; prefill.fp8_dot_nt_p
says why the dot needs its own lowering). The programs of unused slots (expert -1) exit at once; rows that are not
real (`real`) take no slot.

The decode is a table lookup, so it costs about two instructions per weight: per row and 32-block the kernel
looks up the e4m3 bytes of the eight e2m1 magnitudes times 2^(e - r + 6) (shift_tables: float32 bits, then
round-to-nearest-even conversion, as XLA converts the reference operand; one table per shift, built outside the
kernel, 512 bytes), and inline PTX turns four packed bytes into eight e4m3 bytes with two `prmt` byte permutes
over that table plus the sign bits (E4M3_DECODE_PTX; decode_ptx_np emulates it instruction by instruction for the
tests). A first version that built every weight's float32 bits and converted each (about 15 instructions per weight)
made an 8K prompt's prefill slower than the bf16 path on an H100 (163.8 vs 125.4 ms, docs/performance.md).

Status: correct on an H100 at Flash geometry, but still slower there than moe.py's bf16 kernel on the same rows
(3.86 vs 2.81 ms for an 8K chunk's experts_w1; in the model one version was 5.5% faster and another 23% slower),
so the dispatch takes it only when asked (ops/matmul_kernels.py).
Nsight Compute on the 128 x 128 tile: 206 registers per thread, one CTA per SM, the tensor pipe 12.6% busy (the
bf16 kernel: 128, two, 50.6%). The likely cause, not yet tested: the per-step promotion and its second
accumulator, which make every 128-input step wait on its wgmma (docs/performance.md).

Backend: Pallas Triton, as prefill.py (whose FP8 wgmma primitive this reuses) and gemv.py (whose inline-PTX
decode this follows): its interpret mode runs the CPU tests, with the PTX replaced by its exact jnp emulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics.formats import Mxfp4Weight
from .moe import moe_schedule, slot_bound
from .prefill import BK, fp8_dot_nt_p

HALF = BK // 2          # packed bytes (even / odd inputs) of one 128-input block
SUB = 32                # inputs per E8M0 scale
SUB_BYTES = SUB // 2
MIN_SHIFT = -30         # e2m1 x 2^d for d below this is under e4m3's smallest subnormal (2^-9): zero either way


def e4m3_operand_bits(codes: jax.Array, shift: jax.Array) -> jax.Array:
    """float32 bits (uint32) of e2m1 codes (uint8 or int32, 0..15) times 2^shift (int32, broadcast against codes,
    shift >= MIN_SHIFT): exact, since every such value is a normal float32."""
    c = codes.astype(jnp.int32)
    sign = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    # e > 0: 2^(e - 1) x (1 + m/2), float32 exponent field e + 126; e == 0: m x 2^-1, field 126, no mantissa
    field = jnp.where(e == 0, 126, e + 126) + shift
    magnitude = jnp.where(e == 0, 0, m << 22) | (field << 23)
    magnitude = jnp.where((e == 0) & (m == 0), 0, magnitude)
    return magnitude.astype(jnp.uint32) | (sign.astype(jnp.uint32) << 31)


def magnitude_tables(shift: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The e4m3 bytes of the eight e2m1 magnitudes times 2^shift (int32 [...], >= MIN_SHIFT), rounded to nearest
    even as XLA converts them, as two uint32 words [...]: magnitudes 0-3 in the first (byte i: code i), 4-7 in
    the second, the table the decode's `prmt` indexes."""
    words = []
    for half in (0, 1):
        word = jnp.zeros(shift.shape, jnp.uint32)
        for i in range(4):
            bits = e4m3_operand_bits(jnp.full(shift.shape, 4 * half + i, jnp.int32), shift)
            e4m3 = jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.float8_e4m3fn)
            word = word | (jax.lax.bitcast_convert_type(e4m3, jnp.uint8).astype(jnp.uint32) << (8 * i))
        words.append(word)
    return words[0], words[1]


# The decode of four packed bytes (one 32-bit register: eight e2m1 codes) into the e4m3 bytes of their low
# nibbles ($0) and of their high nibbles ($1) through the table of their 32-block ($3: magnitudes 0-3, $7: 4-7;
# the four bytes of one instance lie in one 32-block, as Triton packs consecutive elements of a 16-byte row run).
# A nibble's three magnitude bits select a table byte (prmt: selector nibble i -> result byte i; its fourth bit,
# prmt's sign-replicate mode, is masked off) and its sign bit becomes bit 7 of the result byte.
SPREAD_LO = 0x0F0F0F0F
PACK_SELECTORS = 0x0020            # prmt: bytes 0 and 2 of (c | c >> 4) -> the four codes as 16 bits of nibbles
MAGNITUDE_BITS = 0x7777
SIGN_BITS = 0x80808080
E4M3_DECODE_PTX = f"""{{
.reg .b32 c, t, m;
and.b32 c, $2, {SPREAD_LO:#x};
shr.b32 t, c, 4; or.b32 t, t, c; prmt.b32 t, t, 0, {PACK_SELECTORS:#x}; and.b32 t, t, {MAGNITUDE_BITS:#x};
prmt.b32 m, $3, $7, t;
shl.b32 c, $2, 4; and.b32 c, c, {SIGN_BITS:#x}; or.b32 $0, m, c;
shr.b32 c, $2, 4; and.b32 c, c, {SPREAD_LO:#x};
shr.b32 t, c, 4; or.b32 t, t, c; prmt.b32 t, t, 0, {PACK_SELECTORS:#x}; and.b32 t, t, {MAGNITUDE_BITS:#x};
prmt.b32 m, $3, $7, t;
and.b32 c, $2, {SIGN_BITS:#x}; or.b32 $1, m, c;
}}"""


def _prmt_np(a, b, selector):
    """numpy prmt.b32 (default mode): result byte i is byte (selector nibble i) & 7 of the eight bytes of b:a, or
    that byte's sign bit replicated where the nibble's bit 3 is set."""
    pool = a.astype(np.uint64) | (b.astype(np.uint64) << 32)
    out = np.zeros(np.broadcast(a, b, selector).shape, np.uint32)
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = ((pool >> (8 * (nib & 7)).astype(np.uint64)) & 0xFF).astype(np.uint32)
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte.astype(np.uint32) << (8 * i)
    return out


def decode_ptx_np(word: np.ndarray, table_lo: np.ndarray, table_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy emulation of E4M3_DECODE_PTX instruction by instruction: uint32 words of four packed bytes -> (the
    low nibbles' e4m3 bytes, the high nibbles'), uint32 words. Used by the tests to check the constants."""
    w = word.astype(np.uint32)
    outs = []
    for codes, signs in (((w & SPREAD_LO), (w << 4) & SIGN_BITS), (((w >> 4) & SPREAD_LO), w & SIGN_BITS)):
        t = _prmt_np(((codes >> 4) | codes).astype(np.uint32), np.zeros_like(w), np.uint32(PACK_SELECTORS))
        outs.append(_prmt_np(table_lo, table_hi, t & MAGNITUDE_BITS) | signs.astype(np.uint32))
    return outs[0], outs[1]


def _decode_emulated(packed: jax.Array, table_lo: jax.Array, table_hi: jax.Array):
    """What E4M3_DECODE_PTX computes, elementwise and exactly, in plain jnp (interpret mode and CPU)."""
    def nibble(codes):
        magnitude = (codes & 7).astype(jnp.uint32)
        word = jnp.where(magnitude < 4, table_lo, table_hi)
        byte = (word >> (8 * (magnitude & 3))) & 0xFF
        byte = byte | ((codes.astype(jnp.uint32) & 8) << 4)
        return jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn)
    p = packed.astype(jnp.uint32)
    return nibble(p & 15), nibble(p >> 4)


def _make_decode_primitive():
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering
    from jaxlib.triton import dialect as tt

    prim = jax_core.Primitive("dsv4_fp4_e4m3_decode")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda w, lo, hi: [jax_core.ShapedArray(w.shape, jnp.float8_e4m3fn)] * 2)
    prim.def_impl(_decode_emulated)
    mlir.register_lowering(prim, mlir.lower_fun(_decode_emulated, multiple_results=True))

    @triton_lowering.register_lowering(prim)
    def _triton(ctx, w, lo, hi):
        types = [ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(jnp.dtype(a.dtype))) for a in ctx.avals_out]
        # pack=4: each instance sees four consecutive bytes (one 32-bit register) and the four elements' table
        # words (it reads the first of each: one 32-block), and writes four e4m3 bytes per output register
        res = tt.elementwise_inline_asm(types, E4M3_DECODE_PTX, constraints="=r,=r,r,r,r,r,r,r,r,r,r", pure=True,
                                        packed_element=4, args=[w, lo, hi])
        return list(res)

    return prim


fp4_e4m3_decode_p = _make_decode_primitive()


TABLE_ENTRIES = 64         # shifts MIN_SHIFT .. MIN_SHIFT + 63 (those above 6 never occur): a power of two for Triton


def shift_tables() -> tuple[jax.Array, jax.Array]:
    """magnitude_tables of every shift the kernel can meet, uint32 [TABLE_ENTRIES] twice (entry i: shift
    MIN_SHIFT + i): the kernel looks a 32-block's table up instead of building it (8 float conversions each)."""
    return magnitude_tables(MIN_SHIFT + jnp.arange(TABLE_ENTRIES, dtype=jnp.int32))


def _block_tables(scale_bytes: jax.Array, lo_ref, hi_ref) -> tuple[jax.Array, jax.Array, jax.Array]:
    """E8M0 bytes [bn, 4] of one 128-input block -> (the 32-blocks' magnitude tables, two uint32 [bn, 4], for
    shifts e - r + 6, at least MIN_SHIFT, looked up in shift_tables' refs; the block's weight scale 2^(r - 133)
    float32 [bn], at least 2^-126 as tiles.pow2 clips it)."""
    e = scale_bytes.astype(jnp.int32)
    r = jnp.max(e, axis=1)
    entry = jnp.maximum(e - r[:, None] + 6, MIN_SHIFT) - MIN_SHIFT
    scale = jax.lax.bitcast_convert_type((jnp.maximum(r - 6, 1) << 23).astype(jnp.uint32), jnp.float32)
    return lo_ref[entry], hi_ref[entry], scale


def _kernel(se_ref, xe_ref, xo_ref, sx_ref, w_ref, s_ref, lo_ref, hi_ref, o_ref, *, block_n: int, n_steps: int,
            weight_a: bool):
    tile, slot = pl.program_id(0), pl.program_id(1)
    expert = se_ref[slot]
    rows = pl.ds(tile * block_n, block_n)
    block_m = o_ref.shape[0]

    @pl.when(expert >= 0)
    def _():
        def body(j, acc):
            packed = w_ref[expert, rows, pl.ds(j * (BK // SUB), BK // SUB), :]              # [bn, 4, 16] u8
            table_lo, table_hi, w_scale = _block_tables(s_ref[expert, rows, pl.ds(j * (BK // SUB), BK // SUB)],
                                                        lo_ref, hi_ref)
            lo, hi = fp4_e4m3_decode_p.bind(packed, jnp.broadcast_to(table_lo[:, :, None], packed.shape),
                                            jnp.broadcast_to(table_hi[:, :, None], packed.shape))
            lo, hi = lo.reshape(block_n, HALF), hi.reshape(block_n, HALF)
            xe, xo, sx = xe_ref[:, pl.ds(j * HALF, HALF)], xo_ref[:, pl.ds(j * HALF, HALF)], sx_ref[j, :]
            if weight_a:       # the decoded weight as the wgmma's A operand, from registers: [bn, bm]
                part = fp8_dot_nt_p.bind(lo, xe, jnp.zeros(acc.shape, jnp.float32))
                part = fp8_dot_nt_p.bind(hi, xo, part)
                return acc + (part * w_scale[:, None]) * sx[None, :]
            part = fp8_dot_nt_p.bind(xe, lo, jnp.zeros(acc.shape, jnp.float32))      # B operand: [bm, bn]
            part = fp8_dot_nt_p.bind(xo, hi, part)
            return acc + (part * sx[:, None]) * w_scale[None, :]

        shape = (block_n, block_m) if weight_a else (block_m, block_n)
        acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(shape, jnp.float32))
        # stored as [slot rows, weight rows], so the gather back to row order reads whole rows (coalesced)
        o_ref[...] = acc.T if weight_a else acc


def moe_fp8_matmul(xq: jax.Array, sx: jax.Array, w_stacked: Mxfp4Weight, expert_ids: jax.Array,
                   real: jax.Array | None = None, *, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                   num_stages: int = 3, weight_operand: str = "a", interpret: bool = False) -> jax.Array:
    """Row r of xq (e4m3 [R, K], float32 block scales sx [R, K/128]) times expert expert_ids[r] of the stacked
    MXFP4 weight [E, N, K] -> float32 [R, N]. Expert ids in [0, E); rows that are not `real` [R] (None: all are)
    read no weight and give zeros.

    Tiles: `block_m` rows of one expert (a slot) x `block_n` weight rows on `num_warps` warps. 64 x 64 on one
    warpgroup was the fastest of six tiles on an H100 before the shift tables (3.76 ms for an 8K chunk's 49,152
    rows on experts_w1, against 5.06 ms at 128 x 128 on two warpgroups, whose 206 registers per thread left one
    CTA per SM; docs/performance.md, benchmarks/bench_kernels.py --moe-fp8-tiles). `weight_operand`: the decoded
    weight as the wgmma's A operand ("a", from registers) or its B operand ("b", through shared memory; the
    version that made the model's prefill 5.5% faster, docs/performance.md)."""
    what = "moe_fp8_matmul"
    if not isinstance(w_stacked, Mxfp4Weight) or w_stacked.packed.ndim != 3:
        raise TypeError(f"{what}: w_stacked must be a stacked Mxfp4Weight [E, N, K]")
    n_exp, n, k = w_stacked.shape
    if xq.dtype != jnp.float8_e4m3fn or xq.ndim != 2 or xq.shape[1] != k:
        raise ValueError(f"{what}: xq must be float8_e4m3fn [R, {k}], got {xq.dtype} {xq.shape}")
    r = xq.shape[0]
    if k % BK or sx.shape != (r, k // BK) or expert_ids.shape != (r,):
        raise ValueError(f"{what}: K={k} must be a multiple of {BK}; sx [R, K/128] and expert_ids [R] expected, "
                         f"got {sx.shape} and {expert_ids.shape}")
    if n % block_n or block_m % 16:
        raise ValueError(f"{what}: N={n} must be a multiple of block_n={block_n}; block_m a multiple of 16")
    if weight_operand not in ("a", "b"):
        raise ValueError(f"{what}: weight_operand must be 'a' or 'b', got {weight_operand!r}")
    ids = expert_ids.astype(jnp.int32)
    if real is not None:
        ids = jnp.where(real, ids, n_exp)                       # sorted past the experts; their slots are unused
    n_slots = slot_bound(r, block_m, n_exp + 1)
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe_schedule(ids, block_m, n_slots)
    slot_expert = jnp.where(slot_expert < n_exp, slot_expert, -1)

    def gathered(a):                                            # [R, ...] -> [S, block_m, ...], row R: zeros
        return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])[slot_rows]

    xe, xo = gathered(xq[:, 0::2]), gathered(xq[:, 1::2])      # [S, bm, K/2] each
    sxs = jnp.swapaxes(gathered(sx.astype(jnp.float32)), 1, 2)  # [S, K/128, bm]
    w4 = w_stacked.packed.reshape(n_exp, n, k // SUB, SUB_BYTES)
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, n_steps=k // BK, weight_a=weight_operand == "a"),
        out_shape=jax.ShapeDtypeStruct((n_slots, block_m, n), jnp.float32),
        # the N tiles of a slot are the fastest axis, so the CTAs resident at once share a few slots' activations
        grid=(n // block_n, n_slots),
        in_specs=[pl.BlockSpec((n_slots,), lambda i, q: (0,)),
                  pl.BlockSpec((None, block_m, k // 2), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec((None, block_m, k // 2), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec((None, k // BK, block_m), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec(w4.shape, lambda i, q: (0, 0, 0, 0)),
                  pl.BlockSpec(w_stacked.scale.shape, lambda i, q: (0, 0, 0)),
                  pl.BlockSpec((TABLE_ENTRIES,), lambda i, q: (0,)),
                  pl.BlockSpec((TABLE_ENTRIES,), lambda i, q: (0,))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, q: (q, 0, i)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsv4_moe_fp8_matmul",
    )(slot_expert, xe, xo, sxs, w4, w_stacked.scale, *shift_tables())
    y = out[slot_of_row, pos_of_row]                            # [R, N]; unused slots' tiles are never read
    return y if real is None else jnp.where(real[:, None], y, 0.0)
