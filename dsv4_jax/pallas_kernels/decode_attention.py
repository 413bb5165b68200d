"""Decode attention of one layer in one launch (Pallas, GPU): the window, the compressed entries and the sink in one
online softmax, reading only the keys a token can attend to.

    out = decode_attention(q, ring, chunk_kv, start, sink, scale=..., compressed=..., picks=..., ratio=4)

What the pure-jnp path of layers/attention.py does in ~12 XLA kernels per layer on the GPU (the window and compressed
logits, three maxima, the sink, two sums, the value products and, for CSA, a gather of the picked entries into a
[B, S, k, head_dim] copy). Here one program per (token, 16 query heads) walks its keys 32 at a time:
  - the window ring (the 128 positions before the chunk; slot = position mod 128), masked by position;
  - the chunk's own keys up to the token (decode: itself; a speculative verify: the earlier drafts too);
  - CSA (ratio 4): the indexer's picks, each row read from the compressed cache by its index (-1: no pick), so only
    the picked entries are read;
  - HCA (other ratios): the compressed entries the token can see (j < (t + 1) // ratio); the loop stops there, so
    a step reads the entries in use, not the whole buffer.
With `rope=(inv_freq, eps)` the kernel also takes the query as wq_b leaves it (any dtype) and does what the jnp
path does around attention in two more XLA kernels per layer: the query rounded to the activation dtype, its
per-head RMS norm and RoPE at the token's position, and the inverse RoPE of the output (each rotation a dot with the
64 x 64 rotation matrix of the position, in float32). The single shared key is also the value (K = V). The softmax is the online one (running maximum, rescaled sums),
started from the sink logit: the sink is in the denominator only, as in the model. Each block's probabilities are
rounded to the activation dtype before their product with the values, as the jnp path rounds them; they are
computed against the running maximum instead of the final one, so results agree with the jnp path to that
rounding, not bit for bit (float32: to float32 rounding).

Takes the activation-dtype cache layout (kv_cache.py); the compact FP8 layout keeps the jnp path. Triton needs
power-of-two tensor shapes: head_dim a power of two, heads a multiple of 16, the window a multiple of 32 (`supported`; the picks are padded to a multiple of 32 with -1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32
BLOCK_HEADS = 16     # query heads per program: a tensor-core dot needs at least 16 rows
BLOCK_KEYS = 32      # keys per step of the online softmax
COLUMNS = 64         # key columns per dot: the compact layout's scale block (kv_cache.KV_BLOCK)
MAX_ROWS = 16        # tokens per sequence the model sends here (decode, speculative verify); prefill chunks keep
                     # the jnp path, whose matmuls share each key across the chunk's tokens


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(n_heads: int, head_dim: int, window: int, rope_dim: int | None = None) -> bool:
    """Whether the kernel takes this geometry (`rope_dim`: when the rope dims are a block of their own, in the
    compact layout or with RoPE done here)."""
    compact_ok = rope_dim is None or (_pow2(rope_dim) and (head_dim - rope_dim) % COLUMNS == 0)
    return (n_heads % BLOCK_HEADS == 0 and _pow2(head_dim) and head_dim >= COLUMNS and window % BLOCK_KEYS == 0
            and compact_ok)


def takes(seq: int, n_heads: int, head_dim: int, window: int, rope_dim: int | None = None) -> bool:
    """Whether the model runs a call of `seq` tokens per sequence on this kernel."""
    return seq <= MAX_ROWS and supported(n_heads, head_dim, window, rope_dim)


def _column_blocks(head_dim: int, rope_dim: int | None) -> list[tuple[int, int]]:
    """(first column, width) of each dot: blocks of 64; with `rope_dim` (the compact layout, or RoPE done here) the
    rope dims are the last block."""
    nope = head_dim if rope_dim is None else head_dim - rope_dim
    blocks = [(c, COLUMNS) for c in range(0, nope, COLUMNS)]
    return blocks if rope_dim is None else blocks + [(nope, rope_dim)]


def _load_keys(refs, rows, blocks, dtype):
    """Rows `rows` (an index vector, or a pl.ds) of a cache as one array per column block, in `dtype`: a plain
    cache as stored; a compact one {nope e4m3, E8M0 scale per 64, rope} decoded as kv_cache.decode does."""
    if len(refs) == 1:
        return [refs[0][rows, pl.ds(first, width)] for first, width in blocks]
    nope_ref, scale_ref, rope_ref = refs
    out = []
    for j, (first, width) in enumerate(blocks[:-1]):
        byte = scale_ref[rows, j].astype(jnp.uint32)
        factor = jnp.where(byte == 255, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(byte << 23, _F32))
        out.append((nope_ref[rows, pl.ds(first, width)].astype(_F32) * factor[:, None]).astype(dtype))
    return out + [rope_ref[rows, :]]


def _rotate(x, position, inv_freq_cols, inverse: bool):
    """layers/rope.apply_rope on a float32 block x [rows, R] of rope dims at one position: pairs (2i, 2i + 1) turned
    by position * f_i, as x @ M with M the block-diagonal rotation matrix (Triton has no pair shuffle); inv_freq_cols
    [R] holds f_i for both columns of pair i."""
    width = x.shape[1]
    row = jax.lax.iota(jnp.int32, width)[:, None]
    col = jax.lax.iota(jnp.int32, width)[None, :]
    angle = position.astype(_F32) * inv_freq_cols                  # [R], as apply_rope forms it
    cos, sin = jnp.cos(angle)[None, :], jnp.sin(angle)[None, :]
    if inverse:
        sin = -sin
    even = col % 2 == 0
    # column 2i: x[2i] cos - x[2i+1] sin; column 2i+1: x[2i] sin + x[2i+1] cos
    rotation = jnp.where(row == col, cos, jnp.where(even & (row == col + 1), -sin,
                                                    jnp.where(~even & (row == col - 1), sin, 0.0)))
    return jnp.dot(x, rotation, preferred_element_type=_F32, precision=jax.lax.Precision.HIGHEST)


def _kernel(*refs, seq: int, window: int, ratio: int, n_entries: int, n_picks: int, scale: float, precision,
            blocks, ring_parts: int, comp_parts: int, dtype, q_norm_eps: float | None):
    fused_rope = q_norm_eps is not None
    start_ref, sink_ref = refs[:2]
    freq_ref, refs = (refs[2], refs[3:]) if fused_rope else (None, refs[2:])
    q_ref, refs = refs[0], refs[1:]
    ring_refs, chunk_ref, refs = refs[:ring_parts], refs[ring_parts], refs[ring_parts + 1:]
    comp_refs, refs = (refs[:comp_parts], refs[comp_parts:]) if ratio > 0 else ((), refs)
    picks_ref, out_ref = refs if ratio == 4 else (None, refs[0])
    row = pl.program_id(0)
    s = row % seq
    start = jnp.sum(start_ref[pl.ds(row // seq, 1)])
    t = start + s                                                # this token's position
    q = [q_ref[:, pl.ds(first, width)].astype(dtype) for first, width in blocks]   # [Hb, width] each
    if fused_rope:              # layers/norm.rms_norm (no weight) per head, then apply_rope on the last block
        q32 = [b.astype(_F32) for b in q]
        mean_sq = sum(jnp.sum(b * b, axis=1) for b in q32) / sum(width for _, width in blocks)
        r = jax.lax.rsqrt(mean_sq + q_norm_eps)[:, None]
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

    sink = sink_ref[...]
    # the sink: exp(sink - max) in the denominator, nothing in the output
    carry = (sink, jnp.ones_like(sink), tuple(jnp.zeros((qb.shape[0], qb.shape[1]), _F32) for qb in q))
    slot_in_block = jax.lax.iota(jnp.int32, BLOCK_KEYS)

    # The window ring: slot i holds the latest position p < start with p = i (mod window), if any.
    def ring_block(j, carry):
        slot = j * BLOCK_KEYS + slot_in_block
        key_pos = start - 1 - jax.lax.rem(start - 1 - slot + window, window)
        keys = _load_keys(ring_refs, pl.ds(j * BLOCK_KEYS, BLOCK_KEYS), blocks, dtype)
        return attend(carry, keys, (key_pos >= 0) & (t - key_pos < window))
    carry = jax.lax.fori_loop(0, window // BLOCK_KEYS, ring_block, carry)

    # The chunk's own keys up to this token (rows past the chunk are clamped and masked).
    chunk_keys = max(16, 1 << (seq - 1).bit_length())
    i = jax.lax.iota(jnp.int32, chunk_keys)
    carry = attend(carry, _load_keys((chunk_ref,), jnp.minimum(i, seq - 1), blocks, dtype), i <= s)

    if ratio == 4:
        def pick_block(j, carry):
            picks = picks_ref[pl.ds(j * BLOCK_KEYS, BLOCK_KEYS)]
            return attend(carry, _load_keys(comp_refs, jnp.maximum(picks, 0), blocks, dtype), picks >= 0)
        carry = jax.lax.fori_loop(0, n_picks // BLOCK_KEYS, pick_block, carry)
    elif ratio > 0:
        n_visible = jnp.minimum((t + 1) // ratio, n_entries)

        def entry_block(j, carry):
            entry = j * BLOCK_KEYS + slot_in_block
            keys = _load_keys(comp_refs, jnp.minimum(entry, n_entries - 1), blocks, dtype)
            return attend(carry, keys, entry < n_visible)
        carry = jax.lax.fori_loop(0, (n_visible + BLOCK_KEYS - 1) // BLOCK_KEYS, entry_block, carry)

    _, l, acc = carry
    out = [(a / l[:, None]).astype(dtype) for a in acc]
    if fused_rope:
        out[-1] = _rotate(out[-1].astype(_F32), t, freq_ref[...], inverse=True).astype(dtype)
    for (first, width), o in zip(blocks, out):
        out_ref[:, pl.ds(first, width)] = o


def _parts(cache) -> list:
    """A cache's arrays in the kernel's order: [plain] or [nope, scale, rope] (kv_cache.py's compact layout)."""
    return [cache["nope"], cache["scale"], cache["rope"]] if isinstance(cache, dict) else [cache]


def decode_attention(q: jax.Array, ring, chunk_kv: jax.Array, start: jax.Array, sink: jax.Array, *,
                     scale: float, compressed=None, picks: jax.Array | None = None, ratio: int = 0, rope=None,
                     interpret: bool = False) -> jax.Array:
    """Attention output [B, S, H, D] in the activation dtype (chunk_kv's) for queries q [B, S, H, D] at positions
    start[b] + i: without `rope`, q normalised and rotated and the output before the inverse RoPE; with
    rope=(inv_freq [rope_dim / 2], eps), q as wq_b leaves it (any dtype) and the output after the inverse RoPE.

    ring [B, window, D]: the window ring before this chunk; chunk_kv [B, S, D]: the chunk's keys; sink [H];
    compressed [B, N, D]: the compressed entries (ratio > 0); picks [B, S, k] int32: the indexer's picks of a CSA
    layer (ratio 4), -1 where a slot holds no visible entry. The ring and the compressed entries as kv_cache.py
    stores them: in the activation dtype, or both compact ({nope e4m3, scale, rope})."""
    batch, seq, n_heads, head_dim = q.shape
    dtype = chunk_kv.dtype
    compact = isinstance(ring, dict)
    rope_dim = ring["rope"].shape[-1] if compact else None
    if rope is not None:
        inv_freq, q_norm_eps = rope
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
    if rope is None:
        plain.append(q)
    if any(a.dtype != dtype for a in plain):
        raise ValueError(f"decode_attention takes caches (and a query without `rope`) in the keys' dtype {dtype}, "
                         f"got {[str(a.dtype) for a in plain]}")
    rows = batch * seq
    n_entries = jax.tree.leaves(compressed)[0].shape[1] if ratio > 0 else 0
    per_token = lambda r, h: (r, h, 0)            # noqa: E731
    per_sequence = lambda r, h: (r // seq, 0, 0)  # noqa: E731
    whole = lambda a: pl.BlockSpec((None, *a.shape[1:]), per_sequence)   # noqa: E731  one sequence's rows
    ring_parts = _parts(ring)
    in_specs = [pl.BlockSpec((batch,), lambda r, h: (0,)), pl.BlockSpec((BLOCK_HEADS,), lambda r, h: (h,))]
    args = [start.astype(jnp.int32), sink.astype(_F32)]
    if rope is not None:                          # each pair's frequency for both of its columns
        in_specs.append(pl.BlockSpec((rope_dim,), lambda r, h: (0,)))
        args.append(jnp.repeat(jnp.asarray(inv_freq, _F32), 2))
    in_specs += ([pl.BlockSpec((None, BLOCK_HEADS, head_dim), per_token)]
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
        in_specs.append(pl.BlockSpec((None, n_picks), lambda r, h: (r, 0)))
        args.append(picks)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, seq=seq, window=window, ratio=ratio, n_entries=n_entries, n_picks=n_picks,
                               scale=scale, precision=precision, blocks=_column_blocks(head_dim, rope_dim),
                               ring_parts=len(ring_parts), comp_parts=len(comp_parts), dtype=dtype,
                               q_norm_eps=None if rope is None else q_norm_eps)
    out = pl.pallas_call(
        kernel, grid=(rows, n_heads // BLOCK_HEADS), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, BLOCK_HEADS, head_dim), per_token),
        out_shape=jax.ShapeDtypeStruct((rows, n_heads, head_dim), dtype), interpret=interpret,
        name="decode_attention", compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2))(*args)
    return out.reshape(batch, seq, n_heads, head_dim)
