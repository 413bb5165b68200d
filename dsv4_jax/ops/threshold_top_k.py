"""The k largest of each row without a sort: the k-th largest value found by bisection over the float32 bits, then
the entries above it and the first of those equal to it kept in index order.

`jax.lax.top_k` of k = 512 over a prefill chunk's [S, N] indexer scores runs on a GPU as a sort-like sequence of
kernels (7 kernels, 11.6 ms of a profiled 8,192-token chunk's 106 ms on an H100, docs/performance.md). Here the
threshold takes 32 passes of one fused count over [rows, N] each (a bit of the value per pass, most significant
first), and the picks one prefix sum and one scatter. The picks are lax.top_k's set, ties at the k-th value going to
the lower indices as there; they come in ascending index order instead of descending score (the indexer's callers
gather by them and mask the invalid ones: order does not matter to them beyond float rounding of sums over picks).
Values are ordered as lax.top_k orders them, -0.0 below +0.0. Pure jnp: the same code on every backend; not yet
timed on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def order_keys(values: jax.Array) -> jax.Array:
    """uint32 keys in the total order of the float32 values (-inf lowest, -0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def kth_largest_key(keys: jax.Array, k) -> jax.Array:
    """The k-th largest of keys [..., N] (uint32) along the last axis, [...]: the largest t with at least k keys
    >= t, one bit at a time from the most significant. k: an int, or int32 [...] (one per row)."""
    def one_bit(i, threshold):
        candidate = threshold | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        enough = jnp.sum(keys >= candidate[..., None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(enough, candidate, threshold)
    return jax.lax.fori_loop(0, 32, one_bit, jnp.zeros(keys.shape[:-1], jnp.uint32))


def threshold_top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values [..., k], indices [..., k] int32) of the k largest of values [..., N] along the last axis, in ascending
    index order; ties at the k-th value resolved to the lower indices (lax.top_k's set). k <= N."""
    n = values.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"threshold_top_k: k must lie in [1, {n}] (the last axis), got {k}")
    keys = order_keys(values)
    threshold = kth_largest_key(keys, k)[..., None]
    above = keys > threshold
    tied = keys == threshold
    room = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    take = above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= room))
    slot = jnp.where(take, jnp.cumsum(take, axis=-1, dtype=jnp.int32) - 1, k)       # k: the spare column
    rows = values.reshape(-1, n)
    flat_slot = slot.reshape(-1, n)
    row = jnp.arange(rows.shape[0])[:, None]
    entry = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), rows.shape)
    idx = jnp.zeros((rows.shape[0], k + 1), jnp.int32).at[row, flat_slot].set(entry)[:, :k]
    picked = jnp.take_along_axis(rows, idx, axis=-1)
    return picked.reshape(values.shape[:-1] + (k,)), idx.reshape(values.shape[:-1] + (k,))
