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
slot's [block_m, block_n] output tile, looping over K in 128-input steps: two FP8 dots of 64 inputs (the even and
the odd inputs, which are the low and high nibbles of the packed bytes, so the decode needs no interleave), their
float32 sum scaled by the activation's and the weight's block scales into the float32 accumulator (DeepSeek's
promotion per 128 inputs; prefill.fp8_dot_nt_p says why the dot needs its own lowering). The programs of unused
slots (expert -1) exit at once; rows that are not real (`real`) take no slot.

Backend: Pallas Triton, as prefill.py (whose FP8 wgmma primitive this reuses): its interpret mode runs the CPU
tests, and the weight decode is plain integer arithmetic on the loaded bytes (bits of e2m1 x 2^d built as float32,
then Triton's round-to-nearest-even conversion to e4m3, what XLA's convert does for the reference operand).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
    """float32 bits (uint32) of e2m1 codes [..., 16] (uint8 or int32, 0..15) times 2^shift (int32, broadcast
    against codes, shift >= MIN_SHIFT): exact, since every such value is a normal float32."""
    c = codes.astype(jnp.int32)
    sign = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    # e > 0: 2^(e - 1) x (1 + m/2), float32 exponent field e + 126; e == 0: m x 2^-1, field 126, no mantissa
    field = jnp.where(e == 0, 126, e + 126) + shift
    magnitude = jnp.where(e == 0, 0, m << 22) | (field << 23)
    magnitude = jnp.where((e == 0) & (m == 0), 0, magnitude)
    return magnitude.astype(jnp.uint32) | (sign.astype(jnp.uint32) << 31)


def _block_shifts(scale_bytes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E8M0 bytes [bn, 4] of one 128-input block -> (the 32-blocks' shifts e - r + 6 [bn, 4] int32, at least
    MIN_SHIFT; the block's weight scale 2^(r - 133) float32 [bn], 2^-126 at least, as prefill._pow2 clips it)."""
    e = scale_bytes.astype(jnp.int32)
    r = jnp.max(e, axis=1)
    shift = jnp.maximum(e - r[:, None] + 6, MIN_SHIFT)
    scale = jax.lax.bitcast_convert_type((jnp.maximum(r - 6, 1) << 23).astype(jnp.uint32), jnp.float32)
    return shift, scale


def _kernel(se_ref, xe_ref, xo_ref, sx_ref, w_ref, s_ref, o_ref, *, block_n: int, n_steps: int):
    tile, slot = pl.program_id(0), pl.program_id(1)
    expert = se_ref[slot]
    rows = pl.ds(tile * block_n, block_n)

    @pl.when(expert >= 0)
    def _():
        def body(j, acc):
            packed = w_ref[expert, rows, pl.ds(j * (BK // SUB), BK // SUB), :].astype(jnp.int32)  # [bn, 4, 16]
            shift, w_scale = _block_shifts(s_ref[expert, rows, pl.ds(j * (BK // SUB), BK // SUB)])
            shift = shift[:, :, None]

            def operand(codes):                                           # [bn, 4, 16] -> e4m3 [bn, 64]
                bits = e4m3_operand_bits(codes, shift).reshape(block_n, HALF)
                return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.float8_e4m3fn)

            part = (fp8_dot_nt_p.bind(xe_ref[:, pl.ds(j * HALF, HALF)], operand(packed & 15))
                    + fp8_dot_nt_p.bind(xo_ref[:, pl.ds(j * HALF, HALF)], operand(packed >> 4)))  # [bm, bn]
            return acc + (part * sx_ref[j, :][:, None]) * w_scale[None, :]

        o_ref[...] = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(o_ref.shape, jnp.float32))


def moe_fp8_matmul(xq: jax.Array, sx: jax.Array, w_stacked: Mxfp4Weight, expert_ids: jax.Array,
                   real: jax.Array | None = None, *, block_m: int = 64, block_n: int = 128, num_warps: int = 4,
                   num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """Row r of xq (e4m3 [R, K], float32 block scales sx [R, K/128]) times expert expert_ids[r] of the stacked
    MXFP4 weight [E, N, K] -> float32 [R, N]. Expert ids in [0, E); rows that are not `real` [R] (None: all are)
    read no weight and give zeros.

    Tiles: `block_m` rows of one expert (a slot) x `block_n` weight rows; 64 x 128 on one warpgroup with 3
    stages is prefill.fp8_block_matmul's measured default. Not yet timed on a GPU (docs/performance.md)."""
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
        functools.partial(_kernel, block_n=block_n, n_steps=k // BK),
        out_shape=jax.ShapeDtypeStruct((n_slots, block_m, n), jnp.float32),
        # the N tiles of a slot are the fastest axis, so the CTAs resident at once share a few slots' activations
        grid=(n // block_n, n_slots),
        in_specs=[pl.BlockSpec((n_slots,), lambda i, q: (0,)),
                  pl.BlockSpec((None, block_m, k // 2), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec((None, block_m, k // 2), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec((None, k // BK, block_m), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec(w4.shape, lambda i, q: (0, 0, 0, 0)),
                  pl.BlockSpec(w_stacked.scale.shape, lambda i, q: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, q: (q, 0, i)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsv4_moe_fp8_matmul",
    )(slot_expert, xe, xo, sxs, w4, w_stacked.scale)
    y = out[slot_of_row, pos_of_row]                            # [R, N]; unused slots' tiles are never read
    return y if real is None else jnp.where(real[:, None], y, 0.0)
