"""Decode state: fixed-shape buffers sized by (max_batch, max_seq_len) (docs/model.md 5.1).

Per layer: the window ring [B, 128, head_dim] (slot = position mod 128); for compressed layers the compressed
KV cache [B, max_seq_len // c, head_dim] and the compressor's pending tokens; for ratio-4 layers also the
indexer key cache [B, max_seq_len // 4, index_head_dim] and the indexer compressor's pending tokens. The MTP
block has its own window ring plus the main streams of the last position (its input for the next draft).
`positions[b]` is the number of tokens sequence b has consumed. Buffers are updated
with scatters / dynamic slices at traced positions and the state is donated, so XLA updates it in place.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layer_scan import StackedLayers, scan_plan
from .layers.attention import LayerCache
from .numerics import kv_cache
from .ops.compressor_step import init_compressor_state


@flax.struct.dataclass
class DecodeState:
    layers: list            # one LayerCache per backbone layer (a layer_scan.StackedLayers for a scanned model)
    mtp: list               # one LayerCache per MTP layer (its window runs one position behind, see engine)
    mtp_hidden: jax.Array   # [B, hc_mult, D]: main streams of each sequence's last consumed position
    positions: jax.Array    # [B] int32: tokens consumed so far per sequence

    @property
    def max_batch(self) -> int:
        return self.positions.shape[0]


def init_layer_cache(cfg: ModelConfig, ratio: int, batch: int, max_seq_len: int, dtype,
                     kv_cache_dtype=None) -> LayerCache:
    """`kv_cache_dtype`: None (entries in `dtype`) or "fp8" (compact entries, numerics/kv_cache.py)."""
    def entries(n: int, head_dim: int, kind: str):
        return kv_cache.empty((batch, n), head_dim, cfg.rope_head_dim, dtype, kind, kv_cache_dtype)
    cache = LayerCache(entries(cfg.window_size, cfg.head_dim, "kv"))
    if ratio > 0:
        cache = cache.replace(compressed_kv=entries(max_seq_len // ratio, cfg.head_dim, "kv"),
                              compressor=init_compressor_state(batch, ratio, cfg.head_dim))
    if ratio == 4:
        cache = cache.replace(index_keys=entries(max_seq_len // ratio, cfg.index_head_dim, "index"),
                              indexer_compressor=init_compressor_state(batch, ratio, cfg.index_head_dim))
    return cache


def init_state(cfg: ModelConfig, batch: int, max_seq_len: int, dtype=jnp.bfloat16,
               scan_layers: bool = False, kv_cache_dtype=None) -> DecodeState:
    """A fresh state (every sequence at position 0, compressor logits -inf). With `scan_layers`, the caches of
    the repeated layer pattern are stacked (layer_scan.StackedLayers), as a scanned model's steps take them.
    `kv_cache_dtype` "fp8": window, compressed and indexer entries stored compact (numerics/kv_cache.py)."""
    if batch < 1 or max_seq_len < 1:
        raise ValueError(f"max_batch and max_seq_len must be >= 1, got {batch} and {max_seq_len}")

    def cache(layer: int) -> LayerCache:
        return init_layer_cache(cfg, cfg.compress_ratios[layer], batch, max_seq_len, dtype, kv_cache_dtype)
    plan = scan_plan(cfg) if scan_layers else None
    if plan is None:
        layers = [cache(i) for i in range(cfg.n_layers)]
    else:
        stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (plan.repeats, *a.shape)), tree)  # noqa: E731
        layers = StackedLayers(before=[cache(i) for i in range(plan.start)],
                               phases=[stack(cache(plan.layer(0, p))) for p in range(plan.period)],
                               after=[cache(i) for i in range(plan.stop, cfg.n_layers)], plan=plan)
    mtp = [cache(cfg.n_layers + k) for k in range(cfg.n_mtp_layers)]
    return DecodeState(layers=layers, mtp=mtp, mtp_hidden=jnp.zeros((batch, cfg.hc_mult, cfg.dim), dtype),
                       positions=jnp.zeros((batch,), jnp.int32))


def state_bytes(cfg: ModelConfig, batch: int, max_seq_len: int, dtype="bfloat16", kv_cache_dtype=None) -> int:
    """Bytes of the decode state for (batch, max_seq_len), computed with jax.eval_shape (nothing allocated)."""
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype] if isinstance(dtype, str) else dtype
    shapes = jax.eval_shape(lambda: init_state(cfg, batch, max_seq_len, jdtype, kv_cache_dtype=kv_cache_dtype))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def _row_axes(state: DecodeState) -> DecodeState:
    """The batch axis of every buffer of `state` (a scanned model's stacked layers hold it on axis 1)."""
    layers = state.layers
    if isinstance(layers, StackedLayers):
        layers = layers.replace(before=jax.tree.map(lambda _: 0, layers.before),
                                phases=jax.tree.map(lambda _: 1, layers.phases),
                                after=jax.tree.map(lambda _: 0, layers.after))
    else:
        layers = jax.tree.map(lambda _: 0, layers)
    return state.replace(layers=layers, mtp=jax.tree.map(lambda _: 0, state.mtp), mtp_hidden=0, positions=0)


def copy_row(dst: DecodeState, src: DecodeState, src_row: jax.Array, dst_row: jax.Array) -> DecodeState:
    """`dst` with its row `dst_row` replaced by row `src_row` of `src` (every buffer: caches, rings, compressor
    pending tokens, MTP window and streams, position): a device-side copy (`dynamic_slice` /
    `dynamic_update_slice`), exact, for states of one layout and any batch sizes."""
    def copy(d, s, axis):
        row = jax.lax.dynamic_slice_in_dim(s, src_row, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(d, row.astype(d.dtype), dst_row, axis)
    return jax.tree.map(copy, dst, src, _row_axes(dst))
