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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..numerics import kv_cache
from ..ops import attention_core, group_linear, indexer, linear, norm_rope
from ..ops.attention_core import compressed_visible
from ..ops.norm_rope import apply_rope
from ..ops.compressor_step import compressor_commit, compressor_read, compressor_update
from ..sharding import EXPERT, expert_devices, split_along, splits_heads
from .indexer_loss import indexer_kl


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
        q = norm_rope.queries(heads, local_cfg, q_latent, positions, inv_freq, ctx)
        out = attention_core._attend(q, ring, kv, start, positions, heads["attn_sink"], cfg.head_dim ** -0.5,
                                     cfg.window_size, ratio, compressed, picks)
        out = apply_rope(out, positions[:, :, None], inv_freq, inverse=True)
        return jax.lax.psum(_output(heads, local_cfg, out, jnp.float32, ctx), EXPERT)

    y = jax.shard_map(local, mesh=mesh, in_specs=(specs, *(jax.tree.map(lambda _: P(), a) for a in replicated)),
                      out_specs=P(), check_vma=False)(heads, *replicated)
    return y.astype(q_latent.dtype)


@jax.named_scope("attention")
def attention(params: dict, cfg: ModelConfig, ratio: int, x: jax.Array, start: jax.Array, n_valid: jax.Array,
              cache: dict, inv_freq: np.ndarray, ctx, defer: bool = False):
    """x [B, S, D] (attn_norm'd) at positions start[b] + i. Returns (output float32 [B, S, D] (the next mHC site
    rounds it to the streams' dtype), updated layer cache, statistics: {} for inference; under training
    {"indexer_kl": ...} in CSA layers, run_context.Training).

    `defer`: read without committing (a speculative verify chunk): the window ring and the compressors' pending
    tokens are left as they were and the returned cache carries a "pending" entry, which commit_attention turns
    into the state that feeding only a prefix of the chunk would have produced."""
    seq = x.shape[1]
    dtype = x.dtype
    positions = start[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]

    ring = cache["window_kv"]                                # the window before this chunk
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

    new_cache = {"pending": {}} if defer else {}
    stats = {}

    compressed = picks = None      # the compressed entries this call reads, and (CSA) the indexer's picks
    live = 0
    if ratio > 0:
        update = _deferred_update(new_cache) if defer else _committed_update(new_cache)
        compressed = update("compressor", params["compressor"], x, start, n_valid, cache, "compressed_kv",
                            ratio=ratio, head_dim=cfg.head_dim, nope_dim=cfg.nope_head_dim, inv_freq=inv_freq,
                            rotate=False, ctx=ctx, norm_eps=cfg.norm_eps)
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
        elif ratio == 4 and ctx.training is not None:       # its loss needs the scores of every entry
            keys = kv_cache.decode(kv_cache.leading(index_keys, live), dtype)
            scores = indexer.indexer_scores(params["indexer"], cfg, x_idx, q_latent_idx, positions, keys, inv_freq,
                                            ctx)
            stats["indexer_kl"] = indexer_kl(q, kv_cache.decode(kv_cache.leading(compressed, live), dtype),
                                             scores, compressed_visible(positions, live, 4))
            picks = indexer.indexer_select(params["indexer"], cfg, x_idx, q_latent_idx, positions, keys, inv_freq,
                                           ctx, scores)
        elif ratio == 4:
            # (indices, valid) as the indexer returns them: the mask straight from its top-k lets XLA fuse the
            # logits' masking into the softmax's max (a -1-for-none index array costs a kernel per layer there)
            picks = indexer.select(params["indexer"], cfg, x, q_latent, positions, index_keys, live, inv_freq, ctx)

    if not split:
        out = attention_core.attend(q, ring, kv, start, positions, params["attn_sink"], cfg, ratio, compressed,
                                    picks, live, inv_freq, ctx)
    if defer:
        new_cache["window_kv"], new_cache["pending"]["window_kv"] = ring, kv
    elif ring_written is not None:
        new_cache["window_kv"] = ring                          # written with the keys
    else:
        new_cache["window_kv"] = write_ring(ring, kv, start, n_valid)
    if split:
        if compressed is not None and ratio != 4:
            compressed = kv_cache.leading(compressed, live)
        y = _split_heads_output(params, cfg, q_latent, kv, ring, compressed, picks, start, positions,
                                ratio if compressed is not None else 0, inv_freq, ctx).astype(jnp.float32)
    else:
        y = _output(params, cfg, out, jnp.float32, ctx)
    return y, new_cache, stats
