"""KV compressor (docs/model.md 4.4) and its incremental state (docs/model.md 5), for any chunk of new tokens.

Entry j pools source positions [j*c, (j+1)*c) with a per-channel softmax over gate logits (+ `ape`). Ratio 4
overlaps: each token projects to two halves, A (pooled into the NEXT entry) and B (its own entry), so entry j
pools 8 slots: A of window j-1 and B of window j (window -1 is empty).

One code path serves forward, (chunked) prefill and decode. The pending state holds the projected tokens of the
current incomplete window (and, for ratio 4, the previous window, whose A halves the next entry needs) at slots
indexed from `base = floor(start/c)*c - (coff-1)*c`, exactly as the reference's `kv_state`/`score_state`. A chunk
is laid out after the pending tokens in one aligned buffer, every window whose last token arrived is pooled, the
finished entries are scattered into the cache at slot j, and the new pending tokens are sliced back out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import kv_cache
from ..quant import linear
from ..quant.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, trained_rounding
from .norm import rms_norm
from .rope import apply_rope


def overlap_factor(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def init_compressor_state(batch: int, ratio: int, head_dim: int):
    """Pending projected tokens (kv = 0) and their gate logits (-inf): [B, coff*c, coff*head_dim] float32 each."""
    coff = overlap_factor(ratio)
    shape = (batch, coff * ratio, coff * head_dim)
    return {"kv": jnp.zeros(shape, jnp.float32), "score": jnp.full(shape, -jnp.inf, jnp.float32)}


def _place_rows(buffer: jax.Array, rows: jax.Array, offset: jax.Array) -> jax.Array:
    """Per batch row b: buffer[b, offset[b]:offset[b]+S] = rows[b]."""
    return jax.vmap(lambda buf, r, o: jax.lax.dynamic_update_slice_in_dim(buf, r, o, axis=0))(buffer, rows, offset)


def _take_rows(buffer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda buf, o: jax.lax.dynamic_slice_in_dim(buf, o, size, axis=0))(buffer, offset)


@jax.named_scope("compressor")
def compressor_update(params: dict, x: jax.Array, start: jax.Array, n_valid: jax.Array, state: dict,
                      cache: jax.Array, *, ratio: int, head_dim: int, nope_dim: int, inv_freq: np.ndarray,
                      rotate: bool, ctx, norm_eps: float):
    """Feed a chunk x [B, S, D] (tokens at positions start[b] + i, the first n_valid[b] real) to a compressor.

    Returns (cache [B, N, head_dim] with every entry completed in this chunk written, new state); `cache` is
    stored as kv_cache.py lays it out (the activation dtype or compact).
    `rotate` selects the indexer flavour of the fake quant (Hadamard + FP4) instead of FP8 on the nope dims, which
    runs when the run context `ctx` simulates the model's quantization.
    """
    batch, seq, _ = x.shape
    c, coff = ratio, overlap_factor(ratio)
    width = coff * head_dim
    positions = start[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]

    x32 = x.astype(jnp.float32)
    kv = linear(x32, params["wkv"]["weight"], ctx=ctx)                           # [B, S, coff*hd] fp32
    ape = params["ape"].astype(jnp.float32)                                      # [c, coff*hd]
    score = linear(x32, params["wgate"]["weight"], ctx=ctx) + ape[positions % c]

    # Lay pending tokens and the chunk out on one window-aligned grid starting at position `base`.
    base = (start // c) * c - (coff - 1) * c
    n_slots = -(-(coff * c + seq) // c) * c
    grid_kv = jnp.zeros((batch, n_slots, width), jnp.float32).at[:, :coff * c].set(state["kv"])
    grid_score = jnp.full((batch, n_slots, width), -jnp.inf, jnp.float32).at[:, :coff * c].set(state["score"])
    grid_kv = _place_rows(grid_kv, kv, start - base)
    grid_score = _place_rows(grid_score, score, start - base)
    slot_pos = base[:, None] + jnp.arange(n_slots, dtype=jnp.int32)[None, :]
    grid_score = jnp.where((slot_pos >= 0)[..., None], grid_score, -jnp.inf)  # before position 0: empty

    n_windows = n_slots // c
    win_kv = grid_kv.reshape(batch, n_windows, c, width)
    win_score = grid_score.reshape(batch, n_windows, c, width)
    if coff == 2:
        # Entry of window w: A halves of window w-1, then B halves of window w.
        pool_kv = jnp.concatenate([win_kv[:, :-1, :, :head_dim], win_kv[:, 1:, :, head_dim:]], axis=2)
        pool_score = jnp.concatenate([win_score[:, :-1, :, :head_dim], win_score[:, 1:, :, head_dim:]], axis=2)
        first_window = 1
    else:
        pool_kv, pool_score, first_window = win_kv, win_score, 0
    window_idx = jnp.arange(first_window, n_windows, dtype=jnp.int32)
    entry_idx = base[:, None] // c + window_idx[None, :]                          # [B, W]
    complete = (entry_idx + 1) * c <= (start + n_valid)[:, None]

    safe_score = jnp.where(complete[..., None, None], pool_score, 0.0)        # keep padding windows NaN-free
    weights = jax.nn.softmax(safe_score, axis=2)
    entries = jnp.sum(weights * pool_kv, axis=2).astype(x.dtype)                # [B, W, hd]

    entries = rms_norm(entries, params["norm"]["weight"], norm_eps)
    entries = apply_rope(entries, entry_idx * c, inv_freq)
    if ctx.simulate_quant:
        if rotate:
            entries = trained_rounding(fp4_fake_quant, hadamard(entries), ctx)
        else:
            nope = trained_rounding(fp8_fake_quant, entries[..., :nope_dim], ctx)
            entries = jnp.concatenate([nope, entries[..., nope_dim:]], -1)

    target = jnp.where(complete, entry_idx, kv_cache.n_entries(cache))            # out of range -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(batch)[:, None], target.shape)
    cache = kv_cache.scatter(cache, batch_idx, target, entries)

    # Keep pending slots of positions not consumed yet empty, so padding tokens never linger in the state.
    consumed = (slot_pos < (start + n_valid)[:, None])[..., None]
    grid_kv = jnp.where(consumed, grid_kv, 0.0)
    grid_score = jnp.where(consumed, grid_score, -jnp.inf)
    new_base = ((start + n_valid) // c) * c - (coff - 1) * c
    new_state = {"kv": _take_rows(grid_kv, new_base - base, coff * c),
                 "score": _take_rows(grid_score, new_base - base, coff * c)}
    return cache, new_state
