"""One compressor's decode update in two launches (Pallas, GPU): a token joins the pending window, the window it
completes is pooled, RMS-normalised, rotated and fake-quantized, written to the cache, and the pending state is
updated in place -- what the jnp path (ops/compressor_step.py `compressor_pool` and its cache write for a one-token
chunk) does in about ten small XLA kernels plus two copies of the state.

    cache, state_kv, state_score = decode_pool(state_kv, state_score, kv, score, ape, start, n_valid, norm_weight,
                                               inv_freq, ratio=4, norm_eps=1e-6, out_dtype=bf16, cache=cache,
                                               quant="fp8")

The state is the jnp path's pending state: [B, coff*c, coff*hd] float32 kv and gate logits, the slots of windows
floor(start/c) - coff + 1 .. floor(start/c) (ratio 4 overlaps: coff = 2, each token's A half pools into the next
entry, its B half into its own). Column chunks are `rope_dim` wide (Triton's power-of-two tiles; the last chunk of
the entry is the rotated one).
  1. `_pool_kernel`, grid (sequences, hd / chunk): the token's kv and gate logits (+ ape of its slot) go into slot
     start mod c of the last window (slots before position 0 carry -inf logits, as the jnp path's grid); the entry
     floor(start/c) -- complete iff (floor(start/c) + 1) c <= start + n_valid -- pools its 2c (A of the previous
     window, B of its own) or c slots with a per-channel softmax, rounded to the output dtype as the jnp path's
     `sum(weights * kv).astype(out_dtype)`; the state's tiles are written back over the old (input / output
     aliasing: in place), shifted by one window when the entry completed, unconsumed slots empty.
  2. `_finish_kernel`, grid (sequences,): RMSNorm of the pooled entry with `norm_weight` (its sum of squares spans
     every chunk: the kernel boundary is the barrier between the chunks' programs), RoPE at position
     floor(start/c) c on the last chunk (norm_rope.rotate_pairs), the fake quant, then the write: the entry row,
     or the cache row of a completed entry.
One program per sequence for everything was 2-3x slower than XLA's kernels on an H200 (one SM walked every tile).
Numerics follow the jnp path operation for operation in float32 (the softmax's sum, the RMS sum and the Hadamard
transform's sums are reduced in another order), so results agree to float32 rounding before each cast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics.fake_quant import hadamard_matrix
from .norm_rope import rotate_pairs
from .rounding import fp8_fake_quant, hadamard_fp4
from .tiles import is_pow2, scalar

_F32 = jnp.float32
MAX_TILE = 8192               # float32 values of one window's column chunk ([c, rope_dim]) a program holds at once


def supported(ratio: int, head_dim: int, rope_dim: int, quant: str | None = None) -> bool:
    """Whether the kernel takes this compressor: power-of-two ratio and rope_dim (Triton tiles), head_dim a
    multiple of rope_dim, one window's chunk small enough for a program's registers; with the fake quant `quant`
    ("fp8" / "fp4"), chunks of 64 (the FP8 block; FP4's 32 divide it) and, for "fp4", a power-of-two head_dim (the
    Hadamard transform)."""
    fits = is_pow2(ratio) and is_pow2(rope_dim) and head_dim % rope_dim == 0 and ratio * rope_dim <= MAX_TILE
    return fits and (quant is None or (rope_dim == 64 and (quant == "fp8" or is_pow2(head_dim))))


def _positions(start_ref, n_valid_ref, ratio: int):
    """(start, end = start + n_valid, the entry index floor(start / c), whether that entry completes)."""
    start = scalar(start_ref)
    end = start + scalar(n_valid_ref)
    entry_idx = start // ratio
    return start, end, entry_idx, (entry_idx + 1) * ratio <= end


def _pool_kernel(start_ref, n_valid_ref, kv_ref, score_ref, ape_ref, tok_kv_ref, tok_score_ref, pooled_ref,
                 kv_out_ref, score_out_ref, *, ratio: int, coff: int, head_dim: int, chunk: int):
    """Program (b, j): the state's columns of entry chunk j -- [j C, (j + 1) C), and with the overlap also
    [hd + j C, ...) -- updated with the token (kv_out_ref / score_out_ref are kv_ref / score_ref's buffers,
    aliased: each tile is read before it is written, and no two programs share one), and the entry's chunk j pooled,
    rounded to pooled_ref's dtype (the output's)."""
    c = ratio
    start, end, entry_idx, complete = _positions(start_ref, n_valid_ref, c)
    base = entry_idx * c - (coff - 1) * c                     # position of state slot 0
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, chunk), 0)
    token_row = rows == start - entry_idx * c                 # the token's slot in the last window
    empty_kv, empty_score = jnp.zeros((c, chunk), _F32), jnp.full((c, chunk), -jnp.inf, _F32)

    def window(w, col):
        """Window w's slots of state columns [col, col + chunk), the token placed in the last window; logits of
        slots before position 0 are -inf. Returns (kv, score) [c, chunk] and the slots' consumed mask."""
        kv = kv_ref[0, pl.ds(w * c, c), pl.ds(col, chunk)]
        score = score_ref[0, pl.ds(w * c, c), pl.ds(col, chunk)]
        if w == coff - 1:
            ape = jnp.sum(jnp.where(token_row, ape_ref[:, pl.ds(col, chunk)].astype(_F32), 0.0), axis=0)
            kv = jnp.where(token_row, tok_kv_ref[0, pl.ds(col, chunk)][None, :], kv)
            score = jnp.where(token_row, (tok_score_ref[0, pl.ds(col, chunk)] + ape)[None, :], score)
        position = base + w * c + rows
        score = jnp.where(position >= 0, score, -jnp.inf)
        return kv, score, position < end

    def update_state(col):
        """Read the state's columns [col, col + chunk) of every window; write them back updated (shifted by a window
        when the entry completed, unconsumed slots empty). Returns the windows' (kv, score) as the pooling reads
        them."""
        windows = [window(w, col) for w in range(coff)]
        kept = [(jnp.where(done, kv, 0.0), jnp.where(done, score, -jnp.inf)) for kv, score, done in windows]
        shifted = kept[1:] + [(empty_kv, empty_score)]            # the entry completed: drop its first window
        for w in range(coff):
            kv_out_ref[0, pl.ds(w * c, c), pl.ds(col, chunk)] = jnp.where(complete, shifted[w][0], kept[w][0])
            score_out_ref[0, pl.ds(w * c, c), pl.ds(col, chunk)] = jnp.where(complete, shifted[w][1], kept[w][1])
        return windows

    col = pl.program_id(1) * chunk
    if coff == 2:               # entry slots: A halves (columns [0, hd)) of window 0, B halves of window 1
        kv_a, score_a, _ = update_state(col)[0]
        kv_b, score_b, _ = update_state(head_dim + col)[1]
        parts = [(kv_a, score_a), (kv_b, score_b)]
    else:
        (kv_b, score_b, _), = update_state(col)
        parts = [(kv_b, score_b)]
    safe = [(kv, jnp.where(complete, score, 0.0)) for kv, score in parts]      # NaN-free when not complete
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=0) for _, s in safe])
    exps = [jnp.exp(s - top[None, :]) for _, s in safe]
    total = functools.reduce(jnp.add, [jnp.sum(e, axis=0) for e in exps])
    value = functools.reduce(jnp.add, [jnp.sum((e / total[None, :]) * kv, axis=0) for e, (kv, _) in zip(exps, safe)])
    pooled_ref[0, pl.ds(col, chunk)] = value.astype(pooled_ref.dtype)


def _finish_kernel(start_ref, n_valid_ref, pooled_ref, weight_ref, freq_ref, *refs, ratio: int, head_dim: int,
                   chunk: int, norm_eps: float, quant: str | None, into_cache: bool):
    """Program b: the pooled entry's RMSNorm, RoPE on its last chunk, the fake quant `quant`; written to entry_ref
    [b], or (into_cache: entry_ref is the cache, aliased) to the cache row of a completed entry."""
    refs = list(refs)
    hadamard_ref = refs.pop(0) if quant == "fp4" else None
    if into_cache:
        refs.pop(0)                                           # the cache as an input: written through entry_ref
    (entry_ref,) = refs
    dtype = pooled_ref.dtype
    _, _, entry_idx, complete = _positions(start_ref, n_valid_ref, ratio)
    pooled = [pooled_ref[0, pl.ds(j * chunk, chunk)].astype(_F32) for j in range(head_dim // chunk)]
    inv_rms = jax.lax.rsqrt(sum(jnp.sum(v * v) for v in pooled) / head_dim + norm_eps)
    entry = []
    for j, value in enumerate(pooled):
        col = j * chunk
        y = (value * inv_rms * weight_ref[pl.ds(col, chunk)].astype(_F32)).astype(dtype).astype(_F32)
        if j == len(pooled) - 1:                # the rope dims: (y_2i, y_2i+1) -> rotated by position * f_i
            angle = (entry_idx * ratio).astype(_F32) * freq_ref[...]       # per column: f of its pair
            y = rotate_pairs(y, angle).astype(dtype).astype(_F32)
        elif quant == "fp8":                    # the nope dims, one 64-value scale block per chunk
            y = fp8_fake_quant(y[None, :])[0].astype(dtype).astype(_F32)
        entry.append(y)
    if quant == "fp4":                          # the normalised Hadamard transform of the whole entry, then FP4
        entry = hadamard_fp4(entry, hadamard_ref, dtype)
    if not into_cache:
        for j, y in enumerate(entry):
            entry_ref[0, pl.ds(j * chunk, chunk)] = y.astype(entry_ref.dtype)
        return

    @pl.when(complete & (entry_idx < entry_ref.shape[1]))          # past the buffer: dropped, as the scatter does
    def _():
        for j, y in enumerate(entry):
            entry_ref[0, pl.ds(entry_idx, 1), pl.ds(j * chunk, chunk)] = y[None, :].astype(entry_ref.dtype)


def decode_pool(state_kv: jax.Array, state_score: jax.Array, kv: jax.Array, score: jax.Array, ape: jax.Array,
                start: jax.Array, n_valid: jax.Array, norm_weight: jax.Array, inv_freq: np.ndarray, *, ratio: int,
                norm_eps: float, out_dtype, cache: jax.Array | None = None, quant: str | None = None,
                interpret: bool = False):
    """One token per sequence into a compressor's pending state.

    state_kv / state_score [B, coff*c, coff*hd] float32 (ops/compressor_step.py `init_compressor_state`), kv / score
    [B, coff*hd] float32 the token's projections (score without ape), ape [c, coff*hd], start / n_valid [B] int32
    (n_valid 0 or 1), norm_weight [hd], inv_freq [rope_dim / 2].

    Returns (entry, new state_kv, new state_score), the state buffers updated in place. Without `cache`: entry
    [B, hd] in out_dtype, the entry floor(start/c) normalised and rotated, meaningful only where it completed. With
    `cache` ([B, N, hd], a plain buffer: numerics/kv_cache.py's uncompact layout): that buffer with each completed entry
    written at its index (none past N), after the model's fake quant `quant` -- "fp8" (the nope dims, main
    compressor) or "fp4" (normalised Hadamard transform, then FP4: the indexer's) -- in place (aliased)."""
    batch, slots, width = state_kv.shape
    coff = slots // ratio                       # the overlap (2 for ratio 4), as the state was laid out for it
    head_dim, rope_dim = width // coff, 2 * inv_freq.shape[0]
    if coff not in (1, 2) or slots != coff * ratio or width != coff * head_dim or not supported(
            ratio, head_dim, rope_dim, quant):
        raise ValueError(f"decode_pool: needs a state of coff * ratio slots (coff 1 or 2) by coff * head_dim, a "
                         f"power-of-two ratio and rope_dim, head_dim a multiple of rope_dim, ratio * rope_dim <= "
                         f"{MAX_TILE} and, for a fake quant, rope_dim 64 (its block); got state {state_kv.shape}, "
                         f"ratio {ratio}, rope_dim {rope_dim}, quant {quant}")
    if quant is not None and cache is None:
        raise ValueError("decode_pool: the fake quant is applied only with the cache the entries go to")
    freq = jnp.asarray(np.repeat(np.asarray(inv_freq, np.float32), 2))             # per column of the rope chunk
    n_chunks = head_dim // rope_dim
    scalar = pl.BlockSpec((1,), lambda b, *_: (b,))
    row = lambda *shape: pl.BlockSpec((1, *shape), lambda b, *_: (b,) + (0,) * len(shape))  # noqa: E731
    whole = lambda *shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    state_spec = row(slots, width)
    positions = (start.astype(jnp.int32), n_valid.astype(jnp.int32))
    warps = 4 if ratio * rope_dim <= 1024 else 8
    pooled, state_kv, state_score = pl.pallas_call(
        functools.partial(_pool_kernel, ratio=ratio, coff=coff, head_dim=head_dim, chunk=rope_dim),
        grid=(batch, n_chunks),
        in_specs=[scalar, scalar, state_spec, state_spec, whole(ratio, width), row(width), row(width)],
        out_specs=[row(head_dim), state_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, head_dim), out_dtype), jax.ShapeDtypeStruct(state_kv.shape, _F32),
                   jax.ShapeDtypeStruct(state_score.shape, _F32)],
        input_output_aliases={2: 1, 3: 2}, interpret=interpret, name="compressor_decode_pool",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
    )(*positions, state_kv, state_score, ape, kv.astype(_F32), score.astype(_F32))

    args = [*positions, pooled, norm_weight, freq]
    in_specs = [scalar, scalar, row(head_dim), whole(head_dim), whole(rope_dim)]
    if quant == "fp4":
        args.append(jnp.asarray(hadamard_matrix(head_dim)))
        in_specs.append(whole(head_dim, head_dim))
    aliases = {}
    if cache is None:
        entry_spec, entry_shape = row(head_dim), jax.ShapeDtypeStruct((batch, head_dim), out_dtype)
    else:
        entry_spec, entry_shape = row(*cache.shape[1:]), jax.ShapeDtypeStruct(cache.shape, cache.dtype)
        aliases[len(args)] = 0
        args.append(cache)
        in_specs.append(entry_spec)
    entry = pl.pallas_call(
        functools.partial(_finish_kernel, ratio=ratio, head_dim=head_dim, chunk=rope_dim, norm_eps=norm_eps,
                          quant=quant, into_cache=cache is not None), grid=(batch,),
        in_specs=in_specs, out_specs=entry_spec, out_shape=entry_shape, input_output_aliases=aliases,
        interpret=interpret, name="compressor_decode_finish",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )(*args)
    return entry, state_kv, state_score
