"""Decode attention of one layer in one or two launches (Pallas, GPU): the window, the compressed entries and the
sink in one online softmax, reading only the keys a token can attend to.

    out = decode_attention(q, ring, chunk_kv, start, sink, scale=..., compressed=..., picks=..., ratio=4)
    out, keys = decode_attention(q_raw, ring, kv_a, ..., rope=(inv_freq, eps), kv_prologue=(kv_norm_weight, True))

What the pure-jnp path of layers/attention.py does in ~12 XLA kernels per layer on the GPU (the window and compressed
logits, three maxima, the sink, two sums, the value products and, for CSA, a gather of the picked entries into a
[B, S, k, head_dim] copy). Here programs per (token, 16 query heads, split) walk their keys 64 at a time (a
prefill chunk: per token and PREFILL_BLOCK_HEADS heads, no splits):
  - the window ring (the 128 positions before the chunk; slot = position mod 128), masked by position;
  - the chunk's own keys up to the token (decode: itself; a speculative verify: the earlier drafts too; a prefill
    chunk: those within the window, in the 1-3 blocks of 64 that hold them; from its `window`-th token on, no
    ring block);
  - CSA (ratio 4): the indexer's picks, each row read from the compressed cache by its index (-1: no pick), so only
    the picked entries are read;
  - HCA (other ratios): the compressed entries the token can see (j < (t + 1) // ratio); the loop stops there, so
    a step reads the entries in use, not the whole buffer.
Key block b belongs to split b mod n_splits (up to MAX_SPLITS at small batches, so that a token's few programs do
not each walk a long chain of blocks); a second launch merges the splits' running states.

The single shared key is also the value (K = V). The softmax is the online one (running maximum, rescaled sums),
started from the sink logit: the sink is in the denominator only, as in the model. Each block's probabilities are
rounded to the activation dtype before their product with the values, as the jnp path rounds them; they are
computed against the running maximum instead of the final one, so results agree with the jnp path to that
rounding, not bit for bit (float32: to float32 rounding).

With `rope=(inv_freq, eps)` the kernel also takes the query as wq_b leaves it (any dtype): rounded to the activation
dtype, per-head RMS norm, RoPE at the token's position, and the output's inverse RoPE. With `kv_prologue` it also
makes the chunk's keys from wkv's output (RMS norm with the weight, RoPE per row, the FP8 fake quant) and returns
them for the window ring. With `rope` and `query_ready` it takes the query normalised and rotated (norm_rope's
query kernel, as the model passes it) and does only the inverse RoPE. Rotations pair each rope column with its
partner through a dot with the swap permutation (Triton has no pair shuffle). The ring and the compressed entries
are read as numerics/kv_cache.py stores them: in the activation dtype, or compact (e4m3 nope dims decoded with
their E8M0 block scale as they load).

Triton needs power-of-two tensor shapes: heads a multiple of 16, head_dim a power of two, the window a multiple of
BLOCK_KEYS, the rope dims a power-of-two block after nope dims in blocks of 64 (`supported`); the picks are padded to
a multiple of BLOCK_KEYS with -1. GPU kernel plans take it only when switched on (ops/attention_core.py: the
override ("attention_core", "kernel")).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .rounding import fp8_fake_quant
from .tiles import is_pow2, scalar

_F32 = jnp.float32
_EMPTY = -1e30       # the running maximum of a split that has seen no key yet (finite: exp(_EMPTY - m) is 0)
BLOCK_HEADS = 16     # query heads per program: a tensor-core dot needs at least 16 rows
# The schedule: the fastest for both layer kinds in benchmarks/bench_decode_attention.py's sweeps on an H200
# (2026-12-04, batch 1, Flash geometry; docs/bench/h200_2026-12-04c_bench_decode_attention_splits16.json): 16 heads
# and 64 keys per step on 8 warps, a token's keys split over 16 programs per head block: 22.9 us for a CSA layer and
# 21.7 us for an HCA layer (4 splits: 37.0 / 27.5; XLA's path 20.1 / 19.1). More splits used to be slower because the
# merge ran one program per (token, head block) over every split's [16, 512] state (ncu: 91 us at 16 splits); it now
# runs per 64 columns too. Without its query prologue and inverse RoPE (a bf16 query already normalised and rotated)
# the kernel took 18.8 / 14.1 us at 4 splits: that work, repeated by every program, is most of what it loses to XLA.
BLOCK_KEYS = 64      # keys per step of the online softmax
COLUMNS = 64         # key columns per dot: the compact layout's scale block (kv_cache.KV_BLOCK)
MAX_SPLITS = 16      # programs a token's keys may be spread over per head block (fewer as rows grow)
NUM_WARPS, NUM_STAGES = 8, 2   # Triton's schedule of both launches
# A prefill chunk's schedule (more than MAX_ROWS tokens per sequence): heads per program (a divisor of the model's
# heads; more heads share each key block a program loads) and warps. Measured on an H100 (2026-12-07, Flash geometry,
# one 8,192-token chunk, benchmarks/bench_decode_attention.py --prefill 8192 --warps 8,16,
# docs/bench/h100_2026-12-07_prefill_attention_8192.json): 32 heads on 8 warps the fastest of 16/32/64 x 8/16 for
# every layer kind: CSA 7.53 ms (XLA's path 8.62), window only 3.87 (2.71), HCA 4.73 (4.07). 16 warps: 1.6-2.1x slower.
PREFILL_BLOCK_HEADS, PREFILL_NUM_WARPS = 32, 8
MAX_ROWS = 16        # tokens per sequence of a decode or verify step: the chunk's keys in one block; a longer
                     # (prefill) chunk walks the 64-key blocks of its window, one program per token and head block


def supported(n_heads: int, head_dim: int, window: int, rope_dim: int | None = None) -> bool:
    """Whether the kernel takes this geometry (`rope_dim`: when the rope dims are a block of their own, in the
    compact layout or with RoPE done here)."""
    compact_ok = rope_dim is None or (is_pow2(rope_dim) and (head_dim - rope_dim) % COLUMNS == 0)
    return (n_heads % BLOCK_HEADS == 0 and is_pow2(head_dim) and head_dim >= COLUMNS and window % BLOCK_KEYS == 0
            and compact_ok)


def takes(seq: int, n_heads: int, head_dim: int, window: int, rope_dim: int | None = None) -> bool:
    """Whether the model runs a decode or verify step of `seq` tokens per sequence on this kernel (a prefill
    chunk of any length: `supported`)."""
    return seq <= MAX_ROWS and supported(n_heads, head_dim, window, rope_dim)


def _column_blocks(head_dim: int, rope_dim: int | None) -> list[tuple[int, int]]:
    """(first column, width) of each dot: blocks of 64; with `rope_dim` (the compact layout, or RoPE done here) the
    rope dims are the last block."""
    nope = head_dim if rope_dim is None else head_dim - rope_dim
    blocks = [(c, COLUMNS) for c in range(0, nope, COLUMNS)]
    return blocks if rope_dim is None else blocks + [(nope, rope_dim)]


def _load_keys(refs, rows, blocks, dtype):
    """Rows `rows` (an index vector, or a pl.ds) of a cache as one array per column block, in `dtype`: a plain
    cache as stored; a compact one {nope e4m3, E8M0 scale per 64, rope} decoded as numerics/kv_cache.Fp8KvEntries
    decodes it."""
    if len(refs) == 1:
        return [refs[0][rows, pl.ds(first, width)] for first, width in blocks]
    nope_ref, scale_ref, rope_ref = refs
    out = []
    for j, (first, width) in enumerate(blocks[:-1]):
        byte = scale_ref[rows, j].astype(jnp.uint32)
        factor = jnp.where(byte == 255, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(byte << 23, _F32))
        out.append((nope_ref[rows, pl.ds(first, width)].astype(_F32) * factor[:, None]).astype(dtype))
    return out + [rope_ref[rows, :]]


def _rotate(x, positions, inv_freq_cols, inverse: bool):
    """ops/norm_rope.apply_rope on a float32 block x [rows, R] of rope dims at `positions` (a scalar or [rows]):
    pairs (2i, 2i + 1) turned by position * f_i; inv_freq_cols [R] holds f_i for both columns of pair i. Triton has
    no pair shuffle: each row's pair partners come from a dot with the swap permutation (exact in float32)."""
    width = x.shape[1]
    row = jax.lax.iota(jnp.int32, width)[:, None]
    col = jax.lax.iota(jnp.int32, width)[None, :]
    even = col % 2 == 0
    swap = jnp.where(row == jnp.where(even, col + 1, col - 1), 1.0, 0.0).astype(_F32)
    partner = jnp.dot(x, swap, preferred_element_type=_F32, precision=jax.lax.Precision.HIGHEST)
    angle = jnp.reshape(positions, (-1, 1)).astype(_F32) * inv_freq_cols[None, :]     # as apply_rope forms it
    sin = jnp.sin(angle)
    if inverse:
        sin = -sin
    # column 2i: x[2i] cos - x[2i+1] sin; column 2i+1: x[2i+1] cos + x[2i] sin
    return x * jnp.cos(angle) + partner * jnp.where(even, -sin, sin)


def _kernel(*refs, seq: int, window: int, ratio: int, n_entries: int, n_picks: int, scale: float, precision,
            blocks, ring_parts: int, comp_parts: int, dtype, norm_eps: float | None, kv_fake_quant: bool | None,
            n_splits: int, query_ready: bool):
    fused_rope = norm_eps is not None
    kv_prologue = kv_fake_quant is not None
    start_ref, sink_ref = refs[:2]
    freq_ref, refs = (refs[2], refs[3:]) if fused_rope else (None, refs[2:])
    kv_weight_ref, refs = (refs[0], refs[1:]) if kv_prologue else (None, refs)
    q_ref, refs = refs[0], refs[1:]
    ring_refs, chunk_ref, refs = refs[:ring_parts], refs[ring_parts], refs[ring_parts + 1:]
    comp_refs, refs = (refs[:comp_parts], refs[comp_parts:]) if ratio > 0 else ((), refs)
    picks_ref, refs = (refs[0], refs[1:]) if ratio == 4 else (None, refs)
    out_refs, kv_out_ref = (refs[:-1], refs[-1]) if kv_prologue else (refs, None)
    row = pl.program_id(0)
    split = pl.program_id(2)
    s = row % seq
    start = scalar(start_ref, row // seq)
    t = start + s                                                # this token's position
    q = [q_ref[:, pl.ds(first, width)].astype(dtype) for first, width in blocks]   # [Hb, width] each
    # ops/norm_rope.rms_norm (no weight) per head, then apply_rope on the last block
    if fused_rope and not query_ready:
        q32 = [b.astype(_F32) for b in q]
        mean_sq = sum(jnp.sum(b * b, axis=1) for b in q32) / sum(width for _, width in blocks)
        r = jax.lax.rsqrt(mean_sq + norm_eps)[:, None]
        q = [(b * r).astype(dtype) for b in q32]
        q[-1] = _rotate(q[-1].astype(_F32), t, freq_ref[...], inverse=False).astype(dtype)

    def attend(carry, keys, valid):
        """One block of keys (column blocks [Kb, width]; valid [Kb]) into the running (max, denominator, output
        blocks) of every head."""
        m, l, acc = carry
        logits = sum(jnp.dot(qb, kb.T, preferred_element_type=_F32, precision=precision) for qb, kb in zip(q, keys))
        logits = jnp.where(valid[None, :], logits * scale, -jnp.inf)                      # [Hb, Kb]
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l = l * correction + jnp.sum(p, axis=1)
        p = p.astype(dtype)
        acc = tuple(a * correction[:, None] + jnp.dot(p, kb, preferred_element_type=_F32, precision=precision)
                    for a, kb in zip(acc, keys))
        return m_new, l, acc

    # The keys come in blocks of BLOCK_KEYS: the ring's, then the chunk's, then the compressed entries'; block b
    # belongs to split b mod n_splits. Split 0 starts from the sink (exp(sink - max) in the denominator, nothing in the
    # output), the others from nothing (a finite floor, so that a split without keys stays NaN-free).
    sink = sink_ref[...]
    first_split = split == 0
    f = first_split.astype(_F32)                   # arithmetic, not a select: Triton wants vector predicates
    carry = (sink * f + _EMPTY * (1.0 - f), jnp.zeros_like(sink) + f,
             tuple(jnp.zeros((qb.shape[0], qb.shape[1]), _F32) for qb in q))
    slot_in_block = jax.lax.iota(jnp.int32, BLOCK_KEYS)
    n_ring = window // BLOCK_KEYS

    def own_blocks(first_block: int, n_blocks):
        """(first, count) of this split's blocks among n_blocks blocks whose first has index first_block."""
        first = jax.lax.rem(split - first_block % n_splits + n_splits, n_splits)
        return first, jnp.maximum((n_blocks - first + n_splits - 1) // n_splits, 0)

    # The window ring: slot i holds the latest position p < start with p = i (mod window), if any.
    def ring_block(i, carry):
        j = ring_first + i * n_splits
        slot = j * BLOCK_KEYS + slot_in_block
        key_pos = start - 1 - jax.lax.rem(start - 1 - slot + window, window)
        keys = _load_keys(ring_refs, pl.ds(j * BLOCK_KEYS, BLOCK_KEYS), blocks, dtype)
        return attend(carry, keys, (key_pos >= 0) & (t - key_pos < window))
    ring_first, ring_count = own_blocks(0, n_ring)
    if seq > MAX_ROWS:         # from a prefill chunk's `window`-th token on, every ring key is too old
        ring_count = jnp.where(s < window, ring_count, 0)
    carry = jax.lax.fori_loop(0, ring_count, ring_block, carry)

    if seq > MAX_ROWS:         # a prefill chunk: the chunk's keys within the window, a block of them at a time
        def chunk_block(b, carry):
            i = b * BLOCK_KEYS + slot_in_block
            keys = _load_keys((chunk_ref,), jnp.minimum(i, seq - 1), blocks, dtype)   # rows past it clamped
            return attend(carry, keys, (i <= s) & (s - i < window))
        carry = jax.lax.fori_loop(jnp.maximum(s - window + 1, 0) // BLOCK_KEYS, s // BLOCK_KEYS + 1, chunk_block,
                                  carry)
    else:
        # The chunk's own keys up to this token (rows past the chunk are clamped and masked).
        chunk_keys = max(16, 1 << (seq - 1).bit_length())
        i = jax.lax.iota(jnp.int32, chunk_keys)
        chunk_rows = jnp.minimum(i, seq - 1)
        keys = _load_keys((chunk_ref,), chunk_rows, blocks, dtype)
        if kv_prologue:     # wkv's output -> rms_norm(kv_norm) -> RoPE at each row's position -> FP8 fake quant
            kv32 = [k.astype(_F32) for k in keys]
            r = jax.lax.rsqrt(sum(jnp.sum(k * k, axis=1) for k in kv32) / sum(w for _, w in blocks) + norm_eps)
            keys = [(k * r[:, None] * kv_weight_ref[pl.ds(first, width)].astype(_F32)[None, :]).astype(dtype)
                    for k, (first, width) in zip(kv32, blocks)]
            keys[-1] = _rotate(keys[-1].astype(_F32), start + chunk_rows, freq_ref[...], inverse=False).astype(dtype)
            if kv_fake_quant:
                keys[:-1] = [fp8_fake_quant(k.astype(_F32)).astype(dtype) for k in keys[:-1]]

            @pl.when((s == 0) & (pl.program_id(1) == 0) & first_split)     # one program per sequence writes them
            def _():
                for k, (first, width) in zip(keys, blocks):
                    kv_out_ref[chunk_rows, pl.ds(first, width)] = k
        carry = attend(carry, keys, (i <= s) & (i * 0 + split == n_ring % n_splits))

    if ratio == 4:
        def pick_block(i, carry):
            j = pick_first + i * n_splits
            picks = picks_ref[pl.ds(j * BLOCK_KEYS, BLOCK_KEYS)]
            valid = (picks >= 0) & (picks < n_visible)
            return attend(carry, _load_keys(comp_refs, jnp.maximum(picks, 0), blocks, dtype), valid)
        n_visible = (t + 1) // ratio
        pick_first, pick_count = own_blocks(n_ring + 1, n_picks // BLOCK_KEYS)
        carry = jax.lax.fori_loop(0, pick_count, pick_block, carry)
    elif ratio > 0:
        n_visible = jnp.minimum((t + 1) // ratio, n_entries)

        def entry_block(i, carry):
            entry = (entry_first + i * n_splits) * BLOCK_KEYS + slot_in_block
            keys = _load_keys(comp_refs, jnp.minimum(entry, n_entries - 1), blocks, dtype)
            return attend(carry, keys, entry < n_visible)
        entry_first, entry_count = own_blocks(n_ring + 1, (n_visible + BLOCK_KEYS - 1) // BLOCK_KEYS)
        carry = jax.lax.fori_loop(0, entry_count, entry_block, carry)

    m, l, acc = carry
    if n_splits > 1:                 # this split's running state; _merge_kernel combines the splits
        m_ref, l_ref, acc_ref = out_refs
        m_ref[...] = m
        l_ref[...] = l
        for (first, width), a in zip(blocks, acc):
            acc_ref[:, pl.ds(first, width)] = a
        return
    _finish(out_refs[0], [a / l[:, None] for a in acc], blocks, dtype, t, freq_ref if fused_rope else None)


def _finish(out_ref, out, blocks, dtype, position, freq_ref):
    """Write the output blocks (float32 [Hb, width]) in `dtype`, the rope block turned back (inverse RoPE) when
    RoPE is done here (freq_ref)."""
    out = [o.astype(dtype) for o in out]
    if freq_ref is not None:
        out[-1] = _rotate(out[-1].astype(_F32), position, freq_ref[...], inverse=True).astype(dtype)
    for (first, width), o in zip(blocks, out):
        out_ref[:, pl.ds(first, width)] = o


def _merge_kernel(*refs, seq: int, width: int, nope: int, dtype, fused_rope: bool):
    """Combine the splits' running states of one (token, head block, block of `width` columns):
    out = sum_j w_j acc_j / sum_j w_j l_j with w_j = exp(m_j - max_j m_j); with `fused_rope` the columns past
    `nope` (whole blocks: width divides nope and the rope dims) are turned back (inverse RoPE)."""
    start_ref, refs = refs[0], refs[1:]
    freq_ref, refs = (refs[0], refs[1:]) if fused_rope else (None, refs)
    m_ref, l_ref, acc_ref, out_ref = refs
    row = pl.program_id(0)
    t = scalar(start_ref, row // seq) + row % seq
    # one split at a time ([Hb] and [Hb, width] tiles)
    splits = range(m_ref.shape[0])
    m = [m_ref[j, :] for j in splits]                                 # [Hb] each
    peak = m[0]
    for m_j in m[1:]:
        peak = jnp.maximum(peak, m_j)
    w = [jnp.exp(m_j - peak) for m_j in m]
    denom = w[0] * l_ref[0, :]
    acc = w[0][:, None] * acc_ref[0, :, :]
    for j in splits[1:]:
        denom = denom + w[j] * l_ref[j, :]
        acc = acc + w[j][:, None] * acc_ref[j, :, :]
    out = (acc / denom[:, None]).astype(dtype)
    if fused_rope:          # computed for every block, kept where the block holds rope dims
        first = pl.program_id(2) * width
        freq = freq_ref[pl.ds(jnp.maximum(first - nope, 0), width)]
        turned = _rotate(out.astype(_F32), t, freq, inverse=True).astype(dtype)
        in_rope = jax.lax.iota(jnp.int32, width) * 0 + first >= nope        # a vector predicate (Triton)
        out = jnp.where(in_rope[None, :], turned, out)
    out_ref[...] = out


def _parts(cache) -> list:
    """A cache's arrays in the kernel's order: [plain] or [nope, scale, rope] (numerics/kv_cache.py's compact
    layout, as Fp8KvEntries.kernel_operand hands it)."""
    return [cache["nope"], cache["scale"], cache["rope"]] if isinstance(cache, dict) else [cache]


def decode_attention(q: jax.Array, ring, chunk_kv: jax.Array, start: jax.Array, sink: jax.Array, *,
                     scale: float, compressed=None, picks: jax.Array | None = None, ratio: int = 0, rope=None,
                     kv_prologue=None, query_ready: bool = False, interpret: bool = False):
    """Attention output [B, S, H, D] in the activation dtype (chunk_kv's) for queries q [B, S, H, D] at positions
    start[b] + i: without `rope`, q normalised and rotated and the output before the inverse RoPE; with
    rope=(inv_freq [rope_dim / 2], eps), q as wq_b leaves it (any dtype) and the output after the inverse RoPE;
    with rope and `query_ready`, q normalised and rotated in the keys' dtype (norm_rope's query kernel) and the
    output after the inverse RoPE. A query made here is made again by every program of its token (one per split
    and head block); a ready one is made once per token (the model passes it so).

    ring [B, window, D]: the window ring before this chunk; chunk_kv [B, S, D]: the chunk's keys; sink [H];
    compressed [B, N, D]: the compressed entries (ratio > 0); picks [B, S, k] int32: the indexer's picks of a CSA
    layer (ratio 4); a pick the token cannot see (j >= (t + 1) // 4: top-k's fill where fewer entries are
    visible than k) or -1 is skipped. The ring and the compressed entries as numerics/kv_cache.py
    stores them: in the activation dtype, or both compact ({nope e4m3, scale, rope}).

    kv_prologue=(kv_norm weight [D], fake_quant): chunk_kv is wkv's output and the kernel makes the chunk's keys as
    the model does (RMS norm with the weight, RoPE, with fake_quant the FP8 rounding of the nope dims; needs
    `rope`); returns (output, the keys [B, S, D]) for the window ring's write."""
    batch, seq, n_heads, head_dim = q.shape
    dtype = chunk_kv.dtype
    if kv_prologue is not None and seq > MAX_ROWS:
        raise ValueError(f"decode_attention: kv_prologue takes up to {MAX_ROWS} tokens per sequence, got {seq}")
    prefill = seq > MAX_ROWS
    block_heads = PREFILL_BLOCK_HEADS if prefill and n_heads % PREFILL_BLOCK_HEADS == 0 else BLOCK_HEADS
    compact = isinstance(ring, dict)
    rope_dim = ring["rope"].shape[-1] if compact else None
    if kv_prologue is not None and rope is None:
        raise ValueError("decode_attention: kv_prologue needs rope")
    if query_ready and rope is None:
        raise ValueError("decode_attention: query_ready needs rope (the output's inverse RoPE)")
    if rope is not None:
        inv_freq, norm_eps = rope
        if compact and 2 * len(inv_freq) != rope_dim:
            raise ValueError(f"decode_attention: {len(inv_freq)} RoPE frequencies for {rope_dim} rope dims")
        rope_dim = 2 * len(inv_freq)
    window = jax.tree.leaves(ring)[0].shape[1]
    if not supported(n_heads, head_dim, window, rope_dim):
        raise ValueError(f"decode_attention takes heads a multiple of {BLOCK_HEADS}, a power-of-two head_dim >= "
                         f"{COLUMNS}, a window that is a multiple of {BLOCK_KEYS} (and, compact or with `rope`, a "
                         f"power-of-two rope block after nope dims in blocks of {COLUMNS}); got heads {n_heads}, "
                         f"head_dim {head_dim}, window {window}, rope dims {rope_dim}")
    if ratio > 0 and isinstance(compressed, dict) != compact:
        raise ValueError("decode_attention takes the ring and the compressed entries in one layout")
    plain = [a for a in (ring, compressed) if a is not None and not isinstance(a, dict)]
    if compact:
        plain.append(ring["rope"])
    if rope is None or query_ready:
        plain.append(q)
    if any(a.dtype != dtype for a in plain):
        raise ValueError(f"decode_attention takes caches (and a query without `rope` or with `query_ready`) in the "
                         f"keys' dtype {dtype}, "
                         f"got {[str(a.dtype) for a in plain]}")
    rows = batch * seq
    n_entries = jax.tree.leaves(compressed)[0].shape[1] if ratio > 0 else 0
    # spread a token's keys over more programs where the batch is small (a prefill chunk's tokens: one program each)
    n_splits = 1 if prefill else max(1, MAX_SPLITS // rows)
    per_token = lambda r, h, j: (r, h, 0)            # noqa: E731
    per_sequence = lambda r, h, j: (r // seq, 0, 0)  # noqa: E731
    whole = lambda a: pl.BlockSpec((None, *a.shape[1:]), per_sequence)   # noqa: E731  one sequence's rows
    ring_parts = _parts(ring)
    start_spec = pl.BlockSpec((batch,), lambda r, h, j: (0,))
    in_specs = [start_spec, pl.BlockSpec((block_heads,), lambda r, h, j: (h,))]
    args = [start.astype(jnp.int32), sink.astype(_F32)]
    freq = None
    if rope is not None:                          # each pair's frequency for both of its columns
        freq = np.repeat(np.asarray(inv_freq, np.float32), 2)   # numpy: a constant of the program, no launch
        in_specs.append(pl.BlockSpec((rope_dim,), lambda r, h, j: (0,)))
        args.append(freq)
    if n_splits > 1:                              # each split's running max, denominator and output
        out_specs = [pl.BlockSpec((None, None, block_heads), lambda r, h, j: (r, j, h))] * 2 + [
            pl.BlockSpec((None, None, block_heads, head_dim), lambda r, h, j: (r, j, h, 0))]
        out_shape = [jax.ShapeDtypeStruct((rows, n_splits, n_heads), _F32)] * 2 + [
            jax.ShapeDtypeStruct((rows, n_splits, n_heads, head_dim), _F32)]
    else:
        out_specs = [pl.BlockSpec((None, block_heads, head_dim), per_token)]
        out_shape = [jax.ShapeDtypeStruct((rows, n_heads, head_dim), dtype)]
    if kv_prologue is not None:
        kv_weight, kv_fake_quant = kv_prologue
        in_specs.append(pl.BlockSpec((head_dim,), lambda r, h, j: (0,)))
        args.append(kv_weight)
        out_specs.append(whole(chunk_kv))
        out_shape.append(jax.ShapeDtypeStruct(chunk_kv.shape, dtype))
    in_specs += ([pl.BlockSpec((None, block_heads, head_dim), per_token)]
                 + [whole(a) for a in ring_parts] + [whole(chunk_kv)])
    args += [q.reshape(rows, n_heads, head_dim), *ring_parts, chunk_kv]
    comp_parts = _parts(compressed) if ratio > 0 else []
    in_specs += [whole(a) for a in comp_parts]
    args += comp_parts
    n_picks = 0
    if ratio == 4:
        picks = picks.reshape(rows, picks.shape[-1]).astype(jnp.int32)
        picks = jnp.pad(picks, ((0, 0), (0, -picks.shape[1] % BLOCK_KEYS)), constant_values=-1)
        n_picks = picks.shape[1]
        in_specs.append(pl.BlockSpec((None, n_picks), lambda r, h, j: (r, 0)))
        args.append(picks)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    blocks = _column_blocks(head_dim, rope_dim)
    kernel = functools.partial(_kernel, seq=seq, window=window, ratio=ratio, n_entries=n_entries, n_picks=n_picks,
                               scale=scale, precision=precision, blocks=blocks, ring_parts=len(ring_parts),
                               comp_parts=len(comp_parts), dtype=dtype, norm_eps=None if rope is None else norm_eps,
                               kv_fake_quant=None if kv_prologue is None else bool(kv_fake_quant),
                               n_splits=n_splits, query_ready=query_ready)
    params = pltriton.CompilerParams(num_warps=PREFILL_NUM_WARPS if prefill else NUM_WARPS,
                                     num_stages=NUM_STAGES)
    outs = pl.pallas_call(
        kernel, grid=(rows, n_heads // block_heads, n_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, name="decode_attention", compiler_params=params)(*args)
    kv = outs[-1] if kv_prologue is not None else None
    if n_splits > 1:     # programs per (token, head block, block of columns): the splits' states are read once
        width = COLUMNS if rope is None else min(COLUMNS, rope_dim)
        merge = functools.partial(_merge_kernel, seq=seq, width=width, nope=head_dim - (rope_dim or 0), dtype=dtype,
                                  fused_rope=rope is not None)
        part_spec = pl.BlockSpec((None, n_splits, block_heads), lambda r, h, c: (r, 0, h))
        merge_specs = ([pl.BlockSpec((batch,), lambda r, h, c: (0,))]
                       + ([pl.BlockSpec((rope_dim,), lambda r, h, c: (0,))] if rope is not None else [])
                       + [part_spec, part_spec,
                          pl.BlockSpec((None, n_splits, block_heads, width), lambda r, h, c: (r, 0, h, c))])
        out = pl.pallas_call(
            merge, grid=(rows, n_heads // block_heads, head_dim // width), in_specs=merge_specs,
            out_specs=pl.BlockSpec((None, block_heads, width), lambda r, h, c: (r, h, c)),
            out_shape=jax.ShapeDtypeStruct((rows, n_heads, head_dim), dtype), interpret=interpret,
            name="decode_attention_merge", compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
                start.astype(jnp.int32), *([freq] if rope is not None else []), *outs[:3])
    else:
        out = outs[0]
    out = out.reshape(batch, seq, n_heads, head_dim)
    return out if kv_prologue is None else (out, kv)
