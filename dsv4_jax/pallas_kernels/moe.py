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


def moe_schedule(expert_ids: jax.Array, capacity: int, n_slots: int | None = None):
    """expert_ids [R] -> (slot_expert [S] int32, -1 for unused slots; slot_rows [S, capacity] int32, R for padding;
    slot_of_row [R], pos_of_row [R]), S = n_slots (default R; must be >= the slots needed, see slot_bound).
    Rows of one expert fill consecutive slots of `capacity` rows."""
    r = expert_ids.shape[0]
    n_slots = r if n_slots is None else n_slots
    ids = expert_ids.astype(jnp.int32)
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


def _check_stacked(w, x_rows: jax.Array, slot_cols: int, what: str) -> tuple[int, int, int, int]:
    """(E, N, K, FP4 block) of a stacked FP4 weight [E, N, K] that rows x_rows [R, K] can multiply in slots of
    slot_cols columns; a clear error otherwise."""
    if not isinstance(w, (Mxfp4Weight, Nvfp4Weight)) or w.packed.ndim != 3:
        raise TypeError(f"{what}: a weight must be a stacked Mxfp4Weight / Nvfp4Weight [E, N, K], got {type(w).__name__}")
    n, k, block = _check_fp4(w, what)
    if x_rows.shape[-1] != k:
        raise ValueError(f"{what}: x has {x_rows.shape[-1]} features, weight expects {k}")
    if slot_cols % MP:
        raise ValueError(f"{what}: slot_cols must be a multiple of {MP}, got {slot_cols}")
    return w.packed.shape[0], n, k, block


def _slotted(x_rows: jax.Array, expert_ids: jax.Array, capacity: int, n_experts: int):
    """(moe_schedule's (slot_expert, slot_rows, slot_of_row, pos_of_row) over slot_bound's slots, the rows gathered
    into their slots [S, capacity, K], zeros where a slot is not full)."""
    n_slots = slot_bound(x_rows.shape[0], capacity, n_experts)
    schedule = moe_schedule(expert_ids, capacity, n_slots)
    x_pad = jnp.concatenate([x_rows, jnp.zeros((1, x_rows.shape[1]), x_rows.dtype)], axis=0)
    return schedule, x_pad[schedule[1]]


def _even_odd_columns(xs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slotted rows [S, cols, K] -> their even and odd inputs [S, K/2, cols], the operands of the FP4 tile loop
    (gemv._fp4_tile_loop: a packed byte holds inputs 2i and 2i + 1)."""
    return jnp.swapaxes(xs[:, :, 0::2], 1, 2), jnp.swapaxes(xs[:, :, 1::2], 1, 2)


def _moe_kernel(se_ref, xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *, block_n, blocks_split, **kw):
    tile, slot, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = se_ref[slot]

    @pl.when(expert >= 0)
    def _():
        acc = _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, block_n=block_n, w_index=(expert,),
                             row0=tile * block_n, blk0=split * blocks_split, **kw)       # [block_n, slot_cols]
        o_ref[...] = acc.T                 # stored row-major: the gather back to row order reads whole rows


def moe_matmul(x_rows: jax.Array, w_stacked, expert_ids: jax.Array, out_dtype=None, *, interpret: bool = False,
               block_n=None, unroll=None, split_k=None, num_warps: int = 4, num_stages: int = 3,
               slot_cols: int = MP) -> jax.Array:
    """Row r of x_rows [R, K] times expert expert_ids[r] of w_stacked (Mxfp4Weight or Nvfp4Weight [E, N, K]),
    float32 accumulation -> [R, N] out_dtype (default x_rows.dtype). Any expert ids in [0, E); any R.

    `slot_cols` is the tensor-core dot width per slot: MP (16) for decode; for prefill (many rows per expert)
    64-128, so each decoded weight tile is reused by that many rows (bf16: that many rows per slot, float32:
    half, as hi + lo parts).

    The programs store their tiles transposed, as [slot, slot column, N], so the gather back to row order reads
    each row's N outputs contiguously. Stored as computed, [slot, N, slot column], that gather read a row's outputs
    slot_cols floats apart (for a prefill chunk's 128-column slots one 4-byte value per 32-byte memory sector, ~8x
    the 1.5 GiB per layer of an 8K chunk), and an 8K prompt in one chunk took 106.6 ms instead of 86.9 on an H200
    (docs/performance.md, "The routed experts' outputs read back 8x")."""
    what = "moe_matmul"
    if x_rows.ndim != 2 or expert_ids.shape != x_rows.shape[:1]:
        raise ValueError(f"{what}: x_rows [R, K] and expert_ids [R] expected, got {x_rows.shape}, {expert_ids.shape}")
    n_exp, n, k, block = _check_stacked(w_stacked, x_rows, slot_cols, what)
    is_nv = isinstance(w_stacked, Nvfp4Weight)
    f32 = x_rows.dtype == jnp.float32
    capacity = slot_cols // 2 if f32 else slot_cols
    (slot_expert, slot_rows, slot_of_row, pos_of_row), xs = _slotted(x_rows, expert_ids, capacity, n_exp)
    if f32:
        hi, lo = split_f32(xs)
        xs = jnp.concatenate([hi, lo], axis=1)                       # [S, slot_cols, K]
    else:
        xs = xs.astype(jnp.bfloat16)
    xlo, xhi = _even_odd_columns(xs)
    n_slots = slot_expert.shape[0]

    block_n, unroll, split_k, bpb, blocks = _fp4_config(n, k, block, block_n, unroll, split_k, num_warps,
                                                        num_stages)
    w4 = w_stacked.packed.reshape(n_exp, n, blocks, bpb)
    scale = jax.lax.bitcast_convert_type(w_stacked.scale, jnp.uint8) if is_nv else w_stacked.scale
    kh_split, blocks_split = k // 2 // split_k, blocks // split_k
    kernel = functools.partial(_moe_kernel, block_n=block_n, blocks_split=blocks_split,
                               unroll=unroll, n_steps=blocks_split // unroll, bytes_per_block=bpb,
                               factor_fn=nv_factor_bits if is_nv else mx_factor_bits)
    # Grid: the N tiles of a slot are the fastest axis (CUDA launches blockIdx.x first), so the CTAs resident at
    # once work on a few slots and read each slot's activation tile (K x slot_cols) from L2 after its first tile;
    # slot-major order put hundreds of slots' tiles in flight at once, over L2's size, and re-read each from DRAM
    # once per N tile (Nsight Compute: 87% of DRAM bandwidth, docs/kernels.md).
    part = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, n_slots, slot_cols, n), jnp.float32),
        grid=(n // block_n, n_slots, split_k),
        in_specs=[pl.BlockSpec((n_slots,), lambda i, q, s: (0,)),
                  pl.BlockSpec((None, kh_split, slot_cols), lambda i, q, s: (q, s, 0)),
                  pl.BlockSpec((None, kh_split, slot_cols), lambda i, q, s: (q, s, 0)),
                  pl.BlockSpec(w4.shape, lambda i, q, s: (0, 0, 0, 0)),
                  pl.BlockSpec(scale.shape, lambda i, q, s: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, slot_cols, block_n), lambda i, q, s: (s, q, 0, i)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="dsv4_moe_matmul",
    )(slot_expert, xlo, xhi, w4, scale)
    y_slots = jnp.sum(part, axis=0)                # [S, slot_cols, N] (unused slots: garbage)
    y = y_slots[slot_of_row, pos_of_row]                             # [R, N]
    if f32:
        y = y + y_slots[slot_of_row, pos_of_row + capacity]
    y = y * jnp.float32(2.0 ** (NV_SHIFT if is_nv else MX_SHIFT))
    if is_nv:
        y = y * w_stacked.global_scale.astype(jnp.float32)[expert_ids][:, None]
    return y.astype(out_dtype or x_rows.dtype)


def _moe_swiglu_kernel(se_ref, fg_ref, fu_ref, rw_ref, xlo_ref, xhi_ref, wg_ref, sg_ref, wu_ref, su_ref, o_ref, *,
                       block_n, limit, **kw):
    tile, slot = pl.program_id(0), pl.program_id(1)
    expert = se_ref[slot]

    @pl.when(expert >= 0)
    def _():
        def projection(w_ref, s_ref, f_ref):       # [block_n, slot_cols] float32, scaled as moe_matmul returns it
            acc = _fp4_tile_loop(xlo_ref, xhi_ref, w_ref, s_ref, block_n=block_n, w_index=(expert,),
                                 row0=tile * block_n, **kw)
            return acc * f_ref[slot]
        gate = jnp.minimum(projection(wg_ref, sg_ref, fg_ref), limit)           # as ops/moe_ffn.clamped_swiglu
        up = jnp.clip(projection(wu_ref, su_ref, fu_ref), -limit, limit)
        h = gate * jax.nn.sigmoid(gate) * up * rw_ref[0, :][None, :]             # [block_n, slot_cols]
        o_ref[...] = h.T.astype(o_ref.dtype)


def moe_swiglu_matmul(x_rows: jax.Array, w_gate, w_up, expert_ids: jax.Array, row_weights: jax.Array,
                      limit: float, out_dtype=jnp.bfloat16, *, interpret: bool = False, block_n: int = 64,
                      unroll=None, num_warps: int = 4, num_stages: int = 3, slot_cols: int = 128) -> jax.Array:
    """The routed experts' hidden rows in one launch: row r of x_rows [R, K] (bfloat16) times expert expert_ids[r]
    of the gate and of the up projection (stacked FP4 [E, N, K] of one format), then
    SiLU(min(gate, limit)) * clamp(up, -limit, limit) * row_weights[r] in float32 (ops/moe_ffn.clamped_swiglu
    times the routing weight), rounded to out_dtype -> [R, N]. Expert ids in [0, E).

    It computes what two moe_matmul calls and the SwiGLU after them compute, without their float32 outputs: each
    program decodes a tile of both weights for its slot's rows and writes the hidden values. So a prefill chunk's
    gate and up projections write 2 bytes per hidden value of a slot instead of 8 that the SwiGLU then gathered
    back (for an 8,192-token chunk of Flash, 1.3 GiB of float32 a layer). Slots as moe_matmul's prefill schedule
    and no split-K (the SwiGLU needs whole sums); 64-row weight tiles by default, as each program holds two
    accumulators. Triton backend, as moe_matmul (its tile loop and FP4 decode). Opt-in (ops/moe_ffn.py): not yet
    timed on a GPU."""
    what = "moe_swiglu_matmul"
    if x_rows.ndim != 2 or expert_ids.shape != x_rows.shape[:1] or row_weights.shape != x_rows.shape[:1]:
        raise ValueError(f"{what}: x_rows [R, K], expert_ids [R] and row_weights [R] expected, got {x_rows.shape}, "
                         f"{expert_ids.shape}, {row_weights.shape}")
    n_exp, n, k, block = _check_stacked(w_gate, x_rows, slot_cols, what)
    _check_stacked(w_up, x_rows, slot_cols, what)
    if type(w_gate) is not type(w_up) or w_gate.packed.shape != w_up.packed.shape:
        raise ValueError(f"{what}: the gate and up weights must share a format and a shape, got "
                         f"{type(w_gate).__name__} {w_gate.packed.shape} and {type(w_up).__name__} {w_up.packed.shape}")
    if x_rows.dtype != jnp.bfloat16:
        raise ValueError(f"{what}: takes bfloat16 rows, got {x_rows.dtype} (moe_matmul takes float32 ones)")
    is_nv = isinstance(w_gate, Nvfp4Weight)
    (slot_expert, slot_rows, slot_of_row, pos_of_row), xs = _slotted(x_rows, expert_ids, slot_cols, n_exp)
    xlo, xhi = _even_odd_columns(xs)
    n_slots = slot_expert.shape[0]
    slot_weights = jnp.concatenate([row_weights.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])[slot_rows]
    # each projection's factor per slot, applied to its sums before the SwiGLU as moe_matmul applies it to its
    # output: 2^shift (exact) times the slot's expert's NVFP4 global scale
    used = jnp.maximum(slot_expert, 0)
    shift = jnp.float32(2.0 ** (NV_SHIFT if is_nv else MX_SHIFT))
    fg, fu = (shift * w.global_scale.astype(jnp.float32)[used] if is_nv else jnp.full((n_slots,), shift)
              for w in (w_gate, w_up))
    block_n, unroll, _, bpb, blocks = _fp4_config(n, k, block, block_n, unroll, 1, num_warps, num_stages)
    wg, wu = (w.packed.reshape(n_exp, n, blocks, bpb) for w in (w_gate, w_up))
    sg, su = (jax.lax.bitcast_convert_type(w.scale, jnp.uint8) if is_nv else w.scale for w in (w_gate, w_up))
    kernel = functools.partial(_moe_swiglu_kernel, block_n=block_n, limit=float(limit), unroll=unroll,
                               n_steps=blocks // unroll, bytes_per_block=bpb,
                               factor_fn=nv_factor_bits if is_nv else mx_factor_bits)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, q: (0,) * a.ndim)
    h_slots = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_slots, slot_cols, n), out_dtype),
        grid=(n // block_n, n_slots),                   # N tiles fastest, as moe_matmul (its comment says why)
        in_specs=[whole(slot_expert), whole(fg), whole(fu),
                  pl.BlockSpec((1, slot_cols), lambda i, q: (q, 0)),
                  pl.BlockSpec((None, k // 2, slot_cols), lambda i, q: (q, 0, 0)),
                  pl.BlockSpec((None, k // 2, slot_cols), lambda i, q: (q, 0, 0)),
                  whole(wg), whole(sg), whole(wu), whole(su)],
        out_specs=pl.BlockSpec((None, slot_cols, block_n), lambda i, q: (q, 0, i)),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="dsv4_moe_swiglu_matmul",
    )(slot_expert, fg, fu, slot_weights, xlo, xhi, wg, sg, wu, su)
    return h_slots[slot_of_row, pos_of_row]                                                  # [R, N]
