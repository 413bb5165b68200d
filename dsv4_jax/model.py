"""The DeepSeek-V4 transformer as pure functions over explicit pytrees (params, per-layer caches).

embed -> hc_mult residual streams -> blocks (mHC-wrapped attention, mHC-wrapped MoE) -> hc head -> norm ->
float32 logits; plus the MTP block (docs/model.md 4.8). Every function works on a chunk of S tokens at
per-sequence positions start[b] + i, of which the first n_valid[b] are real (layers.chunk.Chunk); the caches carry
everything earlier.
Every function takes the run context `ctx` (run_context.py): numerics, kernel plan, training switches.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .config import ModelConfig
from .layer_scan import StackedLayers
from .layers.attention import DeferredChunk, LayerCache, attention, commit_attention
from .layers.chunk import Chunk
from .layers.hyper import hc_head
from .ops import head_linear, layer_stats, linear, mhc_site
from .ops.mhc_site import hc_post
from .ops.moe_ffn import MoeParts, moe
from .ops.norm_rope import rms_norm, rope_inv_freq
from .run_context import RunContext


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """"window", "csa" (ratio 4), "hca" (other ratios) or "mtp": the named scope of a layer's ops is
    f"{kind}_layer" (hlo_census counts kernels per layer kind by it)."""
    if layer >= cfg.n_layers:
        return "mtp"
    ratio = cfg.compress_ratios[layer]
    return "window" if ratio == 0 else "csa" if ratio == 4 else "hca"


class BlockOut(NamedTuple):
    """What a block (or the backbone) returns: the streams, the new cache(s), statistics ({} for inference; under
    training the layer's `indexer_kl` and `expert_load`, run_context.Training; with ctx.stats its "diagnostics",
    ops/layer_stats.py) and, for a chunk read with `defer`,
    what its commit needs beside the cache(s) (layers.attention.DeferredChunk; None otherwise)."""
    streams: object
    cache: object
    stats: object
    deferred: object


def block(params: dict, cfg: ModelConfig, ctx: RunContext, layer: int, X: jax.Array, chunk: Chunk,
          cache: LayerCache, defer: bool = False) -> BlockOut:
    """One transformer block on streams X [B, S, n, D] (BlockOut.streams: the new X). `defer`: read the cache
    without committing the chunk (attention's `defer`; commit_block commits a prefix)."""
    out = block_streams(params, cfg, ctx, layer, (X, None), chunk, cache, defer)
    return out._replace(streams=resolve_streams(cfg, layer, out.streams))


def block_streams(params: dict, cfg: ModelConfig, ctx: RunContext, layer: int, streams, chunk: Chunk,
                  cache: LayerCache, defer: bool = False) -> BlockOut:
    """`block` on streams whose last hc_post may still be due: `streams` = (X, post_mix), post_mix = (y, post,
    comb) of the previous sub-layer or None; BlockOut.streams is this block's (X, post_mix). Consecutive blocks
    pass their final hc_post on, so that it runs inside the next block's first mHC site (one launch fewer on its
    kernels, ops/mhc_site.py); resolve_streams applies it."""
    with jax.named_scope(f"{layer_kind(cfg, layer)}_layer"):
        return _block(params, cfg, ctx, layer, *streams, chunk, cache, defer)


def resolve_streams(cfg: ModelConfig, layer: int, streams) -> jax.Array:
    """The streams X [B, S, n, D] of block_streams' (X, post_mix): the due hc_post applied (in `layer`'s scope)."""
    X, post_mix = streams
    if post_mix is None:
        return X
    with jax.named_scope(f"{layer_kind(cfg, layer)}_layer"):
        return hc_post(post_mix[0], X, post_mix[1], post_mix[2])


def commit_block(params: dict, cfg: ModelConfig, ctx: RunContext, layer: int, cache: LayerCache,
                 deferred: DeferredChunk, start: jax.Array, n_read: jax.Array, n_commit: jax.Array) -> LayerCache:
    """The cache of a block that read a chunk with `defer` (and the DeferredChunk it left), committed for its first
    n_commit[b] tokens."""
    ratio = cfg.compress_ratios[layer]
    return commit_attention(params["attn"], cfg, ratio, cache, deferred, start, n_read, n_commit,
                            rope_inv_freq(cfg, ratio), ctx)


def _block(params, cfg, ctx, layer, X, post_mix, chunk, cache, defer) -> BlockOut:
    ratio = cfg.compress_ratios[layer]
    x, attn_post, attn_comb, X_in = mhc_site.pre_norm(X, params["hc_attn_fn"], params["hc_attn_base"],
                                                      params["hc_attn_scale"], params["attn_norm"]["weight"], cfg,
                                                      ctx, post_mix=post_mix)
    with layer_stats.collecting() as attn_taps:        # (ctx.stats: what the sub-layer's quantization does)
        y_attn, cache, attn_stats, deferred = attention(params["attn"], cfg, ratio, x, chunk, cache,
                                                        rope_inv_freq(cfg, ratio), ctx, defer)
    # the attention's hc_post runs inside the next site, which rounds its float32 output to the streams' dtype
    x, post, comb, X = mhc_site.pre_norm(X_in, params["hc_ffn_fn"], params["hc_ffn_base"], params["hc_ffn_scale"],
                                         params["ffn_norm"]["weight"], cfg, ctx,
                                         post_mix=(y_attn, attn_post, attn_comb))
    with layer_stats.collecting() as moe_taps:
        y, moe_stats = moe(params["ffn"], cfg, x, chunk.tokens, cfg.is_hash_layer(layer), ctx, real=chunk.real)
    stats = attn_stats | moe_stats
    if ctx.stats:
        # measured beside the computation (the streams after the MoE are the next block's to make)
        taps = (attn_taps, moe_taps)
        stats = _layer_record(cfg, chunk, stats, (X_in, y_attn, (attn_post, attn_comb), X), (y, (post, comb)), taps)
    return BlockOut((X, (y, post, comb)), cache, stats, deferred)


def _layer_record(cfg: ModelConfig, chunk: Chunk, stats: dict, attn_side, moe_side, taps) -> dict:
    """The block's statistics with its raw routing and attention numbers replaced by its ops/layer_stats.py record
    ("diagnostics")."""
    # the barrier keeps the measuring out of the model's own fusions, so that its numbers stay those without stats
    attn_side, moe_side, stats = jax.lax.optimization_barrier((attn_side, moe_side, stats))
    X_in, y_attn, attn_mix, X_attn = attn_side
    y, moe_mix = moe_side
    valid = jnp.arange(chunk.tokens.shape[1], dtype=jnp.int32)[None, :] < chunk.n_valid[:, None]
    stats = dict(stats)
    record = (layer_stats.streams_record("in", X_in, valid) | layer_stats.streams_record("attn", X_attn, valid)
              | layer_stats.streams_record("moe", hc_post(y, X_attn, *moe_mix), valid)
              | {"attn_out_rms": layer_stats.masked_rms(y_attn, valid),
                 "moe_out_rms": layer_stats.masked_rms(y.total() if isinstance(y, MoeParts) else y, valid)}
              | layer_stats.mix_record((attn_mix, moe_mix), valid)
              | layer_stats.router_record(stats.pop("router_logits"), stats.pop("expert_ids"), valid,
                                          cfg.n_routed_experts)
              | layer_stats.entries_record(stats.pop("entries_attended"), valid)
              | layer_stats.quant_record("attn", taps[0]) | layer_stats.quant_record("moe", taps[1]))
    return stats | {"diagnostics": record}


@jax.named_scope("embed")
def embed(params: dict, cfg: ModelConfig, tokens: jax.Array, dtype) -> jax.Array:
    """tokens [B, S] -> hc_mult identical copies of the embedding, X [B, S, n, D]."""
    e = params["embed"]["weight"][tokens].astype(dtype)
    return jnp.broadcast_to(e[:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.dim))


def backbone(params: dict, cfg: ModelConfig, ctx: RunContext, chunk: Chunk, caches, defer: bool = False) -> BlockOut:
    """All backbone layers on the chunk. BlockOut: final streams X [B, S, n, D] before the hc head, new caches,
    statistics per layer as `block` returns them, and with `defer` the per-layer DeferredChunks (laid out as the
    caches) that commit_backbone takes. With params["layers"] a layer_scan.StackedLayers (and the caches stacked
    the same way) the repeated pattern runs under lax.scan."""
    X = embed(params, cfg, chunk.tokens, ctx.jnp_dtype)
    layers = params["layers"]
    run = lambda layer, streams, layer_params, cache: block_streams(  # noqa: E731
        layer_params, cfg, ctx, layer, streams, chunk, cache, defer)
    if not isinstance(layers, StackedLayers):
        streams, caches, stats, deferred = _unrolled_layers(run, 0, layers, caches, (X, None))
        return BlockOut(resolve_streams(cfg, len(layers) - 1, streams), caches, stats, deferred if defer else None)
    return _scanned_backbone(run, cfg, layers, caches, X, defer)


def commit_backbone(params: dict, cfg: ModelConfig, ctx: RunContext, caches, deferred, start: jax.Array,
                    n_read: jax.Array, n_commit: jax.Array):
    """Caches of a backbone(..., defer=True) call (its caches and deferred), committed for the first n_commit[b]
    tokens of the chunk."""
    layers = params["layers"]
    commit = lambda layer, layer_params, cache, d: commit_block(layer_params, cfg, ctx, layer, cache,  # noqa: E731
                                                                d, start, n_read, n_commit)
    if not isinstance(layers, StackedLayers):
        return [commit(layer, p, c, d) for layer, (p, c, d) in enumerate(zip(layers, caches, deferred, strict=True))]
    plan = layers.plan
    before = [commit(layer, p, c, d)
              for layer, (p, c, d) in enumerate(zip(layers.before, caches.before, deferred.before, strict=True))]
    after = [commit(plan.stop + i, p, c, d)
             for i, (p, c, d) in enumerate(zip(layers.after, caches.after, deferred.after, strict=True))]

    # As in _scanned_backbone: each iteration commits its layers' caches in place; the deferred data of the
    # iteration's layers comes in as the scan's input
    def body(stacked, xs):
        repeat, phase_params, phase_deferred = xs
        out = []
        for phase in range(plan.period):
            cache = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, repeat, keepdims=False), stacked[phase])
            committed = commit(plan.layer(0, phase), phase_params[phase], cache, phase_deferred[phase])
            out.append(_write_back(stacked[phase], committed, repeat))
        return out, None

    phases, _ = lax.scan(body, list(caches.phases), (jnp.arange(plan.repeats, dtype=jnp.int32), list(layers.phases),
                                                     list(deferred.phases)))
    return caches.replace(before=before, phases=phases, after=after)


def _write_back(stacked, cache, repeat):
    """stacked[...][repeat] = cache, leaf by leaf, in place."""
    return jax.tree.map(lambda a, c: lax.dynamic_update_index_in_dim(a, c.astype(a.dtype), repeat, 0), stacked, cache)


def _unrolled_layers(run, first: int, layers_params: list, caches: list, streams):
    """Layers first, first + 1, ... one after another, on block_streams' (X, post_mix). Returns ((X, post_mix), their
    new caches, their statistics, their deferred chunks)."""
    new_caches, stats, deferred = [], [], []
    for offset, (layer_params, cache) in enumerate(zip(layers_params, caches, strict=True)):
        streams, cache, layer_stats, layer_deferred = run(first + offset, streams, layer_params, cache)
        new_caches.append(cache)
        stats.append(layer_stats)
        deferred.append(layer_deferred)
    return streams, new_caches, stats, deferred


def _scanned_backbone(run, cfg: ModelConfig, layers: StackedLayers, caches: StackedLayers, X, defer: bool):
    plan = layers.plan
    streams, before, before_stats, before_deferred = _unrolled_layers(run, 0, layers.before, caches.before, (X, None))
    X = resolve_streams(cfg, plan.start - 1, streams)

    # The stacked caches ride in the carry and each iteration writes its layers' caches back at its index, so a
    # donated state is updated in place (as scan outputs they would be a second copy of every scanned cache).
    # A deferred (speculative verify) call's commit data leaves the loop as a stacked output instead.
    def body(carry, xs):
        X, stacked_caches = carry
        repeat, phase_params = xs
        new_stacked, stats, deferred = [], [], []
        streams = (X, None)
        for phase in range(plan.period):
            cache = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, repeat, keepdims=False),
                                 stacked_caches[phase])
            streams, cache, layer_stats, layer_deferred = run(plan.layer(0, phase), streams, phase_params[phase],
                                                              cache)
            new_stacked.append(_write_back(stacked_caches[phase], cache, repeat))
            stats.append(layer_stats)
            deferred.append(layer_deferred)
        return (resolve_streams(cfg, plan.layer(0, plan.period - 1), streams), new_stacked), (stats, deferred)

    (X, phases), (phase_stats, phase_deferred) = lax.scan(
        body, (X, list(caches.phases)), (jnp.arange(plan.repeats, dtype=jnp.int32), list(layers.phases)))
    scanned_stats = [jax.tree.map(lambda a, j=j: a[j], phase_stats[p])
                     for j in range(plan.repeats) for p in range(plan.period)]

    streams, after, after_stats, after_deferred = _unrolled_layers(run, plan.stop, layers.after, caches.after,
                                                                   (X, None))
    X = resolve_streams(cfg, cfg.n_layers - 1, streams)
    new_caches = caches.replace(before=before, phases=phases, after=after)
    deferred = (caches.replace(before=before_deferred, phases=list(phase_deferred), after=after_deferred)
                if defer else None)
    return BlockOut(X, new_caches, before_stats + scanned_stats + after_stats, deferred)


def head_logits(params: dict, head_params: dict, cfg: ModelConfig, X: jax.Array, ctx: RunContext) -> jax.Array:
    """hc head collapse -> final RMSNorm -> float32 logits. `head_params` holds hc_head_* and norm (the main
    model's or the MTP block's); the output matrix is always the shared `head`, its input never quantized."""
    h = hc_head(X, head_params["hc_head_fn"], head_params["hc_head_base"], head_params["hc_head_scale"], cfg)
    h = rms_norm(h, head_params["norm"]["weight"], cfg.norm_eps)
    return head_linear(h, params["head"]["weight"], ctx=ctx)


def mtp_streams(params: dict, cfg: ModelConfig, ctx: RunContext, X_main: jax.Array, chunk: Chunk,
                cache: LayerCache, k: int = 0):
    """MTP block k (docs/model.md 4.8) up to its residual streams: at position i it reads the main streams of i and
    the embedding of token i+1 (the chunk's tokens). Returns (streams [B, S, n, D], cache, statistics as
    `block`'s)."""
    p = params["mtp"][k]
    dtype = ctx.jnp_dtype
    e = rms_norm(params["embed"]["weight"][chunk.tokens].astype(dtype), p["enorm"]["weight"], cfg.norm_eps)
    h = rms_norm(X_main.astype(dtype), p["hnorm"]["weight"], cfg.norm_eps)
    X = linear(h, p["h_proj"]["weight"], ctx=ctx) + linear(e, p["e_proj"]["weight"], ctx=ctx)[:, :, None, :]
    X, cache, stats, _ = block(p, cfg, ctx, cfg.n_layers + k, X, chunk, cache)
    return X, cache, stats


def mtp_block(params: dict, cfg: ModelConfig, ctx: RunContext, X_main: jax.Array, chunk: Chunk,
              cache: LayerCache, k: int = 0):
    """MTP block k with its head: logits [B, S, V] float32 predicting token i+2 at position i, the cache and the
    block's statistics."""
    X, cache, stats = mtp_streams(params, cfg, ctx, X_main, chunk, cache, k)
    return head_logits(params, params["mtp"][k], cfg, X, ctx), cache, stats
