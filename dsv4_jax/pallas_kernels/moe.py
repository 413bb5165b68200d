"""Grouped matmul for the routed experts: each row of x times its own expert's FP4 weight.

    moe_matmul(x_rows [R, K], w_stacked [E, N, K] (Mxfp4Weight / Nvfp4Weight), expert_ids [R]) -> [R, N]

Rows that share an expert are gathered into "slots" of up to `slot_cols` rows (16 for decode; 64-128 for prefill;
float32 rows take two columns, hi + lo), so every touched expert's weight bytes are streamed once per slot
whatever the routing. For decode R = tokens x top-k (6 of 256 experts, up to 8 tokens: R <= 48): one slot per
touched expert. For a prefill chunk R is large and an expert's rows fill several slots, each decoding the weight
tile once for slot_cols rows (tensor-core bound rather than decode bound). The schedule (which slot holds which
expert and rows) is a few jnp ops on device, no host sync, over a static number of slots (`slot_bound`:
ceil(R / capacity) + min(R, E)); the programs of unused slots exit at once.

Kernel: the FP4 GEMV of gemv.py (Pallas Triton, same nibble decode and tensor-core dots, see its docstring) with
a leading grid axis over slots; each program reads its slot's expert id and indexes the stacked weight
[E, N, K/block, bytes] at it. Oracle: dsv4_jax.numerics.grouped_linear on rows sorted by expert.

    moe_ffn(x [T, D], w_gate, w_up [E, N, D], w_down [E, D, N], expert_ids [T, K], row_weights [T, K]) -> [T, D]

The routed experts of a prefill chunk on one schedule: a kernel for the gate and up projections and the SwiGLU
that writes its hidden values in the down projection's slot layout, then moe_matmul's kernel for the down
projection; the tokens are gathered into the slots and the outputs back to the tokens by one XLA fusion each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..numerics.formats import Mxfp4Weight, Nvfp4Weight

from .gemv import (MP, MX_SHIFT, NV_SHIFT, _check_fp4, _fp4_config, _fp4_tile_loop, _params, mx_factor_bits,
                   nv_factor_bits, split_f32)


def slot_bound(rows: int, capacity: int, n_experts: int) -> int:
    """Static number of slots that always suffices: each touched expert wastes at most one partly filled slot."""
    return min(rows, -(-rows // capacity) + min(rows, n_experts))


COMPARED_ELEMENTS = 1 << 23   # up to this many (slot position, row) pairs moe_schedule compares rows pairwise


def moe_schedule(expert_ids: jax.Array, capacity: int, n_slots: int | None = None):
    """expert_ids [R] -> (slot_expert [S] int32, -1 for unused slots; slot_rows [S, capacity] int32, R for padding;
    slot_of_row [R], pos_of_row [R]), S = n_slots (default R; must be >= the slots needed, see slot_bound).
    Rows of one expert fill consecutive slots of `capacity` rows, experts in increasing id (-1 first), rows in
    increasing index: the order of a stable sort by expert. While S x capacity x R is at most COMPARED_ELEMENTS (a
    decode or verify step: 1,536 rows at batch 256 are 5.5M) the schedule comes from pairwise comparisons
    (_compared_schedule: a few fused passes, where the sort, its running maximum and sum and four scatters were ~8
    small launches a layer); beyond, from the sort (_sorted_schedule: a prefill chunk's tens of thousands of rows)."""
    n_slots = expert_ids.shape[0] if n_slots is None else n_slots
    ids = expert_ids.astype(jnp.int32)
    if n_slots * capacity * ids.shape[0] <= COMPARED_ELEMENTS:
        return _compared_schedule(ids, capacity, n_slots)
    return _sorted_schedule(ids, capacity, n_slots)


def _sorted_schedule(ids: jax.Array, capacity: int, n_slots: int):
    """moe_schedule's result from a stable sort of the rows by expert."""
    r = ids.shape[0]
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    sorted_ids = ids[order]
    idx = jnp.arange(r, dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    group_start = jax.lax.cummax(jnp.where(is_start, idx, 0))
    pos = idx - group_start
    new_slot = is_start | (pos % capacity == 0)
    slot = jnp.cumsum(new_slot.astype(jnp.int32)) - 1
    slot_expert = jnp.full((n_slots,), -1, jnp.int32).at[slot].set(sorted_ids)
    slot_rows = jnp.full((n_slots, capacity), r, jnp.int32).at[slot, pos % capacity].set(order)
    slot_of_row = jnp.zeros((r,), jnp.int32).at[order].set(slot)
    pos_of_row = jnp.zeros((r,), jnp.int32).at[order].set(pos % capacity)
    return slot_expert, slot_rows, slot_of_row, pos_of_row


def _compared_schedule(ids: jax.Array, capacity: int, n_slots: int):
    """moe_schedule's result from pairwise comparisons of the rows (no sort, no scatter)."""
    r = ids.shape[0]
    idx = jnp.arange(r, dtype=jnp.int32)
    same = ids[:, None] == ids[None, :]                                                  # [R, R]
    rank = jnp.sum(same & (idx[None, :] < idx[:, None]), axis=1, dtype=jnp.int32)      # earlier rows of its expert
    count = jnp.sum(same, axis=1, dtype=jnp.int32)                                      # rows of its expert
    # the slots before a row's expert: ceil(count / capacity) for every expert of a smaller id, carried by that
    # expert's first row (rank 0) so that a sum over the rows counts each expert once
    slots_of_expert = jnp.where(rank == 0, (count + capacity - 1) // capacity, 0)
    first_slot = jnp.sum(jnp.where(ids[None, :] < ids[:, None], slots_of_expert[None, :], 0), axis=1, dtype=jnp.int32)
    slot_of_row = first_slot + rank // capacity
    pos_of_row = rank % capacity
    slot = jnp.arange(n_slots, dtype=jnp.int32)
    owner = (slot_of_row[None, :] == slot[:, None])                                      # [S, R]
    slot_expert = jnp.max(jnp.where(owner, ids[None, :], -1), axis=1)          # -1: an unused slot (or the -1 rows')
    held = owner[:, None, :] & (pos_of_row[None, None, :] == jnp.arange(capacity, dtype=jnp.int32)[None, :, None])
    slot_rows = jnp.min(jnp.where(held, idx[None, None, :], r), axis=2)                 # [S, capacity], R: padding
    return slot_expert, slot_rows, slot_of_row, pos_of_row


def _check_stacked(w, features: int, slot_cols: int, what: str) -> tuple[int, int, int, int]:
    """(E, N, K, FP4 block) of a stacked FP4 weight [E, N, K] that an operand of `features` inputs can multiply in
    slots of slot_cols columns; a clear error otherwise."""
    if not isinstance(w, (Mxfp4Weight, Nvfp4Weight)) or w.packed.ndim != 3:
        raise TypeError(f"{what}: a weight must be a stacked Mxfp4Weight / Nvfp4Weight [E, N, K], got {type(w).__name__}")
    n, k, block = _check_fp4(w, what)
    if features != k:
        raise ValueError(f"{what}: x has {features} features, weight expects {k}")
    if slot_cols % MP:
        raise ValueError(f"{what}: slot_cols must be a multiple of {MP}, got {slot_cols}")
    return w.packed.shape[0], n, k, block


def _paired(x_slots: jax.Array) -> jax.Array:
    """Rows gathered into slots [S, cols, K] -> the kernels' operand [S, K/2, 2 * cols]: row j holds the slot's
    inputs 2j in columns 0 .. cols and 2j + 1 in cols .. 2 cols (a packed FP4 byte holds the weights of inputs 2i
    and 2i + 1, gemv._fp4_tile_loop). One transpose; the kernels read the two halves as two operands (_operand_specs),
    so no even / odd copies are made."""
    s, cols, k = x_slots.shape
    return jnp.swapaxes(x_slots, 1, 2).reshape(s, k // 2, 2 * cols)


def _operand_specs(k_half: int, cols: int, index):
    """The BlockSpecs of a paired operand's even half and odd half ([S, K/2, 2 cols], _paired), as two operands:
    `index` maps the grid to (slot, K block); the odd half is the next block of `cols` columns."""
    shape = (None, k_half, cols)
    return [pl.BlockSpec(shape, lambda *g: (*index(*g), 0)), pl.BlockSpec(shape, lambda *g: (*index(*g), 1))]


def _output_factor(w, experts: jax.Array) -> jax.Array:
    """What each row's sums are multiplied by to give the products [R] float32: 2^shift (the decode's exact
    prescale, gemv.py) and, for NVFP4, the row's expert's global scale (experts: valid indices)."""
    shift = jnp.float32(2.0 ** (NV_SHIFT if isinstance(w, Nvfp4Weight) else MX_SHIFT))
    if isinstance(w, Nvfp4Weight):
        return shift * w.global_scale.astype(jnp.float32)[experts]
    return jnp.full(experts.shape, shift)


def _fp4_operands(w, blocks: int, bpb: int):
    """A stacked FP4 weight's packed bytes [E, N, K blocks, bytes per block] and scales as the kernels read them."""
    n_exp, n = w.packed.shape[:2]
    scale = jax.lax.bitcast_convert_type(w.scale, jnp.uint8) if isinstance(w, Nvfp4Weight) else w.scale
    return w.packed.reshape(n_exp, n, blocks, bpb), scale


def _moe_kernel(se_ref, xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *, block_n, blocks_split, **kw):
    tile, slot, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = se_ref[slot]

    @pl.when(expert >= 0)
    def _():
        acc = _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, block_n=block_n, w_index=(expert,),
                             row0=tile * block_n, blk0=split * blocks_split, **kw)       # [block_n, slot_cols]
        o_ref[...] = acc.T                 # stored row-major: the gather back to row order reads whole rows


def _slot_sums(slot_expert: jax.Array, x_paired: jax.Array, w, *, interpret, block_n, unroll, split_k, num_warps,
               num_stages) -> jax.Array:
    """The FP4 sums of each slot's columns x_paired [S, K/2, 2 cols] (_paired) times its expert slot_expert[s] of w
    [E, N, K] (-1: the slot is skipped and its output left unwritten) -> float32 [S, cols, N], before
    _output_factor.

    The programs store their tiles transposed, as [slot, slot column, N], so the gather back to row order reads
    each row's N outputs contiguously. Stored as computed, [slot, N, slot column], that gather read a row's outputs
    slot_cols floats apart (for a prefill chunk's 128-column slots one 4-byte value per 32-byte memory sector, ~8x
    the 1.5 GiB per layer of an 8K chunk), and an 8K prompt in one chunk took 106.6 ms instead of 86.9 on an H200
    (docs/performance.md, "The routed experts' outputs read back 8x")."""
    n_exp, n, k, block = _check_stacked(w, 2 * x_paired.shape[1], x_paired.shape[-1] // 2, "moe_matmul")
    n_slots, cols = x_paired.shape[0], x_paired.shape[-1] // 2
    block_n, unroll, split_k, bpb, blocks = _fp4_config(n, k, block, block_n, unroll, split_k, num_warps,
                                                        num_stages)
    w4, scale = _fp4_operands(w, blocks, bpb)
    kh_split, blocks_split = k // 2 // split_k, blocks // split_k
    kernel = functools.partial(_moe_kernel, block_n=block_n, blocks_split=blocks_split,
                               unroll=unroll, n_steps=blocks_split // unroll, bytes_per_block=bpb,
                               factor_fn=nv_factor_bits if isinstance(w, Nvfp4Weight) else mx_factor_bits)
    # Grid: the N tiles of a slot are the fastest axis (CUDA launches blockIdx.x first), so the CTAs resident at
    # once work on a few slots and read each slot's activation tile (K x slot_cols) from L2 after its first tile;
    # slot-major order put hundreds of slots' tiles in flight at once, over L2's size, and re-read each from DRAM
    # once per N tile (Nsight Compute: 87% of DRAM bandwidth, docs/kernels.md).
    part = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, n_slots, cols, n), jnp.float32),
        grid=(n // block_n, n_slots, split_k),
        in_specs=[pl.BlockSpec((n_slots,), lambda i, q, s: (0,)),
                  *_operand_specs(kh_split, cols, lambda i, q, s: (q, s)),
                  pl.BlockSpec(w4.shape, lambda i, q, s: (0, 0, 0, 0)),
                  pl.BlockSpec(scale.shape, lambda i, q, s: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, cols, block_n), lambda i, q, s: (s, q, 0, i)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="dsv4_moe_matmul",
    )(slot_expert, x_paired, x_paired, w4, scale)
    return jnp.sum(part, axis=0)                   # [S, cols, N] (unused slots: garbage)


def moe_matmul(x_rows: jax.Array, w_stacked, expert_ids: jax.Array, out_dtype=None, *, interpret: bool = False,
               block_n=None, unroll=None, split_k=None, num_warps: int = 4, num_stages: int = 3,
               slot_cols: int = MP) -> jax.Array:
    """Row r of x_rows [R, K] times expert expert_ids[r] of w_stacked (Mxfp4Weight or Nvfp4Weight [E, N, K]),
    float32 accumulation -> [R, N] out_dtype (default x_rows.dtype). Any expert ids in [0, E); any R.

    `slot_cols` is the tensor-core dot width per slot: MP (16) for decode; for prefill (many rows per expert)
    64-128, so each decoded weight tile is reused by that many rows (bf16: that many rows per slot, float32:
    half, as hi + lo parts)."""
    what = "moe_matmul"
    if x_rows.ndim != 2 or expert_ids.shape != x_rows.shape[:1]:
        raise ValueError(f"{what}: x_rows [R, K] and expert_ids [R] expected, got {x_rows.shape}, {expert_ids.shape}")
    n_exp = _check_stacked(w_stacked, x_rows.shape[1], slot_cols, what)[0]
    f32 = x_rows.dtype == jnp.float32
    capacity = slot_cols // 2 if f32 else slot_cols
    n_slots = slot_bound(x_rows.shape[0], capacity, n_exp)
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe_schedule(expert_ids, capacity, n_slots)
    xs = jnp.concatenate([x_rows, jnp.zeros((1, x_rows.shape[1]), x_rows.dtype)], axis=0)[slot_rows]
    if f32:
        hi, lo = split_f32(xs)
        xs = jnp.concatenate([hi, lo], axis=1)                       # [S, slot_cols, K]
    else:
        xs = xs.astype(jnp.bfloat16)
    y_slots = _slot_sums(slot_expert, _paired(xs), w_stacked, interpret=interpret, block_n=block_n, unroll=unroll,
                         split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    y = y_slots[slot_of_row, pos_of_row]                             # [R, N]
    if f32:
        y = y + y_slots[slot_of_row, pos_of_row + capacity]
    return (y * _output_factor(w_stacked, expert_ids)[:, None]).astype(out_dtype or x_rows.dtype)


def _moe_swiglu_kernel(se_ref, fg_ref, fu_ref, rw_ref, xlo_ref, xhi_ref, wg_ref, sg_ref, wu_ref, su_ref, o_ref, *,
                       block_n, limit, **kw):
    tile, slot = pl.program_id(0), pl.program_id(1)
    expert = se_ref[slot]

    @pl.when(expert >= 0)
    def _():
        def projection(w_ref, s_ref, f_ref):       # [block_n, slot_cols] float32, scaled as moe_matmul's output
            acc = _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, block_n=block_n, w_index=(expert,),
                                 row0=tile * block_n, **kw)
            return acc * f_ref[slot]
        gate = jnp.minimum(projection(wg_ref, sg_ref, fg_ref), limit)           # as ops/moe_ffn.clamped_swiglu
        up = jnp.clip(projection(wu_ref, su_ref, fu_ref), -limit, limit)
        h = gate * jax.nn.sigmoid(gate) * up * rw_ref[0, :][None, :]             # [block_n, slot_cols]
        o_ref[...] = h.astype(o_ref.dtype)          # [hidden unit, slot column]: the down projection's operand


def _swiglu_slots(slot_expert: jax.Array, slot_weights: jax.Array, x_paired: jax.Array, w_gate, w_up,
                  limit: float, *, interpret, block_n, unroll, num_warps, num_stages) -> jax.Array:
    """The hidden values of each slot's columns x_paired [S, K/2, 2 cols] (_paired) for its expert:
    SiLU(min(gate, limit)) * clamp(up, -limit, limit) * slot_weights [S, cols] in float32, rounded to bf16 ->
    [S, N, cols], i.e. already the down projection's operand once paired (a free reshape). Slots of expert -1 are
    skipped and left unwritten."""
    n_slots, cols = x_paired.shape[0], x_paired.shape[-1] // 2
    n_exp, n, k, block = _check_stacked(w_gate, 2 * x_paired.shape[1], cols, "moe_ffn")
    is_nv = isinstance(w_gate, Nvfp4Weight)
    used = jnp.maximum(slot_expert, 0)
    fg, fu = (_output_factor(w, used) for w in (w_gate, w_up))      # applied to the sums before the SwiGLU
    block_n, unroll, _, bpb, blocks = _fp4_config(n, k, block, block_n, unroll, 1, num_warps, num_stages)
    (wg, sg), (wu, su) = (_fp4_operands(w, blocks, bpb) for w in (w_gate, w_up))
    kernel = functools.partial(_moe_swiglu_kernel, block_n=block_n, limit=float(limit), unroll=unroll,
                               n_steps=blocks // unroll, bytes_per_block=bpb,
                               factor_fn=nv_factor_bits if is_nv else mx_factor_bits)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, q: (0,) * a.ndim)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_slots, n, cols), jnp.bfloat16),
        grid=(n // block_n, n_slots),                   # N tiles fastest, as _slot_sums (its comment says why)
        in_specs=[whole(slot_expert), whole(fg), whole(fu),
                  pl.BlockSpec((1, cols), lambda i, q: (q, 0)),
                  *_operand_specs(k // 2, cols, lambda i, q: (q, 0)),
                  whole(wg), whole(sg), whole(wu), whole(su)],
        out_specs=pl.BlockSpec((None, block_n, cols), lambda i, q: (q, i, 0)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="dsv4_moe_swiglu_matmul",
    )(slot_expert, fg, fu, slot_weights, x_paired, x_paired, wg, sg, wu, su)


def moe_ffn(x: jax.Array, w_gate, w_up, w_down, expert_ids: jax.Array, row_weights: jax.Array, limit: float, *,
            interpret: bool = False, slot_cols: int = 128, up_tiles: dict | None = None,
            down_tiles: dict | None = None) -> jax.Array:
    """The routed experts of a prefill chunk in two launches: for tokens x [T, D] (bfloat16) and their K picks
    expert_ids [T, K] (-1: no expert, a pick that adds nothing) with routing weights row_weights [T, K],
    sum over k of row_weights[t, k] * W_down[e] h, h = SiLU(min(gate, limit)) * clamp(up, -limit, limit) rounded
    to bf16, (gate, up) = (W_gate[e] x_t, W_up[e] x_t), e = expert_ids[t, k] -> float32 [T, D]. Stacked FP4
    weights: gate and up [E, N, D] of one format, down [E, D, N].

    The picks are grouped by expert into slots of `slot_cols` (moe_schedule, one schedule for both launches):
    - dispatch: the tokens are gathered straight into the first kernel's operand (one transposing gather, no
      [T x K, D] copy of the rows in pick order);
    - the first kernel decodes a tile of the gate and of the up weight for its slot's columns and writes the
      SwiGLU's bf16 result in the layout the second kernel reads ([slot, hidden unit, column]), so the hidden
      rows are never put back in pick order and gathered again;
    - the second kernel (the down projection, moe_matmul's) writes float32 [slot, column, D], and the combine
      gathers each token's K rows from it, scales and sums them (one fusion).
    Bit for bit what moe_matmul's gate and up outputs, the SwiGLU after them and moe_matmul's down projection of
    the bf16 hidden rows give on the same tiling (interpret mode, tests/test_pallas_gemv.py). Tiles: `up_tiles`
    and `down_tiles` (block_n, unroll, num_warps, num_stages; the down side also split_k) default to 64-row tiles
    on 4 warps. Triton backend, as moe_matmul (its tile loop and FP4 decode)."""
    what = "moe_ffn"
    if (x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]
            or row_weights.shape != expert_ids.shape):
        raise ValueError(f"{what}: x [T, D], expert_ids [T, K] and row_weights [T, K] expected, got {x.shape}, "
                         f"{expert_ids.shape}, {row_weights.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"{what}: takes bfloat16 tokens, got {x.dtype}")
    n_exp, n, d, _ = _check_stacked(w_gate, x.shape[1], slot_cols, what)
    _check_stacked(w_up, x.shape[1], slot_cols, what)
    if type(w_gate) is not type(w_up) or w_gate.packed.shape != w_up.packed.shape:
        raise ValueError(f"{what}: the gate and up weights must share a format and a shape, got "
                         f"{type(w_gate).__name__} {w_gate.packed.shape} and {type(w_up).__name__} {w_up.packed.shape}")
    if not isinstance(w_down, (Mxfp4Weight, Nvfp4Weight)) or tuple(w_down.shape) != (n_exp, d, n):
        raise ValueError(f"{what}: the down weight must be a stacked FP4 weight [{n_exp}, {d}, {n}], got "
                         f"{type(w_down).__name__} {getattr(w_down, 'shape', None)}")
    up_tiles = dict(dict(block_n=64, unroll=None, num_warps=4, num_stages=3), **(up_tiles or {}))
    down_tiles = dict(dict(block_n=64, unroll=None, split_k=1, num_warps=4, num_stages=3), **(down_tiles or {}))
    t, top_k = expert_ids.shape
    picks = expert_ids.reshape(-1).astype(jnp.int32)
    n_slots = slot_bound(t * top_k, slot_cols, n_exp + 1)        # + 1: the picks of no expert (-1), skipped
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe_schedule(picks, slot_cols, n_slots)
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    x_paired = _paired(x_pad[slot_rows // top_k])               # dispatch: padding (pick t K) -> token t, zeros
    slot_weights = jnp.concatenate([row_weights.reshape(-1).astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
    h = _swiglu_slots(slot_expert, slot_weights[slot_rows], x_paired, w_gate, w_up, limit, interpret=interpret,
                      **up_tiles)                                                        # [S, N, cols]
    y_slots = _slot_sums(slot_expert, h.reshape(n_slots, n // 2, 2 * slot_cols), w_down, interpret=interpret,
                         **down_tiles)                                                   # [S, cols, D]
    real = picks >= 0
    y = y_slots[slot_of_row, pos_of_row] * _output_factor(w_down, jnp.maximum(picks, 0))[:, None]
    y = jnp.where(real[:, None], y, 0.0)                # (skipped slots were never written)
    return jnp.sum(y.reshape(t, top_k, d), axis=1)
