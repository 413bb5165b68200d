"""The k largest of each row without a sort: the k-th largest value found by a radix search over the float32 bits,
then the entries above it and the first of those equal to it kept in index order.

`jax.lax.top_k` of k = 512 over a prefill chunk's [S, N] indexer scores runs on a GPU as a sort-like sequence of
kernels (7 kernels, 11.6 ms of a profiled 8,192-token chunk's 106 ms on an H100, docs/performance.md). Here the
threshold takes 8 passes over [rows, N], each settling 4 bits of the value (most significant first) with 15 counts
(two multi-output reductions on XLA:GPU), and the picks one prefix sum and one scatter. The picks are lax.top_k's
set, ties at the k-th value going to the lower indices as there; they come in ascending index order instead of
descending score (the indexer's callers gather by them and mask the invalid ones: order does not matter to them
beyond float rounding of sums over picks). Values are ordered as lax.top_k orders them, -0.0 below +0.0. Pure jnp:
the same code on every backend. Taken by GPU plans for a prefill chunk's indexer (ops/indexer.py, where it is timed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def order_keys(values: jax.Array) -> jax.Array:
    """uint32 keys in the total order of the float32 values (-inf lowest, -0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


# Bits of the key settled per counting pass. A pass counts, for each of the 2^bits - 1 nonzero values of its digit, the
# keys at or above the threshold so far with that digit appended: sibling sums over one operand, which XLA:GPU fuses
# into multi-output reductions of up to 8 outputs, each reading the keys once. Compiled for an H200 ([8,192, 2,048]
# float32, k = 512; benchmarks/count_top_k.py, docs/bench/cpu_2026-12-07_count_top_k_8192x2048.json): 1 bit a pass 75
# kernels, 2.65 GB of operands; 2 bits 43, 1.58 GB; 4 bits 35, 1.58 GB; 8 bits 527 (255 counts do not fuse). The
# passes are a Python loop: no while loop, whose predicate XLA:GPU reads back on the host every iteration.
BITS_PER_PASS = 4


def kth_largest_key(keys: jax.Array, k, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """The k-th largest of keys [..., N] (uint32) along the last axis, [...]: the largest t with at least k keys
    >= t, `bits_per_pass` bits at a time from the most significant (1, 2, 4 or 8). k: an int, or int32 [...] (one
    per row), in [1, N]."""
    if bits_per_pass not in (1, 2, 4, 8):
        raise ValueError(f"kth_largest_key: bits_per_pass must be 1, 2, 4 or 8, got {bits_per_pass}")
    threshold = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for shift in range(32 - bits_per_pass, -1, -bits_per_pass):
        # counts of keys >= threshold + d << shift for d = 1 .. 2^bits - 1: falling in d, and at d = 0 at least k
        # (the invariant), so the settled digit is how many of them reach k
        enough = [jnp.sum(keys >= (threshold | jnp.uint32(digit << shift))[..., None], axis=-1, dtype=jnp.int32) >= k
                  for digit in range(1, 1 << bits_per_pass)]
        digit = sum(e.astype(jnp.uint32) for e in enough)
        threshold = threshold | (digit << jnp.uint32(shift))
    return threshold


def threshold_top_k(values: jax.Array, k: int, bits_per_pass: int = BITS_PER_PASS) -> tuple[jax.Array, jax.Array]:
    """(values [..., k], indices [..., k] int32) of the k largest of values [..., N] along the last axis, in ascending
    index order; ties at the k-th value resolved to the lower indices (lax.top_k's set). k <= N. bits_per_pass: as
    kth_largest_key's."""
    n = values.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"threshold_top_k: k must lie in [1, {n}] (the last axis), got {k}")
    keys = order_keys(values)
    threshold = kth_largest_key(keys, k, bits_per_pass)[..., None]
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
