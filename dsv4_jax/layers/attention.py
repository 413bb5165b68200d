"""Hybrid attention of one layer (docs/model.md 4.3, 4.5, 5): a 128-token window plus compressed entries.

Single shared K = V head of head_dim 512, low-rank query with per-head unweighted RMS norm, interleaved partial
RoPE, a learned sink logit in the softmax denominator, inverse RoPE on the output and a grouped low-rank output
projection. Compressed entries (ratio c > 0) are visible to query t iff j < (t+1)//c; ratio 4 (CSA) layers keep
only the top-k entries chosen by the Lightning indexer, other ratios (HCA) attend to all visible entries.

Like the compressor, this works on a chunk of S new tokens at per-sequence positions start[b] + i, so forward,
chunked prefill and decode share one code path. Window keys are the ring of the previous 128 positions
(slot = position mod 128) followed by the chunk's own keys, masked by position. The fused pieces are ops:
ops/norm_rope.py (query latent, keys, queries), ops/compressor_step.py, ops/indexer.py, ops/attention_core.py.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..numerics.kv_cache import EntryStore
from ..ops import attention_core, group_linear, indexer, layer_stats, linear, norm_rope
from ..ops.attention_core import compressed_visible
from ..ops.compressor_step import DeferredTokens, TokenRows, compressor_commit, compressor_read, compressor_update
from ..ops.norm_rope import apply_rope
from ..sharding import EXPERT, expert_devices, split_along, splits_heads
from .chunk import Chunk
from .indexer_loss import indexer_kl


@flax.struct.dataclass
class LayerCache:
    """What one layer keeps of the past: the window ring (keys of the last `window` positions, slot = position mod
    window); with compression (ratio c > 0) the compressed entries and the compressor's pending tokens; on CSA
    layers (c = 4) also the indexer's keys and its compressor's pending tokens. Entries are stored as their kind
    lays them out (numerics/kv_cache.py); parts a layer does not have are None."""
    window_kv: EntryStore
    compressed_kv: EntryStore | None = None
    compressor: TokenRows | None = None
    index_keys: EntryStore | None = None
    indexer_compressor: TokenRows | None = None


@flax.struct.dataclass
class DeferredChunk:
    """What a verify chunk read with `defer` leaves for commit_attention, beside the layer cache: the chunk's keys
    and, per compressor, its projected tokens and the entries it overwrote (None in layers without one)."""
    window_kv: jax.Array
    compressor: DeferredTokens | None = None
    indexer_compressor: DeferredTokens | None = None


def write_ring(ring: EntryStore, kv: jax.Array, start: jax.Array, n_valid: jax.Array) -> EntryStore:
    """Write the last min(window, n_valid) chunk tokens into their slots (position mod window)."""
    batch, seq, _ = kv.shape
    window = ring.n_entries
    if seq == 1 and batch == 1:
        # One token: its slot is always in range, so a dynamic_update_slice writes it in place (a scatter's bounds
        # check reads the old row first: one launch more per layer); without a token (n_valid 0) the slot keeps its
        # value, and where the token is always there (a decode step) the old value is never read
        slot = start[0] % window
        values = jax.tree.map(lambda new, old: jnp.where(n_valid[0] > 0, new, old), ring.encode(kv),
                              jax.tree.map(lambda buf: jax.lax.dynamic_slice_in_dim(buf, slot, 1, axis=1), ring))
        return jax.tree.map(lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, slot, axis=1), ring,
                            values)
    i = jnp.arange(seq, dtype=jnp.int32)[None, :]
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - window)
    slot = jnp.where(keep, (start[:, None] + i) % window, window)                # window -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], slot.shape)
    return ring.scatter(batch_idx, slot, kv)


def _compressor_dims(cfg: ModelConfig, ratio: int) -> dict:
    return dict(ratio=ratio, head_dim=cfg.head_dim, nope_dim=cfg.nope_head_dim, rotate=False, norm_eps=cfg.norm_eps)


def _indexer_compressor_dims(cfg: ModelConfig) -> dict:
    return dict(ratio=4, head_dim=cfg.index_head_dim, nope_dim=cfg.index_head_dim - cfg.rope_head_dim, rotate=True,
                norm_eps=cfg.norm_eps)


def commit_attention(params: dict, cfg: ModelConfig, ratio: int, cache: LayerCache, pending: DeferredChunk,
                     start: jax.Array, n_read: jax.Array, n_commit: jax.Array, inv_freq: np.ndarray,
                     ctx) -> LayerCache:
    """Commit the first n_commit[b] <= n_read[b] tokens of a chunk that attention(..., defer=True) read with
    n_read[b] real tokens (`cache` and `pending` as it returned them): the layer cache exactly as attention would
    have left it fed only those tokens."""
    dtype = ctx.jnp_dtype
    cache = cache.replace(window_kv=write_ring(cache.window_kv, pending.window_kv, start, n_commit))
    if ratio > 0:
        compressed, state = compressor_commit(params["compressor"], pending.compressor, start, n_read, n_commit,
                                              cache.compressor, cache.compressed_kv, out_dtype=dtype,
                                              inv_freq=inv_freq, ctx=ctx, **_compressor_dims(cfg, ratio))
        cache = cache.replace(compressed_kv=compressed, compressor=state)
    if ratio == 4:
        keys, state = compressor_commit(params["indexer"]["compressor"], pending.indexer_compressor, start, n_read,
                                        n_commit, cache.indexer_compressor, cache.index_keys, out_dtype=dtype,
                                        inv_freq=inv_freq, ctx=ctx, **_indexer_compressor_dims(cfg))
        cache = cache.replace(index_keys=keys, indexer_compressor=state)
    return cache


def _feed_compressor(params: dict, x, start, n_valid, state, entries, defer: bool, **kw):
    """Feed a compressor the chunk: (entries with those the chunk completes written, its pending state after the
    chunk (unchanged with `defer`), what a deferred commit needs (None without `defer`))."""
    if defer:
        entries, deferred = compressor_read(params, x, start, n_valid, state, entries, **kw)
        return entries, state, deferred
    entries, state = compressor_update(params, x, start, n_valid, state, entries, **kw)
    return entries, state, None


def _output(params: dict, cfg: ModelConfig, out: jax.Array, ctx) -> jax.Array:
    """The grouped low-rank output projection of the heads' outputs [B, S, n_heads, head_dim] (inverse RoPE done):
    wo_a per group, then wo_b. float32 [B, S, D] (the next mHC site rounds it to the streams' dtype)."""
    batch, seq = out.shape[:2]
    groups = cfg.o_groups
    out = out.reshape(batch, seq, groups, (cfg.n_heads // groups) * cfg.head_dim)
    # wo_a: the reference multiplies it in bf16 (convert.py dequantizes it), so its input is never quantized.
    z = group_linear(out, params["wo_a"]["weight"], ctx=ctx.without_act_quant())
    return linear(z.reshape(batch, seq, groups * cfg.o_lora_rank), params["wo_b"]["weight"], jnp.float32, ctx=ctx)


def _split_heads_output(params: dict, cfg: ModelConfig, q_latent, kv, ring, compressed, picks, start, positions,
                        ratio: int, inv_freq: np.ndarray, ctx) -> jax.Array:
    """Queries, attention and output projection with the heads split over the mesh's "expert" axis (sharding.rules):
    each device runs, inside shard_map on its local shards, its n_heads / n heads and o_groups / n output groups,
    and one psum (float32) adds the devices' partial wo_b outputs. The inputs (the query latent, the chunk's keys,
    the caches, the picks) are the same on every device. Returns float32 [B, S, D]."""
    mesh, n = ctx.mesh, expert_devices(ctx.mesh)
    local_cfg = cfg.replace(n_heads=cfg.n_heads // n, o_groups=cfg.o_groups // n)
    heads = {name: params[name] for name in ("wq_b", "attn_sink", "wo_a", "wo_b")}
    specs = {name: split_along(heads[name], 1 if name == "wo_b" else 0) for name in heads}   # wo_b: its inputs
    replicated = (q_latent, kv, ring, compressed, picks, start, positions)

    def local(heads, q_latent, kv, ring, compressed, picks, start, positions):
        with layer_stats.collecting() as taps:       # (ctx.stats: the matmuls' quantization, summed over devices)
            q = norm_rope.queries(heads, local_cfg, q_latent, positions, inv_freq, ctx)
            out = attention_core._attend(q, ring, kv, start, positions, heads["attn_sink"], cfg.head_dim ** -0.5,
                                         cfg.window_size, ratio, compressed, picks)
            out = apply_rope(out, positions[:, :, None], inv_freq, inverse=True)
            y = jax.lax.psum(_output(heads, local_cfg, out, ctx), EXPERT)
        return (y, layer_stats.across_devices(taps, EXPERT)) if ctx.stats else y

    y = jax.shard_map(local, mesh=mesh, in_specs=(specs, *(jax.tree.map(lambda _: P(), a) for a in replicated)),
                      out_specs=(P(), P()) if ctx.stats else P(), check_vma=False)(heads, *replicated)
    if not ctx.stats:
        return y
    layer_stats.record(y[1])
    return y[0]


@jax.named_scope("attention")
def attention(params: dict, cfg: ModelConfig, ratio: int, x: jax.Array, chunk: Chunk, cache: LayerCache,
              inv_freq: np.ndarray, ctx, defer: bool = False):
    """x [B, S, D] (attn_norm'd) of the chunk's tokens (at positions chunk.start[b] + i). Returns (output float32
    [B, S, D] (the next mHC site rounds it to the streams' dtype), updated layer cache, statistics: {} for
    inference, under training {"indexer_kl": ...} in CSA layers (run_context.Training), with ctx.stats
    {"entries_attended": [B, S]}, deferred: None, or with `defer` a DeferredChunk).

    `defer`: read without committing (a speculative verify chunk): the window ring and the compressors' pending
    tokens are left as they were, and the DeferredChunk beside the cache lets commit_attention make the state that
    feeding only a prefix of the chunk would have produced."""
    dtype = x.dtype
    start, n_valid, positions = chunk.start, chunk.n_valid, chunk.positions

    ring = cache.window_kv                                   # the window before this chunk
    split = splits_heads(cfg, expert_devices(ctx.mesh))     # the heads split over the mesh (sharding.rules)
    if split and ctx.training is not None:
        raise NotImplementedError("training with the attention heads split over a mesh (sharding.splits_heads)")
    # a committed chunk's keys may go into the ring as they are made (ring_written: the op wrote them)
    q_latent, kv, ring_written = norm_rope.latents_and_keys(params, cfg, x, positions, inv_freq, ctx,
                                                            ring=None if defer or split else ring, n_valid=n_valid)
    if ring_written is not None:
        ring = ring_written
    # with the heads split over a mesh each device makes its own queries (_split_heads_output)
    q = None if split else norm_rope.queries(params, cfg, q_latent, positions, inv_freq, ctx)

    stats = {}
    deferred = DeferredChunk(kv) if defer else None
    compressed = picks = None      # the compressed entries this call reads, and (CSA) the indexer's picks
    live = 0
    if ratio > 0:
        compressed, state, deferred_tokens = _feed_compressor(
            params["compressor"], x, start, n_valid, cache.compressor, cache.compressed_kv, defer,
            inv_freq=inv_freq, ctx=ctx, **_compressor_dims(cfg, ratio))
        cache = cache.replace(compressed_kv=compressed, compressor=state)    # decoded where it is read
        if defer:
            deferred = deferred.replace(compressor=deferred_tokens)
        # The indexer only picks entries (top-k has no gradient); under training its inputs are detached so that
        # its own loss (indexer_kl) trains the indexer and nothing else.
        x_idx, q_latent_idx = (x, q_latent) if ctx.training is None else jax.lax.stop_gradient((x, q_latent))
        if ratio == 4:
            index_keys, state, deferred_tokens = _feed_compressor(
                params["indexer"]["compressor"], x_idx, start, n_valid, cache.indexer_compressor, cache.index_keys,
                defer, inv_freq=inv_freq, ctx=ctx, **_indexer_compressor_dims(cfg))
            cache = cache.replace(index_keys=index_keys, indexer_compressor=state)
            if defer:
                deferred = deferred.replace(indexer_compressor=deferred_tokens)
        # Only the entries this call's positions can see are read (ctx.context_limit; visible: j < (t+1)//c).
        n_stored = compressed.n_entries
        live = n_stored if ctx.context_limit is None else min(n_stored, ctx.context_limit // ratio)
        if live == 0:              # buffers shorter than c never complete an entry
            compressed = None
        elif ratio == 4 and ctx.training is not None:       # its loss needs the scores of every entry
            keys = index_keys.leading(live).decode(dtype)
            scores = indexer.indexer_scores(params["indexer"], cfg, x_idx, q_latent_idx, positions, keys, inv_freq,
                                            ctx)
            stats["indexer_kl"] = indexer_kl(q, compressed.leading(live).decode(dtype), scores,
                                             compressed_visible(positions, live, 4))
            picks = indexer.indexer_select(params["indexer"], cfg, x_idx, q_latent_idx, positions, keys, inv_freq,
                                           ctx, scores)
        elif ratio == 4:
            # (indices, valid) as the indexer returns them: the mask straight from its top-k lets XLA fuse the
            # logits' masking into the softmax's max (a -1-for-none index array costs a kernel per layer there)
            picks = indexer.select(params["indexer"], cfg, x, q_latent, positions, index_keys, live, inv_freq, ctx)

    if not split:
        out = attention_core.attend(q, ring, kv, start, positions, params["attn_sink"], cfg, ratio, compressed,
                                    picks, live, inv_freq, ctx)
    if ring_written is not None:
        cache = cache.replace(window_kv=ring_written)          # written with the keys
    elif not defer:                                            # (deferred: commit_attention writes it)
        cache = cache.replace(window_kv=write_ring(ring, kv, start, n_valid))
    if split:
        if compressed is not None and ratio != 4:
            compressed = compressed.leading(live)
        y = _split_heads_output(params, cfg, q_latent, kv, ring, compressed, picks, start, positions,
                                ratio if compressed is not None else 0, inv_freq, ctx)
    else:
        y = _output(params, cfg, out, ctx)
    if ctx.stats:
        stats["entries_attended"] = _entries_attended(ratio, picks, positions, live if compressed is not None else 0)
    return y, cache, stats, deferred


def _entries_attended(ratio: int, picks, positions: jax.Array, live: int) -> jax.Array:
    """Compressed entries each query attended, float32 [B, S]: the indexer's valid picks (CSA), the visible
    entries (HCA: j < (t+1)//ratio among the `live` read), none in a window layer."""
    if ratio == 4 and picks is not None:
        return jnp.sum(picks[1], axis=-1).astype(jnp.float32)
    if ratio > 0 and ratio != 4 and live > 0:
        return jnp.minimum((positions + 1) // ratio, live).astype(jnp.float32)
    return jnp.zeros(positions.shape, jnp.float32)
