"""The Lightning indexer of CSA layers (docs/model.md 4.5): scores of every visible compressed entry for every
query, sum over heads of weight_h(x) * ReLU(q_h . key), and the top-k picks.

Its reference is the jnp below (all entries at once, or a block at a time with a running top-k beyond
indexer_block() entries); its kernel, pallas_kernels/indexer.py, scores a decode or verify step's rows in one
launch, and a prefill chunk's rows 16 at a time against each block of keys (the heads summed on chip: no [B, S,
heads, N] products in memory; the top-k over the [B, S, N] scores follows, XLA's `lax.top_k` on a block of entries
at a time beyond kernel_block()). A prefill chunk's one top-k over all its entries runs without a sort on GPU
plans (ops/threshold_top_k.py, op `indexer_top_k`). `select` chooses (ops/choice.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..pallas_kernels import indexer as indexer_kernel
from . import choice, norm_rope
from .attention_core import compressed_visible
from .matmul import linear
from .threshold_top_k import threshold_top_k

SCORES_KERNEL = choice.Kernel("indexer_scores", "indexer")
# Taken by GPU plans since 2026-12-07: an 8K prompt 3% faster than on XLA's path in 2,048-token chunks and 2.4% in
# one 8,192-token chunk (one H100, one call each, docs/performance.md), and a chunk's temporaries 1.4x smaller (no
# [B, S, heads, N] products); `--kernel-override indexer_scores=reference` keeps XLA's path.
PREFILL_SCORES_KERNEL = choice.Kernel("indexer_scores", "indexer_prefill", phases=frozenset({"prefill"}))
# A prefill chunk's top-k over all its entries by a threshold (8 counting passes, a prefix sum, a scatter) in place
# of XLA's top-k (a sort-like sequence of kernels, 11.6 ms of a profiled 8,192-token chunk on an H100). Taken by GPU
# plans since 2026-12-07: in one 8,192-token chunk an 8K prompt took 86.5 ms against 89.6 ms with XLA's top-k, and a
# 32K prompt 364.8 against 373.5 ms (one H100, consecutive processes; docs/performance.md);
# `--kernel-override indexer_top_k=reference` keeps XLA's. The same picks; they come in index order, so the
# attention's sums over them round differently.
PREFILL_TOP_K_BY_THRESHOLD = choice.Kernel("indexer_top_k", "threshold_top_k", phases=frozenset({"prefill"}))


INDEXER_BLOCK = 4096     # compressed entries scored at a time beyond it (bounds the [B, S, heads, block] scores)
INDEXER_SCORE_BYTES = 256 << 20    # float32 scores one block may hold when that allows more than INDEXER_BLOCK


def indexer_block(batch: int, seq: int, n_heads: int) -> int:
    """Entries the indexer scores at a time: the most (a power of two) whose [B, S, heads, block] float32 scores fit
    INDEXER_SCORE_BYTES, never fewer than INDEXER_BLOCK. A batch-1 decode step scores a 1M-token context's
    262,144 entries in one pass (each pass of the running top-k is a sequential loop iteration, ~80 us on an H200);
    a 512-token prefill chunk stays at 4,096 (its memory bound)."""
    block = INDEXER_BLOCK
    while batch * seq * n_heads * 4 * block * 2 <= INDEXER_SCORE_BYTES:
        block *= 2
    return block


def kernel_block(batch: int, seq: int) -> int:
    """Entries the prefill kernel scores per pass of the running top-k: its [B, S, block] float32 scores (no heads
    axis) bounded as indexer_block bounds the reference's."""
    return indexer_block(batch, seq, 1)


def _indexer_weight_scale(cfg: ModelConfig) -> float:
    """The indexer's score scale, folded into its per-head weights."""
    return cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5


def _indexer_query(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                   inv_freq: np.ndarray, ctx, scale_weights: bool = True) -> tuple[jax.Array, jax.Array]:
    """The indexer's queries [B, S, heads, head_dim] (rotated, fake-quantized as trained) and its per-head weights
    float32 [B, S, heads] (with the score scale folded in, unless `scale_weights` is False: a kernel folds it)."""
    q = norm_rope.indexer_queries(params["wq_b"]["weight"], cfg, q_latent, positions, inv_freq, ctx)
    head_weights = linear(x, params["weights_proj"]["weight"], out_dtype=jnp.float32, ctx=ctx)
    return q, head_weights * _indexer_weight_scale(cfg) if scale_weights else head_weights


def _scores(q: jax.Array, head_weights: jax.Array, keys: jax.Array) -> jax.Array:
    """sum over heads of weight_h * ReLU(q_h . key): float32 [B, S, N] for keys [B, N, head_dim].

    The dot products are of the stored values, accumulated in float32, as pallas_kernels/indexer.py computes them:
    bf16 values on bf16 tensor cores (their products are exact in float32; this was a float32 dot, TF32 on a GPU
    at default precision), float32 values at full precision. The weighted sum over heads adds the heads' [B, S, N]
    slices in float32: XLA fuses that with the ReLU, the weights and the caller's mask into one pass over the
    products, where a second dot (TF32 on a GPU) or a reduction over the heads axis first wrote them transposed
    (heads minor): 2 GiB more for a 2,048-token chunk against 4,096 entries (docs/performance.md)."""
    precision = jax.lax.Precision.HIGHEST if jnp.float32 in (q.dtype, keys.dtype) else None
    dots = jnp.einsum("bshd,bnd->bshn", q, keys, preferred_element_type=jnp.float32, precision=precision)
    terms = jax.nn.relu(dots) * head_weights[..., None]
    return functools.reduce(jnp.add, [terms[:, :, h] for h in range(terms.shape[2])])


@jax.named_scope("indexer")
def indexer_scores(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                   index_keys: jax.Array, inv_freq: np.ndarray, ctx) -> jax.Array:
    """Lightning indexer scores float32 [B, S, N] of every compressed entry (visible or not) for every query:
    sum over heads of weight_h(x) * ReLU(q_h . key)."""
    return _scores(*_indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx), index_keys)


def _top_k(scores: jax.Array, k: int, ctx) -> tuple[jax.Array, jax.Array]:
    """(scores, idx) [B, S, k] of the k highest scores of each query over all entries at once: XLA's top-k, or the
    threshold select where the plan takes it (PREFILL_TOP_K_BY_THRESHOLD; the same set, in index order)."""
    if choice.takes_kernel(PREFILL_TOP_K_BY_THRESHOLD, ctx):
        return threshold_top_k(scores, k)
    return jax.lax.top_k(scores, k)


def _blocked_top_k(q: jax.Array, head_weights: jax.Array, keys: jax.Array, positions: jax.Array, k: int,
                   block: int | None = None):
    """Top-k visible entries of every query over keys [B, N, hd] scored `block` (default INDEXER_BLOCK) entries at a
    time with a running top-k (_running_top_k), so no [B, S, heads, N] intermediate exists. Returns (scores, idx)
    [B, S, k]."""
    return _running_top_k(lambda keys_block, first: _scores(q, head_weights, keys_block), keys, positions, k,
                          INDEXER_BLOCK if block is None else block)


def _running_top_k(block_scores, keys: jax.Array, positions: jax.Array, k: int, block: int):
    """Top-k visible entries of every query over keys [B, N, hd], `block` entries at a time: block_scores(keys of
    the block [B, block, hd], index of its first entry) -> float32 [B, S, block]. The running picks (lower indices)
    come first in each merge, so ties resolve to the lower index as one top_k over all entries does. Returns
    (scores, idx) [B, S, k]."""
    batch, n_entries, head_dim = keys.shape
    n_blocks = -(-n_entries // block)
    keys = jnp.pad(keys, ((0, 0), (0, n_blocks * block - n_entries), (0, 0)))
    seq = positions.shape[1]

    def body(b, carry):
        best, best_idx = carry
        first = b * block
        entry = first + jnp.arange(block, dtype=jnp.int32)
        scores = block_scores(jax.lax.dynamic_slice_in_dim(keys, first, block, axis=1), first)
        visible = (entry[None, None, :] < n_entries) & (entry[None, None, :] < ((positions + 1) // 4)[:, :, None])
        scores = jnp.where(visible, scores, -jnp.inf)
        merged = jnp.concatenate([best, scores], axis=-1)
        merged_idx = jnp.concatenate([best_idx, jnp.broadcast_to(entry, (batch, seq, block))], axis=-1)
        best, pos = jax.lax.top_k(merged, k)
        return best, jnp.take_along_axis(merged_idx, pos, axis=-1)

    init = (jnp.full((batch, seq, k), -jnp.inf, jnp.float32), jnp.zeros((batch, seq, k), jnp.int32))
    return jax.lax.fori_loop(0, n_blocks, body, init)


@jax.named_scope("indexer")
def indexer_select(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                   index_keys: jax.Array, inv_freq: np.ndarray, ctx, scores: jax.Array | None = None):
    """Lightning indexer: top-min(index_topk, N) compressed entries per query. Returns (idx, valid) [B, S, k];
    an entry is valid iff it is visible (j < (t+1)//4); invisible picks only fill the static k slots. `scores`:
    indexer_scores already computed for these inputs (training reuses them for its loss). Beyond indexer_block()
    entries the scores are formed a block at a time (_blocked_top_k): the same picks, bounded memory."""
    n_entries = index_keys.shape[1]
    k = min(cfg.index_topk, n_entries)
    block = indexer_block(x.shape[0], x.shape[1], cfg.index_n_heads)
    if scores is None and n_entries > block and k <= block:
        q, head_weights = _indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx)
        top_scores, idx = _blocked_top_k(q, head_weights, index_keys, positions, k, block)
        return idx, top_scores > -jnp.inf
    if scores is None:
        scores = indexer_scores(params, cfg, x, q_latent, positions, index_keys, inv_freq, ctx)
    scores = jnp.where(compressed_visible(positions, n_entries, 4), scores, -jnp.inf)
    top_scores, idx = _top_k(scores, k, ctx)
    return idx, top_scores > -jnp.inf


@jax.named_scope("indexer")
def _indexer_select_on_kernel(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array,
                              positions: jax.Array, keys_buffer: jax.Array, live: int, inv_freq: np.ndarray, ctx):
    """indexer_select for decode rows with the scores from pallas_kernels/indexer.py (select): the
    first `live` entries of the whole key buffer (a slice would be a copy), the visibility mask and the score scale
    applied in the kernel, one top-k over all of them. Returns (idx, valid) as indexer_select does."""
    q, head_weights = _indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx, scale_weights=False)
    scores = indexer_kernel.indexer_scores(q, head_weights, keys_buffer, positions, n_entries=live,
                                           weight_scale=_indexer_weight_scale(cfg), interpret=ctx.kernels.interpret)
    top_scores, idx = jax.lax.top_k(scores, min(cfg.index_topk, live))
    return idx, top_scores > -jnp.inf


@jax.named_scope("indexer")
def _indexer_select_prefill_on_kernel(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array,
                                      positions: jax.Array, keys: jax.Array, inv_freq: np.ndarray, ctx):
    """indexer_select for a prefill chunk, x [B, S, D], keys [B, N, hd] (the live entries, decoded), with the scores
    from the kernel's prefill schedule (pallas_kernels/indexer.py): one top-k over all entries up to kernel_block()
    of them, a running top-k a block at a time beyond. Returns (idx, valid) as indexer_select does."""
    q, head_weights = _indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx, scale_weights=False)
    batch, seq = x.shape[:2]
    n_entries = keys.shape[1]
    k = min(cfg.index_topk, n_entries)
    block = kernel_block(batch, seq)

    def block_scores(keys_block, first):
        return indexer_kernel.indexer_scores(
            q, head_weights, keys_block, positions, n_entries=keys_block.shape[1],
            weight_scale=_indexer_weight_scale(cfg), interpret=ctx.kernels.interpret, first_entry=first,
            rows_per_program=indexer_kernel.prefill_rows_per_program(seq))
    if n_entries <= block:
        top_scores, idx = _top_k(block_scores(keys, 0), k, ctx)
    else:
        top_scores, idx = _running_top_k(block_scores, keys, positions, k, block)
    return idx, top_scores > -jnp.inf


def select(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array, index_keys,
           live: int, inv_freq: np.ndarray, ctx):
    """The indexer's picks (idx, valid) [B, S, k] among the first `live` entries of the stored key buffer
    `index_keys`: on pallas_kernels/indexer.py for a decode or verify step whose keys are stored in the activation
    dtype (not compact), in a geometry it takes (its scores need no [B, S, heads, N] intermediate, so even a
    1M-token context's entries are scored in one pass), and for a prefill chunk in such a geometry (keys of any
    storage, decoded); else indexer_select on the decoded live keys."""
    dtype = x.dtype
    if ctx.phase == "prefill":
        block = min(live, kernel_block(*x.shape[:2]))
        fits = indexer_kernel.supported(cfg.index_n_heads, cfg.index_head_dim, block)
        keys = index_keys.leading(live).decode(dtype)
        if choice.takes_kernel(PREFILL_SCORES_KERNEL, ctx, fits):
            return _indexer_select_prefill_on_kernel(params, cfg, x, q_latent, positions, keys, inv_freq, ctx)
        return indexer_select(params, cfg, x, q_latent, positions, keys, inv_freq, ctx)
    buffer = index_keys.plain(dtype)
    fits = buffer is not None and indexer_kernel.supported(cfg.index_n_heads, cfg.index_head_dim, live)
    if choice.takes_kernel(SCORES_KERNEL, ctx, fits):
        return _indexer_select_on_kernel(params, cfg, x, q_latent, positions, buffer, live, inv_freq, ctx)
    keys = index_keys.leading(live).decode(dtype)
    return indexer_select(params, cfg, x, q_latent, positions, keys, inv_freq, ctx)
