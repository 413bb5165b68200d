"""The Lightning indexer's scores in one launch (Pallas, Triton backend, GPU): for each query row and each compressed
entry n it can see, sum over heads of w_h * ReLU(q_h . key_n); -inf for the entries it cannot see.

    scores = indexer_scores(q, head_weights, keys, positions, n_entries=live)      # decode: float32 [B, S, live]
    scores = indexer_scores(q, head_weights, keys, positions, n_entries=block, rows_per_program=16,
                            first_entry=first)                                     # prefill: a block of entries

What layers/attention.py `_scores` and its visibility mask cost XLA three launches for on the GPU (the heads' dot
products, their weighted sum, the mask), with a [B, S, heads, N] float32 intermediate in memory: 64 MB per query
row at a 1M-token context's 262,144 entries, which made the model score long contexts a block at a time. Here
programs per (query row, BLOCK_ENTRIES entries) hold that block's [heads, BLOCK_ENTRIES] products in registers
and write only the row's scores. The keys are read from the whole cache buffer (a slice handed to a custom call
would be a copy): `n_entries` of them, the entries the call's context can hold.

A decode program takes one query row; a prefill program takes `rows_per_program` rows of one sequence against one
block of entries, so each key block is read once per that many rows instead of once per row (a prefill chunk's
thousands of rows would otherwise stream the keys thousands of times), and the [rows, heads, entries] products
still never leave registers. The Triton backend, as for the decode schedule, because Pallas' Mosaic GPU lowering has
no interpret mode for the CPU tests; the dots are plain bf16 (or float32) tensor-core dots.

Numerics as the jnp path: the dot products of the stored values accumulate in float32, ReLU, times the float32
head weights, summed over heads in float32; only the order of the sums differs (float32 rounding). Triton needs
power-of-two tensor shapes and tensor-core dots at least 16 rows: heads a multiple of 16, head_dim a power of two
>= 16, n_entries a multiple of BLOCK_ENTRIES (`supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import is_pow2, pow2_divisor, scalar

_F32 = jnp.float32
BLOCK_ENTRIES = 64       # entries per program


def supported(n_heads: int, head_dim: int, n_entries: int) -> bool:
    return (n_heads % 16 == 0 and head_dim >= 16 and is_pow2(head_dim) and n_entries > 0
            and n_entries % BLOCK_ENTRIES == 0)


def _kernel(q_ref, w_ref, keys_ref, pos_ref, out_ref, *, ratio: int, weight_scale: float, precision):
    row, block = pl.program_id(0), pl.program_id(1)
    keys = keys_ref[...]                                                  # [BLOCK_ENTRIES, d]
    dots = jnp.dot(q_ref[...], keys.T, preferred_element_type=_F32, precision=precision)   # [heads, BLOCK_ENTRIES]
    weights = w_ref[...] * weight_scale                                   # as the jnp path scales them
    scores = jnp.sum(jnp.maximum(dots, 0.0) * weights[:, None], axis=0)
    entry = block * BLOCK_ENTRIES + jax.lax.iota(jnp.int32, BLOCK_ENTRIES)
    t = scalar(pos_ref, row)
    out_ref[...] = jnp.where(entry < (t + 1) // ratio, scores, -jnp.inf)


def _rows_kernel(q_ref, w_ref, keys_ref, pos_ref, first_ref, out_ref, *, rows: int, ratio: int, weight_scale: float,
                 precision):
    """`rows` query rows against one block of entries: the keys loaded once, each row's [heads, BLOCK_ENTRIES]
    products reduced over heads in registers. The grid's first (fastest) axis is the entry block."""
    block = pl.program_id(0)
    keys = keys_ref[...]                                                  # [BLOCK_ENTRIES, d]
    entry = scalar(first_ref) + block * BLOCK_ENTRIES + jax.lax.iota(jnp.int32, BLOCK_ENTRIES)
    for i in range(rows):
        dots = jnp.dot(q_ref[i], keys.T, preferred_element_type=_F32, precision=precision)  # [heads, BLOCK_ENTRIES]
        weights = w_ref[i] * weight_scale
        scores = jnp.sum(jnp.maximum(dots, 0.0) * weights[:, None], axis=0)
        t = scalar(pos_ref, i)
        out_ref[i] = jnp.where(entry < (t + 1) // ratio, scores, -jnp.inf)


def prefill_rows_per_program(seq: int) -> int:
    """Rows a prefill program takes: the largest power of two up to 16 that divides the chunk's `seq` tokens (the
    rows of one program belong to one sequence)."""
    return pow2_divisor(seq, 16)


def indexer_scores(q: jax.Array, head_weights: jax.Array, keys: jax.Array, positions: jax.Array, *, n_entries: int,
                   ratio: int = 4, weight_scale: float = 1.0, rows_per_program: int = 1,
                   first_entry: jax.Array | int = 0, interpret: bool = False) -> jax.Array:
    """q [B, S, heads, d] (the indexer's rotated, rounded queries), head_weights float32 [B, S, heads] (times
    `weight_scale` here: the score scale, whose multiply would otherwise be a launch of its own), keys [B, N, d] (the
    cache buffer in q's dtype, or a block of it; its first n_entries are read), positions [B, S] -> float32
    [B, S, n_entries]: sum_h w_h ReLU(q_h . key_n) where first_entry + n < (t + 1) // ratio, else -inf.
    `rows_per_program` > 1 (a power of two dividing S): the prefill schedule (module docstring); `first_entry`
    (int32, traced or not): the index of keys[:, 0] among the sequence's entries, for a block of the buffer."""
    batch, seq, n_heads, head_dim = q.shape
    if not supported(n_heads, head_dim, n_entries) or keys.shape[-1] != head_dim or keys.shape[1] < n_entries:
        raise ValueError(f"indexer_scores: needs heads a multiple of 16, a power-of-two head_dim >= 16 and "
                         f"n_entries a multiple of {BLOCK_ENTRIES} within the buffer; got q {q.shape}, keys "
                         f"{keys.shape}, n_entries {n_entries}")
    if keys.dtype != q.dtype:
        raise ValueError(f"indexer_scores: keys {keys.dtype} and queries {q.dtype} differ")
    rows = batch * seq
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    operands = (q.reshape(rows, n_heads, head_dim), head_weights.astype(_F32).reshape(rows, n_heads), keys,
                positions.astype(jnp.int32).reshape(rows))
    if rows_per_program > 1 or not isinstance(first_entry, int) or first_entry != 0:
        out = _scores_prefill(operands, seq, n_entries=n_entries, ratio=ratio, weight_scale=weight_scale,
                              rows_per_program=rows_per_program, first_entry=first_entry, precision=precision,
                              interpret=interpret)
        return out.reshape(batch, seq, n_entries)
    out = pl.pallas_call(
        functools.partial(_kernel, ratio=ratio, weight_scale=float(weight_scale), precision=precision),
        grid=(rows, n_entries // BLOCK_ENTRIES),
        in_specs=[pl.BlockSpec((None, n_heads, head_dim), lambda r, n: (r, 0, 0)),
                  pl.BlockSpec((None, n_heads), lambda r, n: (r, 0)),
                  pl.BlockSpec((None, BLOCK_ENTRIES, head_dim), lambda r, n: (r // seq, n, 0)),
                  pl.BlockSpec((rows,), lambda r, n: (0,))],
        out_specs=pl.BlockSpec((None, BLOCK_ENTRIES), lambda r, n: (r, n)),
        out_shape=jax.ShapeDtypeStruct((rows, n_entries), _F32), interpret=interpret, name="indexer_scores",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2))(*operands)
    return out.reshape(batch, seq, n_entries)


def _scores_prefill(operands, seq: int, *, n_entries, ratio, weight_scale, rows_per_program, first_entry, precision,
                    interpret) -> jax.Array:
    """The prefill schedule's launch on indexer_scores' checked, flattened operands -> float32 [B * S, n_entries]."""
    q, head_weights, keys, positions = operands
    rows, n_heads, head_dim = q.shape
    tq = rows_per_program
    if not is_pow2(tq) or seq % tq:
        raise ValueError(f"indexer_scores: rows_per_program must be a power of two dividing the sequence's {seq} "
                         f"tokens, got {tq}")
    first = jnp.asarray(first_entry, jnp.int32).reshape(1)
    # The entry blocks are the grid's fastest axis (CUDA's x: the programs launched one after another), so the
    # programs in flight share one block of rows, whose queries (tq x heads x head_dim: 256 KB for 16 of Flash's
    # rows, 16x a block of keys) stay in L2 while the keys stream past. With the rows fastest, the programs in
    # flight shared a block of keys, and every block of entries read all the chunk's queries again from memory
    # (128 MB for 8,192 rows: 4 GB against 2,048 entries).
    return pl.pallas_call(
        functools.partial(_rows_kernel, rows=tq, ratio=ratio, weight_scale=float(weight_scale), precision=precision),
        grid=(n_entries // BLOCK_ENTRIES, rows // tq),
        in_specs=[pl.BlockSpec((tq, n_heads, head_dim), lambda n, r: (r, 0, 0)),
                  pl.BlockSpec((tq, n_heads), lambda n, r: (r, 0)),
                  pl.BlockSpec((None, BLOCK_ENTRIES, head_dim), lambda n, r: ((r * tq) // seq, n, 0)),
                  pl.BlockSpec((tq,), lambda n, r: (r,)),
                  pl.BlockSpec((1,), lambda n, r: (0,))],
        out_specs=pl.BlockSpec((tq, BLOCK_ENTRIES), lambda n, r: (r, n)),
        out_shape=jax.ShapeDtypeStruct((rows, n_entries), _F32), interpret=interpret,
        name="indexer_scores_prefill", compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2))(
            q, head_weights, keys, positions, first)
