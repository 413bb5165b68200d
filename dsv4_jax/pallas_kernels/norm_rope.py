"""RMSNorm of decode rows in one launch (Pallas, GPU), optionally followed by RoPE on the trailing dims and the FP8
fake quant of the others -- what ops/norm_rope.py `rms_norm` (+ ops/norm_rope.py `apply_rope` + the FP8 rounding of
numerics/fake_quant.py) costs XLA two or three kernels for on the GPU: the row's sum of squares is a reduction, and
XLA does not fuse a reduction with the elementwise work that reads its result.

    q_latent = rms_norm_rows(q_a, weight, eps=1e-6, in_dtype=bf16)                       # the query latent
    kv = rms_norm_rows(kv_a, weight, eps=1e-6, in_dtype=bf16, rope=(positions, inv_freq), fp8_nope=True)
    q = rms_norm_rows(q, None, eps=1e-6, in_dtype=bf16, rope=(positions, inv_freq))      # per-head queries
    iq = rms_norm_rows(iq, None, eps=None, in_dtype=bf16, rope=(positions, inv_freq), hadamard_fp4=True)  # indexer

The input may be the float32 a matmul kernel wrote: it is first rounded to `in_dtype` (what the matmul would have
returned in the model's dtype), so the cast costs no launch of its own. A program takes one row, or several
(`default_rows_per_program`: up to 2,048 values, e.g. 4 of the 512-wide per-head queries), in two passes over
power-of-two column chunks (the sums of squares, then the normalised chunks; with `rope` the chunks are rope_dim
wide and the last one is rotated). Numerics follow the jnp path operation for operation in float32: the normalised
row is rounded to the output dtype, then the rope dims are rotated in float32 (read and written as their even and
odd columns, strided, so each value's pair partner is at hand; with the Hadamard rounding, which needs the chunk
whole, the partner comes from a 0/1 permutation, exact) and rounded again, and each 64-value block of the other dims
is rounded to e4m3 under its power-of-two scale; only the order of the sum of squares differs. The indexer's queries
take no norm (eps None): RoPE, then the normalised Hadamard transform of the row (its float32 sums in chunk order)
and FP4 per 32 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics.fake_quant import hadamard_matrix
from .rounding import fp8_fake_quant, hadamard_fp4
from .tiles import is_pow2, pow2_divisor, scalar

_F32 = jnp.float32
FP8_BLOCK = 64               # the fake quant's block (numerics/fake_quant.fp8_fake_quant)
MAX_CHUNK = 1024


def supported(dim: int, rope_dim: int | None = None, fp8_nope: bool = False, hadamard_fp4: bool = False) -> bool:
    """Whether the kernel takes rows of `dim`: chunks of at least 64 columns; with rope, power-of-two rope dims
    that divide dim (the FP8 block with fp8_nope); a power-of-two dim with hadamard_fp4 (at most 1,024: the
    transform's matrix is read in chunk x chunk tiles per row)."""
    if hadamard_fp4 and not (is_pow2(dim) and dim <= MAX_CHUNK):
        return False
    if rope_dim is None:
        return not fp8_nope and pow2_divisor(dim, MAX_CHUNK) >= 64
    return is_pow2(rope_dim) and dim % rope_dim == 0 and (not fp8_nope or rope_dim == FP8_BLOCK)


def rotate_pairs(y, angle):
    """ops/norm_rope.apply_rope inside a kernel, on float32 rope dims y [C] turned by angle [C] (position * f_i, both
    columns of pair i): column 2i y_2i cos - y_2i+1 sin, column 2i+1 y_2i+1 cos + y_2i sin. Triton has no pair
    shuffle: each value's partner comes from a 0/1 permutation summed, exact in float32."""
    width = y.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (width, width), 0)
    other = jax.lax.broadcasted_iota(jnp.int32, (width, width), 1)
    partner = jnp.sum(jnp.where(other == lane + 1 - 2 * (lane % 2), y[None, :], 0.0), axis=1)
    sign = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (width,), 0) % 2 == 0, -1.0, 1.0)
    return y * jnp.cos(angle) + partner * (sign * jnp.sin(angle))


def _rotate_pieces(even, odd, angle):
    """RoPE on a chunk held as its even and odd columns [R, C/2] (float32) at angle [R, C/2] (position * f_i): the
    same products and sums as rotate_pairs, with each value's partner at hand (no permutation)."""
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return even * cos - odd * sin, odd * cos + even * sin


def _kernel(*refs, first: int, dim: int, chunk: int, eps: float | None, in_dtype, has_weight: bool, rope: bool,
            rope_pieces: bool, row_positions: bool, fp8_nope: bool, hadamard: bool, ring_window: int | None):
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    if rope:
        pos_ref, freq_ref = refs.pop(0), refs.pop(0)
    hadamard_ref = refs.pop(0) if hadamard else None
    if ring_window is not None:          # the window ring, written in place: its input ref is aliased to ring_ref
        n_valid_ref, _ = refs.pop(0), refs.pop(0)
        out_ref, ring_ref = refs
    else:
        (out_ref,) = refs
    dtype = out_ref.dtype
    n_chunks = dim // chunk

    def load(start, size, stride=1):            # the program's rows [R, size] of columns start, start + stride, ...
        return x_ref[:, pl.ds(first + start, size, stride=stride)].astype(in_dtype).astype(_F32)

    def weight(start, size, stride=1):
        return w_ref[pl.ds(start, size, stride=stride)].astype(_F32)[None, :]

    scale = None
    if eps is not None:                         # the RMSNorm: each row's sum of squares first
        sum_sq = jnp.zeros((x_ref.shape[0], 1), _F32)
        for j in range(n_chunks):
            x = load(j * chunk, chunk)
            sum_sq = sum_sq + jnp.sum(x * x, axis=1, keepdims=True)
        scale = jax.lax.rsqrt(sum_sq / dim + eps)

    def normalised(start, size, stride=1):
        y = load(start, size, stride)
        if scale is not None:
            y = y * scale
            if w_ref is not None:
                y = y * weight(start, size, stride)
            y = y.astype(dtype).astype(_F32)
        return y

    if rope:                                    # the rows' positions: one per row, or one the program's rows share
        position = (pos_ref[...] if row_positions else scalar(pos_ref)[None]).astype(_F32)[:, None]
    # (first column, column stride, float32 values [R, n]) of the output: stored as made (so a program's rows need
    # not stay in registers), or kept for the Hadamard rounding and the ring write, which take one row a program
    pieces = []
    keep = hadamard or ring_window is not None

    def emit(start, stride, y):
        if keep:
            pieces.append((start, stride, y))
        else:
            out_ref[:, pl.ds(start, y.shape[1], stride=stride)] = y.astype(dtype)

    for j in range(n_chunks):
        start = j * chunk
        if rope and j == n_chunks - 1:          # ops/norm_rope.apply_rope: (y_2i, y_2i+1) turned by position * f_i
            angle = position * freq_ref[...][None, :]
            if rope_pieces:
                half = chunk // 2
                even, odd = _rotate_pieces(normalised(start, half, 2), normalised(start + 1, half, 2), angle)
                emit(start, 2, even.astype(dtype).astype(_F32))
                emit(start + 1, 2, odd.astype(dtype).astype(_F32))
            else:
                y = rotate_pairs(normalised(start, chunk)[0], angle[0])[None, :]
                emit(start, 1, y.astype(dtype).astype(_F32))
            continue
        y = normalised(start, chunk)
        if fp8_nope:
            y = fp8_fake_quant(y).astype(dtype).astype(_F32)
        emit(start, 1, y)
    if hadamard:                                # one row a program, its chunks whole (rope_pieces is off)
        rounded = hadamard_fp4([y[0] for _, _, y in pieces], hadamard_ref, dtype)
        pieces = [(start, 1, y[None, :]) for (start, _, _), y in zip(pieces, rounded)]
    for start, stride, y in pieces:
        out_ref[:, pl.ds(start, y.shape[1], stride=stride)] = y.astype(dtype)
    if ring_window is not None:                 # one row a program
        slot = scalar(pos_ref) % ring_window

        @pl.when(scalar(n_valid_ref, pl.program_id(0)) > 0)     # a row without a token writes nothing
        def _():
            for start, stride, y in pieces:
                ring_ref[pl.ds(slot, 1), pl.ds(start, y.shape[1], stride=stride)] = y.astype(dtype)


VALUES_PER_PROGRAM = 2048   # a program takes rows up to this many values (rows x D) at a time


def default_rows_per_program(rows: int, group: int, dim: int) -> int:
    """Rows a program normalises together (one chunk of each at a time): the largest power of two that keeps rows x
    dim within VALUES_PER_PROGRAM, divides the rows and fits the rows sharing a position (`group`: divides it, or
    each row has its own). Measured on one H100 (2026-12-08, benchmarks/bench_norm_rows.py, docs/kernels.md (h)):
    per-head queries (512 wide) fastest at 4 rows a program at batch 1, 64 and 256 (6.1 / 12.1 / 52.4 us against
    9.3 / 23.9 / 92.3 at one row), within 7% of the best at 128; keys (512) at 4 at 64-256 rows; the query latent
    (1,024) at 2."""
    per_program = 1
    while (2 * per_program * dim <= VALUES_PER_PROGRAM and rows % (2 * per_program) == 0
           and (group == 1 or group % (2 * per_program) == 0)):
        per_program *= 2
    return per_program


def rms_norm_rows(x: jax.Array, weight: jax.Array | None, *, eps: float | None, in_dtype, out_dtype=None,
                  rope=None, fp8_nope: bool = False, hadamard_fp4: bool = False,
                  columns: tuple[int, int] | None = None, ring=None, rows_per_program: int | None = None,
                  interpret: bool = False):
    """x [..., D] (any float dtype; rounded to in_dtype first) -> rms_norm(x, weight) in out_dtype (default
    in_dtype); `rope` = (positions int32 [...], the rows' leading dims, or fewer of them to share a position among
    the rows of the rest, e.g. a token's heads; inv_freq [rope_dim / 2]): then RoPE on the last rope_dim dims at
    each row's position; `fp8_nope`: then the FP8 fake quant of the other dims (blocks of 64); `hadamard_fp4`: then
    the indexer's rounding of the whole row (normalised Hadamard transform, FP4; D a power of two). `eps` None: no
    norm (the indexer's query: RoPE and its rounding only). `columns` = (first, D): only x[..., first:first + D]
    (e.g. one of two matmul outputs written side by side), read in place. `ring` = (window ring [B, W, D] in
    out_dtype, n_valid [B]) for one token per sequence (x [B, 1, ...] with `rope`): each row is also written into the
    ring at slot position mod W, in place, where n_valid > 0 (attention.write_ring's one-token case, without a launch
    of its own); returns (rows, the ring). `rows_per_program`: default_rows_per_program's (one with hadamard_fp4 or
    a ring); it must divide the rows, and the rows sharing a position unless each row has its own."""
    *lead, width = x.shape
    first, dim = (0, width) if columns is None else columns
    if first < 0 or first + dim > width:
        raise ValueError(f"rms_norm_rows: columns {columns} lie outside the input's {width}")
    out_dtype = in_dtype if out_dtype is None else out_dtype
    rope_dim = None if rope is None else 2 * rope[1].shape[0]
    if not supported(dim, rope_dim, fp8_nope, hadamard_fp4):
        raise ValueError(f"rms_norm_rows: D {dim} with rope_dim {rope_dim}, fp8_nope {fp8_nope} and hadamard_fp4 "
                         f"{hadamard_fp4} is not supported (chunks of >= 64 columns; rope_dim a power of two dividing "
                         f"D, 64 with fp8_nope; a power-of-two D with hadamard_fp4)")
    rows = int(np.prod(lead)) if lead else 1
    chunk = pow2_divisor(dim, MAX_CHUNK) if rope is None else rope_dim
    group = 1
    if rope is not None:
        # positions [lead[:m]] (trailing ones allowed): each is shared by the rows of the trailing lead dims (e.g.
        # a token's heads), read by every row of its group -- a broadcast copy would be a launch of its own
        positions, inv_freq = rope
        shape = tuple(positions.shape)
        while shape and shape[-1] == 1 and tuple(lead[:len(shape)]) != shape:
            shape = shape[:-1]
        if tuple(lead[:len(shape)]) != shape:
            raise ValueError(f"rms_norm_rows: positions {tuple(positions.shape)} must be the rows' leading dims "
                             f"{tuple(lead)} (trailing ones allowed)")
        group = rows // max(1, int(np.prod(shape)))
    one_row = hadamard_fp4 or ring is not None       # their kernel code takes a program's rows one at a time
    per = rows_per_program
    if per is None:
        per = 1 if one_row else default_rows_per_program(rows, group, dim)
    if per < 1 or rows % per or (per > 1 and (one_row or (group > 1 and group % per))):
        raise ValueError(f"rms_norm_rows: rows_per_program={per} must divide the {rows} rows and the {group} rows "
                         f"sharing a position (or be 1; 1 with hadamard_fp4 or a ring)")
    args = [x.reshape(rows, width)]
    specs = [pl.BlockSpec((per, width), lambda r: (r, 0))]
    if weight is not None:
        args.append(weight)
        specs.append(pl.BlockSpec((dim,), lambda r: (0,)))
    rope_pieces = not hadamard_fp4       # RoPE on the even and odd columns apart; the transform needs whole chunks
    row_positions = rope is not None and group == 1 and per > 1
    if rope is not None:
        freq = np.asarray(inv_freq, np.float32)
        args += [positions.reshape(-1).astype(jnp.int32), jnp.asarray(freq if rope_pieces else np.repeat(freq, 2))]
        pos_spec = (pl.BlockSpec((per,), lambda r: (r,)) if row_positions
                    else pl.BlockSpec((1,), lambda r: (r * per // group,)))
        specs += [pos_spec, pl.BlockSpec((args[-1].shape[0],), lambda r: (0,))]
    if hadamard_fp4:
        args.append(jnp.asarray(hadamard_matrix(dim)))
        specs.append(pl.BlockSpec((dim, dim), lambda r: (0, 0)))
    out_specs = [pl.BlockSpec((per, dim), lambda r: (r, 0))]
    out_shape = [jax.ShapeDtypeStruct((rows, dim), out_dtype)]
    aliases = {}
    window = None
    if ring is not None:
        ring_buffer, n_valid = ring
        window = ring_buffer.shape[1]
        if (rope is None or ring_buffer.shape != (rows, window, dim) or ring_buffer.dtype != jnp.dtype(out_dtype)
                or group != 1):
            raise ValueError(f"rms_norm_rows: a ring write takes one row of {dim} per sequence with rope and a ring "
                             f"[rows, W, {dim}] in {jnp.dtype(out_dtype)}; got rows {rows}, ring "
                             f"{ring_buffer.shape} {ring_buffer.dtype}")
        aliases = {len(args) + 1: 1}
        args += [n_valid.astype(jnp.int32), ring_buffer]
        specs += [pl.BlockSpec((rows,), lambda r: (0,)), pl.BlockSpec((None, window, dim), lambda r: (r, 0, 0))]
        out_specs.append(pl.BlockSpec((None, window, dim), lambda r: (r, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct(ring_buffer.shape, ring_buffer.dtype))
    kernel = functools.partial(_kernel, first=first, dim=dim, chunk=chunk, eps=eps, in_dtype=in_dtype,
                               has_weight=weight is not None, rope=rope is not None, rope_pieces=rope_pieces,
                               row_positions=row_positions, fp8_nope=fp8_nope, hadamard=hadamard_fp4,
                               ring_window=window)
    outs = pl.pallas_call(kernel, grid=(rows // per,), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases=aliases, interpret=interpret, name="rms_norm_rows",
                          compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(*args)
    out = outs[0].reshape(*lead, dim)
    return out if ring is None else (out, outs[1])
