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

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ..numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, trained_rounding
from ..pallas_kernels import compressor as decode_kernel
from . import choice
from .matmul import linear
from .norm_rope import apply_rope, rms_norm


@flax.struct.dataclass
class TokenRows:
    """Projected tokens and their gate logits (+ ape), float32 [B, T, coff*head_dim] each: a chunk's (T its tokens,
    compressor_project) or the pending state's (T = coff*c slots of the current and, for ratio 4, previous
    window)."""
    kv: jax.Array
    score: jax.Array


def overlap_factor(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def init_compressor_state(batch: int, ratio: int, head_dim: int):
    """Pending projected tokens (kv = 0) and their gate logits (-inf): [B, coff*c, coff*head_dim] float32 each."""
    coff = overlap_factor(ratio)
    shape = (batch, coff * ratio, coff * head_dim)
    return TokenRows(jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))


def _place_rows(buffer: jax.Array, rows: jax.Array, offset: jax.Array) -> jax.Array:
    """Per batch row b: buffer[b, offset[b]:offset[b]+S] = rows[b]."""
    return jax.vmap(lambda buf, r, o: jax.lax.dynamic_update_slice_in_dim(buf, r, o, axis=0))(buffer, rows, offset)


def _take_rows(buffer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda buf, o: jax.lax.dynamic_slice_in_dim(buf, o, size, axis=0))(buffer, offset)


@jax.named_scope("compressor")
def compressor_update(params: dict, x: jax.Array, start: jax.Array, n_valid: jax.Array, state: TokenRows,
                      cache: jax.Array, *, ratio: int, head_dim: int, nope_dim: int, inv_freq: np.ndarray,
                      rotate: bool, ctx, norm_eps: float):
    """Feed a chunk x [B, S, D] (tokens at positions start[b] + i, the first n_valid[b] real) to a compressor.

    Returns (cache [B, N, head_dim] with every entry completed in this chunk written, new state); `cache` is
    stored as numerics/kv_cache.py lays it out (the activation dtype or compact).
    `rotate` selects the indexer flavour of the fake quant (Hadamard + FP4) instead of FP8 on the nope dims, which
    runs when the run context `ctx` simulates the model's quantization.
    """
    if _takes_decode_kernel(ctx, x.shape[1], ratio, head_dim, inv_freq):
        return _decode_update(params, x, start, n_valid, state, cache, ratio=ratio, head_dim=head_dim,
                              nope_dim=nope_dim, inv_freq=inv_freq, rotate=rotate, ctx=ctx, norm_eps=norm_eps)
    projected = compressor_project(params, x, start, ratio=ratio, ctx=ctx)
    return compressor_pool(params, projected, start, n_valid, state, cache, ratio=ratio, head_dim=head_dim,
                           nope_dim=nope_dim, inv_freq=inv_freq, rotate=rotate, ctx=ctx, norm_eps=norm_eps,
                           out_dtype=x.dtype)


def compressor_project(params: dict, x: jax.Array, start: jax.Array, *, ratio: int, ctx) -> TokenRows:
    """The chunk's projected tokens and gate logits (+ ape): {"kv", "score"} float32 [B, S, coff*head_dim] each,
    what the pending state holds per token."""
    seq = x.shape[1]
    positions = start[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
    x32 = x.astype(jnp.float32)
    kv = linear(x32, params["wkv"]["weight"], ctx=ctx)                           # [B, S, coff*hd] fp32
    ape = params["ape"].astype(jnp.float32)                                      # [c, coff*hd]
    score = linear(x32, params["wgate"]["weight"], ctx=ctx) + ape[positions % ratio]
    return TokenRows(kv, score)


def _entry_grid(start: jax.Array, seq: int, ratio: int):
    """The window-aligned grid of a chunk of `seq` tokens at `start`: (base position [B], slots, index [B, W] of
    the entry each poolable window of the grid would complete)."""
    c, coff = ratio, overlap_factor(ratio)
    base = (start // c) * c - (coff - 1) * c
    n_slots = -(-(coff * c + seq) // c) * c
    window_idx = jnp.arange(coff - 1, n_slots // c, dtype=jnp.int32)      # ratio 4: the first window only lends A
    return base, n_slots, base[:, None] // c + window_idx[None, :]


def completed_entries(start: jax.Array, n_valid: jax.Array, seq: int, ratio: int):
    """(index [B, W], completed [B, W]): the entries a chunk of `seq` tokens at `start` with n_valid[b] real ones
    completes (the ones compressor_pool writes)."""
    _, _, entry_idx = _entry_grid(start, seq, ratio)
    return entry_idx, (entry_idx + 1) * ratio <= (start + n_valid)[:, None]


def compressor_pool(params: dict, projected: TokenRows, start: jax.Array, n_valid: jax.Array, state: TokenRows,
                    cache, *, ratio: int, head_dim: int, nope_dim: int, inv_freq: np.ndarray, rotate: bool, ctx,
                    norm_eps: float, out_dtype):
    """Pool the projected chunk (compressor_project) after the pending tokens of `state`: every window whose last
    real token arrived becomes an entry, scattered into `cache` at its index. Returns (cache, new state)."""
    kv, score = projected.kv, projected.score
    batch, seq, _ = kv.shape
    c, coff = ratio, overlap_factor(ratio)
    width = coff * head_dim

    # Lay pending tokens and the chunk out on one window-aligned grid starting at position `base`.
    base, n_slots, entry_idx = _entry_grid(start, seq, c)
    grid_kv = jnp.zeros((batch, n_slots, width), jnp.float32).at[:, :coff * c].set(state.kv)
    grid_score = jnp.full((batch, n_slots, width), -jnp.inf, jnp.float32).at[:, :coff * c].set(state.score)
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
    else:
        pool_kv, pool_score = win_kv, win_score
    complete = (entry_idx + 1) * c <= (start + n_valid)[:, None]

    safe_score = jnp.where(complete[..., None, None], pool_score, 0.0)        # keep padding windows NaN-free
    weights = jax.nn.softmax(safe_score, axis=2)
    entries = jnp.sum(weights * pool_kv, axis=2).astype(out_dtype)                # [B, W, hd]

    entries = rms_norm(entries, params["norm"]["weight"], norm_eps)
    entries = apply_rope(entries, entry_idx * c, inv_freq)
    cache = _store_entries(entries, entry_idx, complete, cache, nope_dim=nope_dim, rotate=rotate, ctx=ctx)

    # Keep pending slots of positions not consumed yet empty, so padding tokens never linger in the state.
    consumed = (slot_pos < (start + n_valid)[:, None])[..., None]
    grid_kv = jnp.where(consumed, grid_kv, 0.0)
    grid_score = jnp.where(consumed, grid_score, -jnp.inf)
    new_base = ((start + n_valid) // c) * c - (coff - 1) * c
    new_state = TokenRows(_take_rows(grid_kv, new_base - base, coff * c),
                          _take_rows(grid_score, new_base - base, coff * c))
    return cache, new_state


def _store_entries(entries: jax.Array, entry_idx: jax.Array, complete: jax.Array, cache, *, nope_dim: int,
                   rotate: bool, ctx):
    """Write the completed ones of pooled, normalised and rotated entries [B, W, hd] (indices entry_idx [B, W]) into
    the cache, fake-quantized as trained when the run context simulates the model's quantization."""
    if ctx.simulate_quant:
        if rotate:
            entries = trained_rounding(fp4_fake_quant, hadamard(entries), ctx)
        else:
            nope = trained_rounding(fp8_fake_quant, entries[..., :nope_dim], ctx)
            entries = jnp.concatenate([nope, entries[..., nope_dim:]], -1)
    target = jnp.where(complete, entry_idx, cache.n_entries)                      # out of range -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(entries.shape[0])[:, None], target.shape)
    return cache.scatter(batch_idx, target, entries)


DECODE_KERNEL = choice.Kernel("compressor_step", "compressor")


def _takes_decode_kernel(ctx, seq: int, ratio: int, head_dim: int, inv_freq: np.ndarray) -> bool:
    """Whether a chunk runs on pallas_kernels/compressor.py (ops/choice.py): a decode or verify step feeding one
    token per sequence, a geometry the kernel takes."""
    return choice.takes_kernel(DECODE_KERNEL, ctx,
                               seq == 1 and decode_kernel.supported(ratio, head_dim, 2 * inv_freq.shape[0]))


def _decode_update(params: dict, x: jax.Array, start: jax.Array, n_valid: jax.Array, state: TokenRows, cache, *,
                   ratio: int, head_dim: int, nope_dim: int, inv_freq: np.ndarray, rotate: bool, ctx,
                   norm_eps: float):
    """compressor_update for one token per sequence on the decode kernel: the projections, then the pooling, the
    state's update, norm, RoPE, fake quant and cache write in two launches (for a compact cache, or a fake quant the
    kernel does not take, the last two stay with XLA)."""
    x32 = x.astype(jnp.float32)
    kv = linear(x32, params["wkv"]["weight"], ctx=ctx)[:, 0]                     # [B, coff*hd] fp32
    score = linear(x32, params["wgate"]["weight"], ctx=ctx)[:, 0]
    pool = functools.partial(decode_kernel.decode_pool, state.kv, state.score, kv, score, params["ape"], start,
                             n_valid, params["norm"]["weight"], inv_freq, ratio=ratio, norm_eps=norm_eps,
                             out_dtype=x.dtype, interpret=ctx.kernels.interpret)
    quant = None if not ctx.simulate_quant else "fp4" if rotate else "fp8"
    in_kernel = quant is None or decode_kernel.supported(ratio, head_dim, 2 * inv_freq.shape[0], quant)
    buffer = cache.plain(x.dtype)
    if in_kernel and buffer is not None and cache.n_entries:
        # the fake quant and the cache write in the same launch (the cache updated in place)
        buffer, state_kv, state_score = pool(cache=buffer, quant=quant)
        return cache.replace(values=buffer), TokenRows(state_kv, state_score)
    entry, state_kv, state_score = pool()
    entry_idx = (start // ratio)[:, None]
    complete = (entry_idx + 1) * ratio <= (start + n_valid)[:, None]
    cache = _store_entries(entry[:, None], entry_idx, complete, cache, nope_dim=nope_dim, rotate=rotate, ctx=ctx)
    return cache, TokenRows(state_kv, state_score)


# ---- deferred commit (speculative verification, docs/model.md 5) --------------------------------------------------
# A verify chunk must read the entries its own tokens complete before it knows how many of them are accepted. It
# pools with every token (compressor_read), remembering the stored values it overwrote; once the accepted count
# is known, compressor_commit pools again with only the accepted tokens (the pending state) and puts the
# remembered values back wherever only rejected tokens had completed an entry, so the state is exactly the one
# that feeding the accepted tokens alone produces.

@flax.struct.dataclass
class DeferredTokens:
    """What compressor_read leaves for compressor_commit: the chunk's projected tokens and the stored entries its
    completed windows overwrote (None where the buffer holds no entry)."""
    projected: TokenRows
    overwritten: object


def compressor_read(params: dict, x: jax.Array, start: jax.Array, n_read: jax.Array, state: TokenRows, cache, **kw):
    """As compressor_update for reading only: returns (cache with the chunk's completed entries written, pending
    commit data DeferredTokens); the pending state is left to compressor_commit."""
    projected = compressor_project(params, x, start, ratio=kw["ratio"], ctx=kw["ctx"])
    entry_idx, _ = completed_entries(start, n_read, x.shape[1], kw["ratio"])
    n_entries = cache.n_entries                        # 0 when max_seq_len < ratio: nothing is ever written
    overwritten = cache.gather_rows(jnp.minimum(entry_idx, n_entries - 1)) if n_entries else None
    read_cache, _ = compressor_pool(params, projected, start, n_read, state, cache, out_dtype=x.dtype, **kw)
    return read_cache, DeferredTokens(projected, overwritten)


def compressor_commit(params: dict, pending: DeferredTokens, start: jax.Array, n_read: jax.Array,
                      n_commit: jax.Array, state: TokenRows, read_cache, *, out_dtype, **kw):
    """Commit the first n_commit[b] <= n_read[b] tokens of a chunk read by compressor_read: (cache, new state)."""
    projected = pending.projected
    seq = projected.kv.shape[1]
    cache, new_state = compressor_pool(params, projected, start, n_commit, state, read_cache, out_dtype=out_dtype,
                                       **kw)
    if pending.overwritten is None:
        return cache, new_state
    entry_idx, read_done = completed_entries(start, n_read, seq, kw["ratio"])
    _, commit_done = completed_entries(start, n_commit, seq, kw["ratio"])
    target = jnp.where(read_done & ~commit_done, entry_idx, cache.n_entries)               # -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(target.shape[0])[:, None], target.shape)
    return cache.put_rows(batch_idx, target, pending.overwritten), new_state
