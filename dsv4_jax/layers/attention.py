"""Hybrid attention of one layer (docs/model.md 4.3, 4.5, 5): a 128-token window plus compressed entries.

Single shared K = V head of head_dim 512, low-rank query with per-head unweighted RMS norm, interleaved partial
RoPE, a learned sink logit in the softmax denominator, inverse RoPE on the output and a grouped low-rank output
projection. Compressed entries (ratio c > 0) are visible to query t iff j < (t+1)//c; ratio 4 (CSA) layers keep
only the top-k entries chosen by the Lightning indexer, other ratios (HCA) attend to all visible entries.

Like the compressor, this works on a chunk of S new tokens at per-sequence positions start[b] + i, so forward,
chunked prefill and decode share one code path. Window keys are the ring of the previous 128 positions
(slot = position mod 128) followed by the chunk's own keys, masked by position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..numerics import kv_cache
from ..config import ModelConfig
from ..pallas_kernels import decode_attention, norm_rope
from ..pallas_kernels import indexer as indexer_kernel
from ..ops import group_linear, linear, linear_joined, linear_pair
from ..numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, trained_rounding
from ..sharding import EXPERT, expert_devices, split_along, splits_heads
from .compressor import compressor_commit, compressor_read, compressor_update
from .indexer_loss import indexer_kl
from .norm import rms_norm
from .rope import apply_rope


def _kv_fake_quant(kv: jax.Array, nope_dim: int, ctx) -> jax.Array:
    return jnp.concatenate([trained_rounding(fp8_fake_quant, kv[..., :nope_dim], ctx), kv[..., nope_dim:]], axis=-1)


def ring_positions(start: jax.Array, window: int, slots: jax.Array | None = None) -> jax.Array:
    """Position held by each ring slot s before a chunk starting at `start`: the latest p < start with
    p = s (mod window); negative where nothing was written yet. [B, window] (`slots` [1, N]: those slots' instead)"""
    if slots is None:
        slots = jnp.arange(window, dtype=jnp.int32)[None, :]
    last = start[:, None] - 1
    return last - jnp.mod(last - slots, window)


def write_ring(ring, kv: jax.Array, start: jax.Array, n_valid: jax.Array):
    """Write the last min(window, n_valid) chunk tokens into their slots (position mod window); `ring` is stored
    as numerics/kv_cache.py lays it out."""
    batch, seq, _ = kv.shape
    window = kv_cache.n_entries(ring)
    if seq == 1 and batch == 1:
        # One token: its slot is always in range, so a dynamic_update_slice writes it in place (a scatter's bounds
        # check reads the old row first: one launch more per layer); without a token (n_valid 0) the slot keeps its
        # value, and where the token is always there (a decode step) the old value is never read
        slot = start[0] % window
        values = jax.tree.map(lambda new, old: jnp.where(n_valid[0] > 0, new, old), kv_cache.encode(kv, ring),
                              jax.tree.map(lambda buf: jax.lax.dynamic_slice_in_dim(buf, slot, 1, axis=1), ring))
        return jax.tree.map(lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, slot, axis=1), ring,
                            values)
    i = jnp.arange(seq, dtype=jnp.int32)[None, :]
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - window)
    slot = jnp.where(keep, (start[:, None] + i) % window, window)                # window -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], slot.shape)
    return kv_cache.scatter(ring, batch_idx, slot, kv)


def compressed_visible(positions: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """[B, S, N]: compressed entry j is visible to the query at position t iff j < (t+1)//ratio."""
    return jnp.arange(n_entries)[None, None, :] < ((positions + 1) // ratio)[:, :, None]


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


def _indexer_weight_scale(cfg: ModelConfig) -> float:
    """The indexer's score scale, folded into its per-head weights."""
    return cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5


def _indexer_query(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                   inv_freq: np.ndarray, ctx, scale_weights: bool = True) -> tuple[jax.Array, jax.Array]:
    """The indexer's queries [B, S, heads, head_dim] (rotated, fake-quantized as trained) and its per-head weights
    float32 [B, S, heads] (with the score scale folded in, unless `scale_weights` is False: a kernel folds it)."""
    batch, seq, _ = x.shape
    n_heads, head_dim = cfg.index_n_heads, cfg.index_head_dim
    if _rows_on_kernels(ctx, seq) and norm_rope.supported(head_dim, cfg.rope_head_dim,
                                                          hadamard_fp4=ctx.simulate_quant):
        # RoPE and the rounding in one launch on wq_b's float32 output (pallas_kernels/norm_rope.py, no norm)
        q = linear(q_latent, params["wq_b"]["weight"], jnp.float32, ctx=ctx).reshape(batch, seq, n_heads, head_dim)
        q = norm_rope.rms_norm_rows(q, None, eps=None, in_dtype=q_latent.dtype, rope=(positions, inv_freq),
                                    hadamard_fp4=ctx.simulate_quant, interpret=ctx.kernels.interpret)
    else:
        q = linear(q_latent, params["wq_b"]["weight"], ctx=ctx).reshape(batch, seq, n_heads, head_dim)
        q = apply_rope(q, positions[:, :, None], inv_freq)
        if ctx.simulate_quant:
            q = trained_rounding(fp4_fake_quant, hadamard(q), ctx)
    head_weights = linear(x, params["weights_proj"]["weight"], out_dtype=jnp.float32, ctx=ctx)
    return q, head_weights * _indexer_weight_scale(cfg) if scale_weights else head_weights


def _scores(q: jax.Array, head_weights: jax.Array, keys: jax.Array) -> jax.Array:
    """sum over heads of weight_h * ReLU(q_h . key): float32 [B, S, N] for keys [B, N, head_dim]."""
    dots = jnp.einsum("bshd,bnd->bshn", q.astype(jnp.float32), keys.astype(jnp.float32))
    return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(dots), head_weights)


@jax.named_scope("indexer")
def indexer_scores(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array, positions: jax.Array,
                   index_keys: jax.Array, inv_freq: np.ndarray, ctx) -> jax.Array:
    """Lightning indexer scores float32 [B, S, N] of every compressed entry (visible or not) for every query:
    sum over heads of weight_h(x) * ReLU(q_h . key)."""
    return _scores(*_indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx), index_keys)


def _blocked_top_k(q: jax.Array, head_weights: jax.Array, keys: jax.Array, positions: jax.Array, k: int,
                   block: int | None = None):
    """Top-k visible entries of every query over keys [B, N, hd] scored `block` (default INDEXER_BLOCK) entries at a
    time with a running top-k, so no [B, S, heads, N] intermediate exists. The running picks (lower indices) come
    first in each merge, so ties resolve to the lower index as one top_k over all entries does. Returns (scores,
    idx) [B, S, k]."""
    batch, n_entries, head_dim = keys.shape
    block = INDEXER_BLOCK if block is None else block
    n_blocks = -(-n_entries // block)
    keys = jnp.pad(keys, ((0, 0), (0, n_blocks * block - n_entries), (0, 0)))
    seq = q.shape[1]

    def body(b, carry):
        best, best_idx = carry
        first = b * block
        entry = first + jnp.arange(block, dtype=jnp.int32)
        scores = _scores(q, head_weights, jax.lax.dynamic_slice_in_dim(keys, first, block, axis=1))
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
    top_scores, idx = jax.lax.top_k(scores, k)
    return idx, top_scores > -jnp.inf


@jax.named_scope("indexer")
def _indexer_select_on_kernel(params: dict, cfg: ModelConfig, x: jax.Array, q_latent: jax.Array,
                              positions: jax.Array, keys_buffer: jax.Array, live: int, inv_freq: np.ndarray, ctx):
    """indexer_select for decode rows with the scores from pallas_kernels/indexer.py (_takes_indexer_kernel): the
    first `live` entries of the whole key buffer (a slice would be a copy), the visibility mask and the score scale
    applied in the kernel, one top-k over all of them. Returns (idx, valid) as indexer_select does."""
    q, head_weights = _indexer_query(params, cfg, x, q_latent, positions, inv_freq, ctx, scale_weights=False)
    scores = indexer_kernel.indexer_scores(q, head_weights, keys_buffer, positions, n_entries=live,
                                           weight_scale=_indexer_weight_scale(cfg), interpret=ctx.kernels.interpret)
    top_scores, idx = jax.lax.top_k(scores, min(cfg.index_topk, live))
    return idx, top_scores > -jnp.inf


def _indexer_compressor_dims(cfg: ModelConfig) -> dict:
    return dict(ratio=4, head_dim=cfg.index_head_dim, nope_dim=cfg.index_head_dim - cfg.rope_head_dim, rotate=True)


def _committed_update(new_cache: dict):
    """Feed a compressor and commit: its pending state goes to new_cache[name]; returns the updated entries."""
    def update(name, params, x, start, n_valid, cache, entries_name, **kw):
        entries, new_cache[name] = compressor_update(params, x, start, n_valid, cache[name], cache[entries_name],
                                                     **kw)
        return entries
    return update


def _deferred_update(new_cache: dict):
    """Feed a compressor for reading only: its pending state stays, the commit data goes to the pending entry."""
    def update(name, params, x, start, n_valid, cache, entries_name, **kw):
        entries, new_cache["pending"][name] = compressor_read(params, x, start, n_valid, cache[name],
                                                              cache[entries_name], **kw)
        new_cache[name] = cache[name]
        return entries
    return update


def commit_attention(params: dict, cfg: ModelConfig, ratio: int, cache: dict, start: jax.Array, n_read: jax.Array,
                     n_commit: jax.Array, inv_freq: np.ndarray, ctx) -> dict:
    """Commit the first n_commit[b] <= n_read[b] tokens of a chunk that attention(..., defer=True) read with
    n_read[b] real tokens: the layer cache exactly as attention would have left it fed only those tokens."""
    cache = dict(cache)
    pending = cache.pop("pending")
    dtype = ctx.jnp_dtype
    cache["window_kv"] = write_ring(cache["window_kv"], pending["window_kv"], start, n_commit)
    if ratio > 0:
        cache["compressed_kv"], cache["compressor"] = compressor_commit(
            params["compressor"], pending["compressor"], start, n_read, n_commit, cache["compressor"],
            cache["compressed_kv"], out_dtype=dtype, ratio=ratio, head_dim=cfg.head_dim, nope_dim=cfg.nope_head_dim,
            inv_freq=inv_freq, rotate=False, ctx=ctx, norm_eps=cfg.norm_eps)
    if ratio == 4:
        cache["index_keys"], cache["indexer_compressor"] = compressor_commit(
            params["indexer"]["compressor"], pending["indexer_compressor"], start, n_read, n_commit,
            cache["indexer_compressor"], cache["index_keys"], out_dtype=dtype, **_indexer_compressor_dims(cfg),
            inv_freq=inv_freq, ctx=ctx, norm_eps=cfg.norm_eps)
    return cache


def _takes_decode_kernel(ctx, cfg: ModelConfig, seq: int) -> bool:
    """Whether this call's attention runs on pallas_kernels/decode_attention.py: the "interpret" plan, or a GPU plan
    with the kernel switched on (decode_attention.enabled_on_gpu: opt-in until timed faster); inference, a decode
    or verify chunk, a supported geometry (caches in the activation dtype or compact)."""
    plan = ctx.kernels.interpret or (ctx.kernels.on_gpu and decode_attention.enabled_on_gpu())
    return (plan and ctx.training is None
            and decode_attention.takes(seq, cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.rope_head_dim))


def _rows_on_kernels(ctx, seq: int) -> bool:
    """Whether a chunk's per-row prologues (norms, RoPE, roundings) run on pallas_kernels/norm_rope.py: a kernel plan
    (a GPU's, or "interpret"), inference, decode or verify chunks (prefill keeps XLA's fusions)."""
    return ctx.inference_kernels and seq <= decode_attention.MAX_ROWS


def _takes_indexer_kernel(ctx, cfg: ModelConfig, seq: int, index_keys, live: int, dtype) -> bool:
    """Whether the indexer's scores run on pallas_kernels/indexer.py: _rows_on_kernels under inference, keys stored
    in the activation dtype (not compact), a geometry it takes. Its scores need no [B, S, heads, N] intermediate, so
    even a 1M-token context's entries are scored in one pass (no blocked top-k)."""
    return (_rows_on_kernels(ctx, seq) and not isinstance(index_keys, dict)
            and index_keys.dtype == dtype and indexer_kernel.supported(cfg.index_n_heads, cfg.index_head_dim, live))


def _takes_norm_kernel(ctx, cfg: ModelConfig, seq: int) -> bool:
    """Whether the query latent's and the keys' norms run on pallas_kernels/norm_rope.py (_rows_on_kernels, widths
    it takes)."""
    return (_rows_on_kernels(ctx, seq) and norm_rope.supported(cfg.q_lora_rank)
            and norm_rope.supported(cfg.head_dim, cfg.rope_head_dim, ctx.simulate_quant))


def _window_blocks(q, keys, key_pos, positions, window: int):
    """The window part of a chunk longer than the window, in blocks of `window` queries: a query at position p
    sees keys p - window + 1 .. p, which lie in its own block and the one before it (for the first block, the
    ring), so each block scores 2 x window keys instead of the whole chunk: linear in the chunk, not quadratic.
    Every key a query sees is among its block's keys, and the mask is by position, so this is the softmax the
    whole-chunk path takes. keys / key_pos are the ring followed by the chunk ([B, W+S, hd], [B, W+S]); the chunk
    is padded to whole blocks with positions past every query's (masked for all of them).
    Returns logits [B, S, H, 2W] (unscaled, float32), mask [B, S, 2W] and the blocks' keys [B, S/W, 2W, hd]."""
    batch, seq, n_heads, head_dim = q.shape
    n_blocks = -(-seq // window)
    pad = n_blocks * window - seq
    after = positions[:, -1:] + 1 + jnp.arange(pad, dtype=positions.dtype)[None, :]     # beyond every query
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch, n_blocks, window, n_heads, head_dim)
    q_pos = jnp.concatenate([positions, after], axis=1).reshape(batch, n_blocks, window)
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    key_pos = jnp.concatenate([key_pos, after], axis=1)

    def pairs(a):          # [B, W + n_blocks W, ...] -> [B, n_blocks, 2W, ...]: block b reads a[bW : bW + 2W]
        before = a[:, :n_blocks * window].reshape(batch, n_blocks, window, *a.shape[2:])
        own = a[:, window:].reshape(batch, n_blocks, window, *a.shape[2:])
        return jnp.concatenate([before, own], axis=2)

    block_keys, block_pos = pairs(keys), pairs(key_pos)
    delta = q_pos[:, :, :, None] - block_pos[:, :, None, :]
    mask = (block_pos[:, :, None, :] >= 0) & (delta >= 0) & (delta < window)           # [B, n, W, 2W]
    logits = jnp.einsum("bnqhd,bnkd->bnqhk", q, block_keys, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, n_blocks * window, n_heads, 2 * window)[:, :seq]
    return logits, mask.reshape(batch, n_blocks * window, 2 * window)[:, :seq], block_keys


def _window_blocks_values(p, block_keys):
    """p [B, S, H, 2W] (the probabilities _window_blocks' logits became) times its blocks' values (K = V):
    float32 [B, S, H, hd]."""
    batch, seq, n_heads, width = p.shape
    n_blocks, window = block_keys.shape[1], width // 2
    p = jnp.pad(p, ((0, 0), (0, n_blocks * window - seq), (0, 0), (0, 0)))
    p = p.reshape(batch, n_blocks, window, n_heads, width)
    out = jnp.einsum("bnqhk,bnkd->bnqhd", p, block_keys, preferred_element_type=jnp.float32)
    return out.reshape(batch, n_blocks * window, n_heads, -1)[:, :seq]


def _attend(q, ring, kv, start, positions, sink, scale: float, window: int, ratio: int, compressed, picks):
    """The jnp path of the attention core: one softmax over the window keys (the ring, then the chunk itself,
    masked by position; in blocks for a chunk longer than the window: _window_blocks) and the compressed entries
    (CSA: picks = (indices, valid) [B, S, k] from the indexer; HCA: the visible ones), with the sink logit in the
    denominator only. Returns [B, S, H, D] in q's dtype, before the inverse RoPE."""
    dtype = q.dtype
    batch, seq, n_heads, head_dim = q.shape
    keys = jnp.concatenate([kv_cache.decode(ring, dtype), kv], axis=1)                   # [B, W+S, hd]
    if seq == 1:
        return _attend_one_token(q, keys, start, sink, scale, window, ratio, compressed, picks)
    key_pos = jnp.concatenate([ring_positions(start, window), positions], axis=1)
    if seq > window:
        window_logits, window_mask, window_values = _window_blocks(q, keys, key_pos, positions, window)
        logits = [window_logits * scale]
        values = [("blocks", window_values)]
    else:
        delta = positions[:, :, None] - key_pos[:, None, :]
        window_mask = (key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < window)      # [B, S, W+S]
        logits = [jnp.einsum("bshd,bkd->bshk", q, keys, preferred_element_type=jnp.float32) * scale]
        values = [("window", keys)]
    masks = [window_mask[:, :, None, :]]
    if compressed is not None and ratio == 4:
        idx, valid = picks
        selected = kv_cache.decode(kv_cache.gather_rows(compressed, idx), dtype)     # [B, S, k, hd]
        logits.append(jnp.einsum("bshd,bskd->bshk", q, selected, preferred_element_type=jnp.float32) * scale)
        masks.append(valid[:, :, None, :])
        values.append(("selected", selected))
    elif compressed is not None:
        compressed = kv_cache.decode(compressed, dtype)
        visible = compressed_visible(positions, compressed.shape[1], ratio)
        logits.append(jnp.einsum("bshd,bnd->bshn", q, compressed, preferred_element_type=jnp.float32) * scale)
        masks.append(visible[:, :, None, :])
        values.append(("all", compressed))

    logits = [jnp.where(m, l, -jnp.inf) for l, m in zip(logits, masks)]
    sink = sink.astype(jnp.float32)[None, None, :]
    peak = jnp.maximum(jnp.max(jnp.stack([jnp.max(l, axis=-1) for l in logits]), axis=0), sink)
    probs = [jnp.exp(l - peak[..., None]) for l in logits]
    denom = sum(jnp.sum(p, axis=-1) for p in probs) + jnp.exp(sink - peak)
    out = jnp.zeros((batch, seq, n_heads, head_dim), jnp.float32)
    for p, (kind, v) in zip(probs, values):
        p = p.astype(dtype)
        if kind == "selected":
            out = out + jnp.einsum("bshk,bskd->bshd", p, v, preferred_element_type=jnp.float32)
        elif kind == "blocks":
            out = out + _window_blocks_values(p, v)
        else:
            out = out + jnp.einsum("bshk,bkd->bshd", p, v, preferred_element_type=jnp.float32)
    return (out / denom[..., None]).astype(dtype)


KEY_ALIGN = 64         # _attend_one_token's keys come in multiples of this (else XLA pads them for its matmuls: a copy)


def _attend_one_token(q, keys, start, sink, scale: float, window: int, ratio: int, compressed, picks):
    """_attend for one token per sequence (at position `start`): every key it may see (the window's, then the picked
    or visible compressed entries) in one array, so that the logits, the softmax and the values are one matmul, one
    softmax and one matmul. The softmax is a plain one over the last axis, which XLA's GPU backend fuses into one
    kernel (a max, then a sum with the sink added after it, are two or three): the sink's logit takes the first
    padding column (its key is zeros, so it adds nothing to the values), the probabilities are normalised before
    the values' matmul, and the mask is arithmetic on the column index (a concatenated mask would be a kernel of
    its own). CSA's picks need no mask of their own: indexer_select returns its valid picks first, min(k, visible)
    of them, so pick j is valid iff entry j would be visible, as for HCA."""
    dtype = q.dtype
    parts = [keys]                                                                       # ring, then the token
    if compressed is not None and ratio == 4:
        parts.append(kv_cache.decode(kv_cache.gather_rows(compressed, picks[0]), dtype)[:, 0])   # [B, k, hd]
    elif compressed is not None:
        parts.append(kv_cache.decode(compressed, dtype))
    sink_column = sum(p.shape[1] for p in parts)
    pad = -(sink_column + 1) % KEY_ALIGN + 1      # masked zero keys (the matmuls take the array as made); 1 or more
    parts.append(jnp.zeros((keys.shape[0], pad, keys.shape[2]), dtype))
    keys = jnp.concatenate(parts, axis=1)
    column = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]
    position = start[:, None]
    held = ring_positions(start, window, column)              # for the ring's columns (elementwise: no concatenation)
    in_window = ((column < window) & (held >= 0) & (position - held < window)) | (column == window)
    entry = column - (window + 1)
    # compressed_visible's rule, entry < (position + 1) // ratio, without the division (XLA hoists a division of
    # the position into a kernel of its own)
    in_compressed = (entry >= 0) & (entry < sink_column - (window + 1)) & ((entry + 1) * ratio <= position + 1)
    mask = (in_window | in_compressed)[:, None, None, :]                                 # [B, 1, 1, K]
    logits = jnp.einsum("bshd,bkd->bshk", q, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask, logits, -jnp.inf)
    logits = jnp.where(column[:, None, None, :] == sink_column, sink.astype(jnp.float32)[None, None, :, None], logits)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - peak)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bshk,bkd->bshd", probs.astype(dtype), keys, preferred_element_type=jnp.float32)
    return out.astype(dtype)


def _queries(params: dict, cfg: ModelConfig, q_latent: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
             ctx, norm_kernel: bool = False) -> jax.Array:
    """The rotated per-head queries [B, S, n_heads, head_dim] of q_latent (wq_b, per-head RMS norm, RoPE);
    `norm_kernel`: the norm and RoPE in one launch of pallas_kernels/norm_rope.py, on wq_b's float32 output."""
    batch, seq, _ = q_latent.shape
    if norm_kernel:
        q = linear(q_latent, params["wq_b"]["weight"], jnp.float32, ctx=ctx)
        return norm_rope.rms_norm_rows(q.reshape(batch, seq, cfg.n_heads, cfg.head_dim), None, eps=cfg.norm_eps,
                                       in_dtype=q_latent.dtype, rope=(positions, inv_freq),
                                       interpret=ctx.kernels.interpret)
    q = linear(q_latent, params["wq_b"]["weight"], ctx=ctx).reshape(batch, seq, cfg.n_heads, cfg.head_dim)
    q = rms_norm(q, None, cfg.norm_eps)
    return apply_rope(q, positions[:, :, None], inv_freq)


def _output(params: dict, cfg: ModelConfig, out: jax.Array, out_dtype, ctx) -> jax.Array:
    """The grouped low-rank output projection of the heads' outputs [B, S, n_heads, head_dim] (inverse RoPE done):
    wo_a per group, then wo_b. [B, S, D] in out_dtype."""
    batch, seq = out.shape[:2]
    groups = cfg.o_groups
    out = out.reshape(batch, seq, groups, (cfg.n_heads // groups) * cfg.head_dim)
    # wo_a: the reference multiplies it in bf16 (convert.py dequantizes it), so its input is never quantized.
    z = group_linear(out, params["wo_a"]["weight"], ctx=ctx.without_act_quant())
    return linear(z.reshape(batch, seq, groups * cfg.o_lora_rank), params["wo_b"]["weight"], out_dtype, ctx=ctx)


def _split_heads_output(params: dict, cfg: ModelConfig, q_latent, kv, ring, compressed, picks, start, positions,
                        ratio: int, inv_freq: np.ndarray, ctx) -> jax.Array:
    """Queries, attention and output projection with the heads split over the mesh's "expert" axis (sharding.rules):
    each device runs, inside shard_map on its local shards, its n_heads / n heads and o_groups / n output groups,
    and one psum (float32) adds the devices' partial wo_b outputs. The inputs (the query latent, the chunk's keys,
    the caches, the picks) are the same on every device. Returns [B, S, D] in q_latent's dtype."""
    mesh, n = ctx.mesh, expert_devices(ctx.mesh)
    local_cfg = cfg.replace(n_heads=cfg.n_heads // n, o_groups=cfg.o_groups // n)
    heads = {name: params[name] for name in ("wq_b", "attn_sink", "wo_a", "wo_b")}
    specs = {name: split_along(heads[name], 1 if name == "wo_b" else 0) for name in heads}   # wo_b: its inputs
    replicated = (q_latent, kv, ring, compressed, picks, start, positions)

    def local(heads, q_latent, kv, ring, compressed, picks, start, positions):
        q = _queries(heads, local_cfg, q_latent, positions, inv_freq, ctx)
        out = _attend(q, ring, kv, start, positions, heads["attn_sink"], cfg.head_dim ** -0.5, cfg.window_size,
                      ratio, compressed, picks)
        out = apply_rope(out, positions[:, :, None], inv_freq, inverse=True)
        return jax.lax.psum(_output(heads, local_cfg, out, jnp.float32, ctx), EXPERT)

    y = jax.shard_map(local, mesh=mesh, in_specs=(specs, *(jax.tree.map(lambda _: P(), a) for a in replicated)),
                      out_specs=P(), check_vma=False)(heads, *replicated)
    return y.astype(q_latent.dtype)


@jax.named_scope("attention")
def attention(params: dict, cfg: ModelConfig, ratio: int, x: jax.Array, start: jax.Array, n_valid: jax.Array,
              cache: dict, inv_freq: np.ndarray, ctx, defer: bool = False, out_dtype=None):
    """x [B, S, D] (attn_norm'd) at positions start[b] + i. Returns (output [B, S, D] in out_dtype (default x's),
    updated layer cache, statistics: {} for inference; under training {"indexer_kl": ...} in CSA layers,
    run_context.Training).

    `defer`: read without committing (a speculative verify chunk): the window ring and the compressors' pending
    tokens are left as they were and the returned cache carries a "pending" entry, which commit_attention turns
    into the state that feeding only a prefix of the chunk would have produced."""
    batch, seq, _ = x.shape
    n_heads, head_dim, nope = cfg.n_heads, cfg.head_dim, cfg.nope_head_dim
    dtype = x.dtype
    positions = start[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]

    ring = cache["window_kv"]                                # the window before this chunk
    split = splits_heads(cfg, expert_devices(ctx.mesh))     # the heads split over the mesh (sharding.rules)
    if split and ctx.training is not None:
        raise NotImplementedError("training with the attention heads split over a mesh (sharding.splits_heads)")
    on_kernel = not split and _takes_decode_kernel(ctx, cfg, seq)
    norm_kernel = _takes_norm_kernel(ctx, cfg, seq)
    # the keys' norm kernel writes the window ring too: one token per sequence, committed, a plain ring
    ring_in_kernel = (norm_kernel and seq == 1 and not defer and not split and not isinstance(ring, dict)
                      and ring.dtype == dtype)
    # wq_a and wkv read the same x: one launch for both where a decode kernel takes them (linear_pair)
    if norm_kernel:
        # one launch per norm (pallas_kernels/norm_rope.py), each reading its columns of the pair's float32 output
        # in place and rounding them to dtype; the keys are also rotated and fake-quantized there
        q_a_kv_a = linear_joined(x, params["wq_a"]["weight"], params["wkv"]["weight"], jnp.float32, ctx=ctx)
        rank, interpret = cfg.q_lora_rank, ctx.kernels.interpret
        q_latent = norm_rope.rms_norm_rows(q_a_kv_a, params["q_norm"]["weight"], eps=cfg.norm_eps, in_dtype=dtype,
                                           columns=(0, rank), interpret=interpret)
        key_norm = functools.partial(norm_rope.rms_norm_rows, q_a_kv_a, params["kv_norm"]["weight"],
                                     eps=cfg.norm_eps, in_dtype=dtype, rope=(positions, inv_freq),
                                     fp8_nope=ctx.simulate_quant, columns=(rank, head_dim), interpret=interpret)
        if ring_in_kernel:
            # the new key also goes into its window-ring slot, in place: the slot held position t - window, which
            # no query of this call sees (masked by position), so attention may read the ring after the write
            kv, ring = key_norm(ring=(ring, n_valid))
        else:
            kv = key_norm()
    else:
        q_a, kv_a = linear_pair(x, params["wq_a"]["weight"], params["wkv"]["weight"], ctx=ctx)
        q_latent = rms_norm(q_a, params["q_norm"]["weight"], cfg.norm_eps)
    if on_kernel and not norm_kernel:
        # the kernel rounds q to dtype and does its per-head norm and RoPE, and makes the chunk's keys from kv_a
        # (norm, RoPE, fake quant): no launches of their own
        q = linear(q_latent, params["wq_b"]["weight"], jnp.float32, ctx=ctx).reshape(batch, seq, n_heads, head_dim)
    else:
        # with the heads split over a mesh each device makes its own (_split_heads_output)
        q = None if split else _queries(params, cfg, q_latent, positions, inv_freq, ctx, norm_kernel)
    if not on_kernel and not norm_kernel:
        kv = rms_norm(kv_a, params["kv_norm"]["weight"], cfg.norm_eps)
        kv = apply_rope(kv, positions, inv_freq)
        if ctx.simulate_quant:
            kv = _kv_fake_quant(kv, nope, ctx)

    new_cache = {"pending": {}} if defer else {}
    stats = {}

    compressed = picks = None      # the compressed entries this call reads, and (CSA) the indexer's picks
    if ratio > 0:
        update = _deferred_update(new_cache) if defer else _committed_update(new_cache)
        compressed = update("compressor", params["compressor"], x, start, n_valid, cache, "compressed_kv",
                            ratio=ratio, head_dim=head_dim, nope_dim=nope, inv_freq=inv_freq, rotate=False, ctx=ctx,
                            norm_eps=cfg.norm_eps)
        new_cache["compressed_kv"] = compressed            # stored (numerics/kv_cache.py): decoded where it is read
        # The indexer only picks entries (top-k has no gradient); under training its inputs are detached so that
        # its own loss (indexer_kl) trains the indexer and nothing else.
        x_idx, q_latent_idx = (x, q_latent) if ctx.training is None else jax.lax.stop_gradient((x, q_latent))
        if ratio == 4:
            index_keys = update("indexer_compressor", params["indexer"]["compressor"], x_idx, start, n_valid,
                                cache, "index_keys", **_indexer_compressor_dims(cfg), inv_freq=inv_freq,
                                ctx=ctx, norm_eps=cfg.norm_eps)
            new_cache["index_keys"] = index_keys
        # Only the entries this call's positions can see are read (ctx.context_limit; visible: j < (t+1)//c).
        n_stored = kv_cache.n_entries(compressed)
        live = n_stored if ctx.context_limit is None else min(n_stored, ctx.context_limit // ratio)
        if live == 0:              # buffers shorter than c never complete an entry
            compressed = None
        elif ratio == 4 and _takes_indexer_kernel(ctx, cfg, seq, index_keys, live, dtype):
            picks = _indexer_select_on_kernel(params["indexer"], cfg, x, q_latent, positions, index_keys, live,
                                              inv_freq, ctx)
        elif ratio == 4:
            index_keys = kv_cache.decode(kv_cache.leading(index_keys, live), dtype)
            scores = None
            if ctx.training is not None:                 # its loss needs the scores of every entry
                scores = indexer_scores(params["indexer"], cfg, x_idx, q_latent_idx, positions, index_keys,
                                        inv_freq, ctx)
                stats["indexer_kl"] = indexer_kl(q, kv_cache.decode(kv_cache.leading(compressed, live), dtype),
                                                 scores, compressed_visible(positions, live, 4))
            idx, valid = indexer_select(params["indexer"], cfg, x_idx, q_latent_idx, positions, index_keys,
                                        inv_freq, ctx, scores)
            # (indices, valid) as the indexer returns them: the mask straight from its top-k lets XLA fuse the
            # logits' masking into the softmax's max (a -1-for-none index array costs a kernel per layer there);
            # the decode attention kernel takes that one array
            picks = (idx, valid)

    scale = head_dim ** -0.5
    window = cfg.window_size
    sink = params["attn_sink"]
    if on_kernel:
        # the window, the compressed entries, the softmax and the inverse RoPE in one launch (two with the splits'
        # merge), reading only the entries attended (the whole compressed buffer is passed: a slice would be a
        # copy; the kernel stops at the visible entries). With the norm kernels the query comes ready from
        # norm_rope's kernel (made once per token, not once per program); without, the kernel also makes the query
        # (norm, RoPE) and the chunk's keys (norm, RoPE, fake quant).
        prologue = None if norm_kernel else (params["kv_norm"]["weight"], ctx.simulate_quant)
        out = decode_attention.decode_attention(
            q, ring, kv if norm_kernel else kv_a, start, sink, scale=scale, compressed=compressed,
            picks=None if picks is None else picks[0],      # the kernel skips picks the token cannot see
            ratio=ratio if compressed is not None else 0, rope=(inv_freq, cfg.norm_eps), kv_prologue=prologue,
            query_ready=norm_kernel, interpret=ctx.kernels.interpret)
        if prologue is not None:
            out, kv = out
    else:
        if compressed is not None and ratio != 4:
            compressed = kv_cache.leading(compressed, live)
        if not split:
            out = _attend(q, ring, kv, start, positions, sink, scale, window, ratio, compressed, picks)
            out = apply_rope(out, positions[:, :, None], inv_freq, inverse=True)
    if defer:
        new_cache["window_kv"], new_cache["pending"]["window_kv"] = ring, kv
    elif ring_in_kernel:
        new_cache["window_kv"] = ring                          # written by the keys' norm kernel
    else:
        new_cache["window_kv"] = write_ring(ring, kv, start, n_valid)
    if split:
        y = _split_heads_output(params, cfg, q_latent, kv, ring, compressed, picks, start, positions,
                                ratio if compressed is not None else 0, inv_freq, ctx).astype(out_dtype or dtype)
    else:
        y = _output(params, cfg, out, out_dtype or dtype, ctx)
    return y, new_cache, stats
