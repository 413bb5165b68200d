"""The attention core of one layer (docs/model.md 4.3, 4.5): one softmax with the sink over the window keys (the
ring of the previous 128 positions, then the chunk's own, masked by position) and the compressed entries (CSA: the
indexer's picks; HCA: every visible one), then the inverse RoPE.

Its reference is the jnp below (`_attend`: the general chunk; `_attend_one_token`: one token per sequence, one
matmul, one softmax, one matmul). Its kernel, pallas_kernels/decode_attention.py, takes a decode or verify step's
rows with the query ready from the norm_rope op's kernel; it is opt-in on GPU plans (the plan's override
("attention_core", "kernel")) while XLA's path is faster there, and always taken by the "interpret" plan (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..pallas_kernels import decode_attention
from . import choice
from . import norm_rope
from .norm_rope import apply_rope

# Opt-in on GPUs: one layer's attention at Flash geometry, batch 1, on an H200 (benchmarks/bench_decode_attention.py)
# took 22.9 us (CSA) and 21.7 us (HCA) on the kernel against 20.1 and 19.1 us on XLA's kernels (2026-12-04); on a
# ready query 25.7 / 27.2 us against 20.1 / 16.0, the 4-layer Flash step 1.170 against 1.128 ms (2026-12-05,
# docs/bench/h200_2026-12-05_bench_decode_attention.json, h200_2026-12-05_query_ready_flash4_*.json).
DECODE_KERNEL = choice.Kernel("attention_core", "decode_attention", on_gpu_by_default=False)
# The same kernel for a prefill chunk: a program per (token, PREFILL_BLOCK_HEADS heads) walks the keys it can see
# (the window's 1-3 blocks, the picks or visible entries) instead of XLA's path, which writes the window's float32
# logits and values, a [tokens, k, head_dim] copy of a CSA layer's picked entries and the float32 output before its
# inverse RoPE (about 10 GiB of an 8,192-token chunk's kernel traffic per layer, compiled for an H200; kernels.md).
# Opt-in: on an H100 (2026-12-07, one 8,192-token chunk, Flash geometry) it beats XLA's path only on a CSA layer
# (7.53 against 8.62 ms) and loses on the others (window only 3.87 / 2.71, HCA 4.73 / 4.07): over Flash's 43 layers
# (21 CSA, 20 HCA, 2 window only) ~7 ms of ~1.5 s per chunk, too little to switch it on. Not profiled; a guess: each
# program re-reads the window's key blocks (from L2) for its own token and 32 heads, a batched matmul does not.
PREFILL_KERNEL = choice.Kernel("attention_core", "prefill_attention", phases=frozenset({"prefill"}),
                               on_gpu_by_default=False)


def ring_positions(start: jax.Array, window: int, slots: jax.Array | None = None) -> jax.Array:
    """Position held by each ring slot s before a chunk starting at `start`: the latest p < start with
    p = s (mod window); negative where nothing was written yet. [B, window] (`slots` [1, N]: those slots' instead)"""
    if slots is None:
        slots = jnp.arange(window, dtype=jnp.int32)[None, :]
    last = start[:, None] - 1
    return last - jnp.mod(last - slots, window)


def compressed_visible(positions: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """[B, S, N]: compressed entry j is visible to the query at position t iff j < (t+1)//ratio."""
    return jnp.arange(n_entries)[None, None, :] < ((positions + 1) // ratio)[:, :, None]


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
    keys = jnp.concatenate([ring.decode(dtype), kv], axis=1)                             # [B, W+S, hd]
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
        selected = compressed.gather_rows(idx).decode(dtype)                         # [B, S, k, hd]
        logits.append(jnp.einsum("bshd,bskd->bshk", q, selected, preferred_element_type=jnp.float32) * scale)
        masks.append(valid[:, :, None, :])
        values.append(("selected", selected))
    elif compressed is not None:
        compressed = compressed.decode(dtype)
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
        parts.append(compressed.gather_rows(picks[0]).decode(dtype)[:, 0])                  # [B, k, hd]
    elif compressed is not None:
        parts.append(compressed.decode(dtype))
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


def attend(q: jax.Array, ring, kv: jax.Array, start: jax.Array, positions: jax.Array, sink: jax.Array,
           cfg: ModelConfig, ratio: int, compressed, picks, live: int, inv_freq: np.ndarray, ctx) -> jax.Array:
    """The attention core of a chunk: q [B, S, H, hd] (normalised and rotated), the ring before the chunk (stored
    as numerics/kv_cache.py lays it out) and the chunk's keys kv [B, S, hd], at positions start[b] + i; the
    compressed entries (the whole stored buffer, of which the first `live` can be visible) and, for CSA, the
    indexer's picks (indices, valid) [B, S, k]. Returns [B, S, H, hd] in q's dtype after the inverse RoPE. The
    decode kernel takes q and kv only as the norm_rope op's kernel makes them (normalised, rotated, rounded)."""
    seq = q.shape[1]
    scale = cfg.head_dim ** -0.5
    if ctx.phase == "prefill":          # the query and keys from XLA's fusions: normalised, rotated, rounded too
        on_kernel = choice.takes_kernel(PREFILL_KERNEL, ctx, decode_attention.supported(
            cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.rope_head_dim) and q.dtype == kv.dtype)
    else:
        on_kernel = choice.takes_kernel(DECODE_KERNEL, ctx, norm_rope.takes_kernel(cfg, ctx) and decode_attention.takes(
            seq, cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.rope_head_dim))
    if on_kernel:
        # the window, the compressed entries, the softmax and the inverse RoPE in one launch (two with the splits'
        # merge), reading only the entries attended (the whole compressed buffer is passed: a slice would be a
        # copy; the kernel stops at the visible entries)
        return decode_attention.decode_attention(
            q, ring.kernel_operand(), kv, start, sink, scale=scale,
            compressed=None if compressed is None else compressed.kernel_operand(),
            picks=None if picks is None else picks[0],      # the kernel skips picks the token cannot see
            ratio=ratio if compressed is not None else 0, rope=(inv_freq, cfg.norm_eps), query_ready=True,
            interpret=ctx.kernels.interpret)
    if compressed is not None and ratio != 4:
        compressed = compressed.leading(live)
    out = _attend(q, ring, kv, start, positions, sink, scale, cfg.window_size, ratio, compressed, picks)
    return apply_rope(out, positions[:, :, None], inv_freq, inverse=True)
