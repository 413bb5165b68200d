"""One mHC site in two launches (Pallas, GPU): hc_post of the previous sub-layer (optional), hc_pre and the RMSNorm
that follows it -- what the pure-jnp path (ops/mhc_site.py `hc_post`, `hc_pre`, ops/norm_rope.py `rms_norm`) does in
about ten small XLA kernels per site on the GPU.

    x, post, comb, X = mhc_pre_norm(X, fn, base, scale, norm_weight, ..., post_mix=(y, post_prev, comb_prev))

Why two launches and not one: the mixing logits are a dot product over all n * D stream values (fn is 24 x 16,384
float32 for Flash, 1.5 MB, which one thread block cannot read fast enough at batch 1). That reduction runs across
the thread blocks of a grid; the kernel boundary is the grid-wide barrier (launches on one stream are ordered), so
no block reads a partial sum another block may not have written yet:
  1. `_mix_kernel`, grid (rows, D / 128): [the hc_post still due, X'_k = post_k y + sum_j comb[j, k] X_j, written out]
     and each chunk's partial sums: fn . X for the 24 mixing rows and sum(X^2), into a [rows, chunks, 32] buffer.
  2. `_collapse_norm_kernel`, grid (rows,): one block per row adds up the row's partials, forms pre / post and the
     Sinkhorn-normalised comb (16 numbers), collapses the row, u = sum_i pre_i X_i rounded to X's dtype as hc_pre
     returns it, and normalises it, u * rsqrt(mean(u^2) + eps) * weight, in X's dtype. The row's n * D streams
     (32 KB in bf16 for Flash) are few enough for one block, which keeps the RMSNorm's sum inside it (until
     2026-12-03 the collapse and the norm were two launches of D / 1,024 blocks each).
A prefill chunk's rows take the same two launches with the first on the prefill schedule (`rows_per_program`):
`_mix_rows_kernel`, grid (rows / R, D / 128), takes R = 16 rows against each chunk of fn, so fn is read once per 16
rows instead of once per row (a 2,048-token chunk would read 3 GB of it per site from L2), and forms the partials as
float32 dots (ieee precision) of the rows' [16, 128] stream columns against the chunk's mixing rows, padded to 32.
Opt-in on GPU plans (the override mhc_site=kernel, ops/mhc_site.py): on an H100 it was 4% slower than XLA's path.

Numerics follow the jnp path operation for operation in float32; only the order of the long sums differs (chunked
partial sums instead of XLA's reduction tree), so results agree to float32 rounding, not bit for bit.

Triton backend, as the other kernels here (quantize.py says why). Triton needs power-of-two tensor shapes, so the 24
mixing rows are read as 4 (pre) + 4 (post) + 16 (comb) and the partials hold them in lanes 0-23 and sum(X^2) in
lanes 24-31.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import pow2_divisor, scalar

_F32 = jnp.float32
MIX_CHUNK = 128              # stream columns per block of the mixing reduction
MAX_ROWS = 128               # rows (tokens) up to which a decode or verify step takes the one-row-per-program mix
                             # kernel: each row's blocks read all of fn (1.5 MB for Flash) from L2
PREFILL_ROWS = 16            # rows per program of the prefill schedule (its n streams of 16 x 128 values and their
PREFILL_WARPS = 8            # mixed copies stay in registers: ~64 float32 a thread on 8 warps)
LANES = 32                   # partials per (row, chunk): 24 mixing sums, sum(X^2) in lanes 24-31


def supported(n: int, dim: int, fn_rows: int) -> bool:
    """Whether the kernels take this geometry: 4 streams (pre 4 + post 4 + comb 16 mixing rows) and D a multiple of
    128."""
    return n == 4 and fn_rows == 24 and dim % MIX_CHUNK == 0


def takes(rows: int, n: int, dim: int, fn_rows: int) -> bool:
    """Whether the model runs a site of `rows` tokens on these kernels (supported geometry, at most MAX_ROWS)."""
    return rows <= MAX_ROWS and supported(n, dim, fn_rows)


def _post_mix(x, y_refs, post_ref, comb_ref, dtype):
    """hc_post on one chunk: X'_k = post_k * y + sum_j comb[j, k] * X_j, float32, x [n, C]; y rounded to the
    streams' dtype first (a float32 y is a matmul's output whose cast to that dtype happens here). Two y_refs: the
    MoE's parts (routed [1, K, C], shared [1, C]), y their sum in ops/moe_ffn.MoeParts.total's order."""
    if len(y_refs) == 1:
        y = y_refs[0][0, :]
    else:
        routed_ref, shared_ref = y_refs
        y = routed_ref[0, 0, :].astype(_F32)
        for k in range(1, routed_ref.shape[1]):
            y = y + routed_ref[0, k, :].astype(_F32)
        y = y + shared_ref[0, :].astype(_F32)
    y = y.astype(dtype).astype(_F32)                               # [C]
    post = post_ref[0, :]                                          # [n]
    comb = comb_ref[0, :, :]                                       # [n(j), n(k)]
    mixed = jnp.sum(comb[:, :, None] * x[:, None, :], axis=0)      # [n(k), C]
    return post[:, None] * y[None, :] + mixed


def _mix_kernel(*refs, y_parts: int):
    """y_parts: 0 (no hc_post due), 1 (y), 2 (the MoE's routed and shared parts)."""
    if y_parts:
        x_ref, y_refs = refs[0], refs[1:1 + y_parts]
        post_ref, comb_ref, fn_ref, part_ref, x_out_ref = refs[1 + y_parts:]
    else:
        x_ref, fn_ref, part_ref = refs
    x = x_ref[0, :, :].astype(_F32)                                # [n, C]
    if y_parts:
        x = _post_mix(x, y_refs, post_ref, comb_ref, x_ref.dtype).astype(x_ref.dtype)
        x_out_ref[0, :, :] = x
        x = x.astype(_F32)

    def dots(first, rows):
        w = fn_ref[pl.ds(first, rows), :, :]                       # [rows, n, C]
        return jnp.sum(jnp.sum(w * x[None], axis=2), axis=1)        # [rows]

    part_ref[0, 0, pl.ds(0, 4)] = dots(0, 4)
    part_ref[0, 0, pl.ds(4, 4)] = dots(4, 4)
    part_ref[0, 0, pl.ds(8, 16)] = dots(8, 16)
    part_ref[0, 0, pl.ds(24, 8)] = jnp.full((8,), jnp.sum(jnp.sum(x * x, axis=1), axis=0), _F32)


def _mix_rows_kernel(*refs, post_mix: bool, n: int):
    """The prefill schedule of _mix_kernel: R rows (x_ref [R, n, C]) against one chunk of fn (fn_ref [32, n, C],
    rows 24-31 zero). With post_mix: y_ref [R, C], post_ref [R, n], comb_ref [R, n * n] (comb[j, k] at j * n + k),
    and the rows' X' written out. Partials [R, 1, 32]: the 24 mixing dots, then sum(X^2) in lanes 24-31."""
    if post_mix:
        x_ref, y_ref, post_ref, comb_ref, fn_ref, part_ref, x_out_ref = refs
    else:
        x_ref, fn_ref, part_ref = refs
    dtype = x_ref.dtype
    xs = [x_ref[:, i, :].astype(_F32) for i in range(n)]                     # n x [R, C]
    if post_mix:
        y = y_ref[...].astype(dtype).astype(_F32)                            # [R, C]
        mixed = []
        for k in range(n):
            mixed_k = comb_ref[:, pl.ds(k, 1)] * xs[0]                      # sum_j comb[j, k] X_j, then + post_k y
            for j in range(1, n):                                          # (hc_post's and _post_mix's order)
                mixed_k = mixed_k + comb_ref[:, pl.ds(j * n + k, 1)] * xs[j]
            xk = (post_ref[:, pl.ds(k, 1)] * y + mixed_k).astype(dtype)
            x_out_ref[:, k, :] = xk
            mixed.append(xk.astype(_F32))
        xs = mixed
    dots = jnp.dot(xs[0], fn_ref[:, 0, :].T, preferred_element_type=_F32, precision=jax.lax.Precision.HIGHEST)
    sum_sq = jnp.sum(xs[0] * xs[0], axis=1)
    for i in range(1, n):
        dots = dots + jnp.dot(xs[i], fn_ref[:, i, :].T, preferred_element_type=_F32,
                              precision=jax.lax.Precision.HIGHEST)
        sum_sq = sum_sq + jnp.sum(xs[i] * xs[i], axis=1)
    lane = jax.lax.broadcasted_iota(jnp.int32, dots.shape, 1)
    part_ref[:, 0, :] = jnp.where(lane >= 24, sum_sq[:, None], dots)


def prefill_rows_per_program(rows: int) -> int:
    """Rows a program of the prefill schedule takes: the largest power of two up to PREFILL_ROWS dividing `rows`."""
    return pow2_divisor(rows, PREFILL_ROWS)


def _sinkhorn(logits, iters: int, eps: float):
    """ops/mhc_site.py `sinkhorn`, unrolled, on a [4, 4] tile."""
    c = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    c = c / jnp.sum(c, axis=1, keepdims=True) + eps
    c = c / (jnp.sum(c, axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, axis=1, keepdims=True) + eps)
        c = c / (jnp.sum(c, axis=0, keepdims=True) + eps)
    return c


def _collapse_norm_kernel(part_ref, base_ref, scale_ref, x_ref, *refs, n_parts: int, n_dim: int, chunk: int,
                          norm_eps: float, hc_eps: float, iters: int):
    """One row per program: the mixing logits from the partials, pre / post / comb, then the row's collapse u (in
    X's dtype, as hc_pre returns it) and its RMSNorm, in two passes over pow2 chunks of D (Triton's tensor shapes):
    the first sums u^2, the second recomputes u from the streams (cheaper than a second launch) and writes it
    normalised."""
    if len(refs) == 4:
        w_ref, out_ref, post_ref, comb_ref = refs
    else:
        w_ref, (out_ref, post_ref, comb_ref) = None, refs

    def total(first, rows):
        acc = part_ref[0, 0, pl.ds(first, rows)]
        for j in range(1, n_parts):
            acc = acc + part_ref[0, j, pl.ds(first, rows)]
        return acc

    sum_sq = jnp.max(total(24, 8))
    rho = jax.lax.rsqrt(sum_sq / n_dim + norm_eps)
    s_pre, s_post, s_comb = (scalar(scale_ref, i) for i in range(3))
    pre = jax.nn.sigmoid(rho * total(0, 4) * s_pre + base_ref[pl.ds(0, 4)]) + hc_eps           # [n]
    post = 2.0 * jax.nn.sigmoid(rho * total(4, 4) * s_post + base_ref[pl.ds(4, 4)])
    comb_logits = (rho * total(8, 16) * s_comb + base_ref[pl.ds(8, 16)]).reshape(4, 4)
    dim = x_ref.shape[-1]

    def collapsed(j):                                     # u on chunk j, rounded to X's dtype, in float32
        x = x_ref[0, :, pl.ds(j * chunk, chunk)].astype(_F32)                                 # [n, C]
        return jnp.sum(pre[:, None] * x, axis=0).astype(out_ref.dtype).astype(_F32)

    usq = jnp.zeros((), _F32)
    for j in range(dim // chunk):
        u = collapsed(j)
        usq = usq + jnp.sum(u * u)
    r = jax.lax.rsqrt(usq / dim + norm_eps)
    for j in range(dim // chunk):
        y = collapsed(j) * r
        if w_ref is not None:
            y = y * w_ref[pl.ds(j * chunk, chunk)].astype(_F32)
        out_ref[0, pl.ds(j * chunk, chunk)] = y.astype(out_ref.dtype)
    post_ref[0, :] = post
    comb_ref[0, :, :] = _sinkhorn(comb_logits, iters, hc_eps)


def _call(kernel, grid, in_specs, out_specs, out_shape, args, interpret, name, num_warps=4):
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, name=name,
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1))(*args)


def mhc_pre_norm(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, norm_weight: jax.Array | None, *,
                 norm_eps: float, hc_eps: float, sinkhorn_iters: int, post_mix=None, rows_per_program: int = 0,
                 interpret: bool = False):
    """X [..., n, D] -> (x [..., D] = rms_norm(hc_pre's u) in X's dtype, post [..., n] f32, comb [..., n, n] f32,
    the streams X' [..., n, D]). `post_mix` = (y [..., D], post [..., n], comb [..., n, n]): the previous sub-layer's
    hc_post, applied to X first (X' is then its result; otherwise X' is X); y in X's dtype, or float32 (rounded to
    X's dtype here, as ops/mhc_site.hc_post rounds it), or a pair (routed [..., K, D], shared [..., D]) of float32 MoE
    parts (ops/moe_ffn.MoeParts), summed here in its `total`'s order, then rounded. `rows_per_program` > 0: the mixing
    partials on the prefill schedule, that many rows (a power of two dividing the rows) per program; y one array."""
    *lead, n, dim = X.shape
    if not supported(n, dim, fn.shape[0]):
        raise ValueError(f"mhc_pre_norm: needs 4 streams, 24 mixing rows and D a multiple of {MIX_CHUNK}; got "
                         f"n={n}, D={dim}, fn {fn.shape}")
    rows = 1
    for s in lead:
        rows *= s
    X2 = X.reshape(rows, n, dim)
    fn3 = fn.astype(_F32).reshape(fn.shape[0], n, dim)
    n_mix = dim // MIX_CHUNK
    x_spec = pl.BlockSpec((1, n, MIX_CHUNK), lambda r, j: (r, 0, j))
    fn_spec = pl.BlockSpec((fn.shape[0], n, MIX_CHUNK), lambda r, j: (0, 0, j))
    part_spec = pl.BlockSpec((1, 1, LANES), lambda r, j: (r, j, 0))
    part_shape = jax.ShapeDtypeStruct((rows, n_mix, LANES), _F32)
    if rows_per_program:
        part, streams = _mix_rows(X2, fn3, post_mix, rows_per_program, interpret)
    elif post_mix is None:
        (part,) = _call(functools.partial(_mix_kernel, y_parts=0), (rows, n_mix), [x_spec, fn_spec],
                        [part_spec], [part_shape], (X2, fn3), interpret, "mhc_mix")
        streams = X2
    else:
        y, post_prev, comb_prev = post_mix
        y_spec = pl.BlockSpec((1, MIX_CHUNK), lambda r, j: (r, j))
        if isinstance(y, tuple):                   # the MoE's parts
            routed, shared = y
            k = routed.shape[-2]
            ys = (routed.reshape(rows, k, dim), shared.reshape(rows, dim))
            y_specs = [pl.BlockSpec((1, k, MIX_CHUNK), lambda r, j: (r, 0, j)), y_spec]
        else:
            ys, y_specs = (y.reshape(rows, dim),), [y_spec]
        args = (X2, *ys, post_prev.astype(_F32).reshape(rows, n), comb_prev.astype(_F32).reshape(rows, n, n), fn3)
        specs = [x_spec, *y_specs, pl.BlockSpec((1, n), lambda r, j: (r, 0)),
                 pl.BlockSpec((1, n, n), lambda r, j: (r, 0, 0)), fn_spec]
        part, streams = _call(functools.partial(_mix_kernel, y_parts=len(ys)), (rows, n_mix), specs,
                              [part_spec, x_spec], [part_shape, jax.ShapeDtypeStruct(X2.shape, X.dtype)], args,
                              interpret, "mhc_post_mix")

    has_weight = norm_weight is not None
    kernel = functools.partial(_collapse_norm_kernel, n_parts=n_mix, n_dim=n * dim, chunk=pow2_divisor(dim, 1024),
                               norm_eps=norm_eps, hc_eps=hc_eps, iters=sinkhorn_iters)
    x, post, comb = _call(
        kernel, (rows,),
        [pl.BlockSpec((1, n_mix, LANES), lambda r: (r, 0, 0)), pl.BlockSpec((fn.shape[0],), lambda r: (0,)),
         pl.BlockSpec((3,), lambda r: (0,)), pl.BlockSpec((1, n, dim), lambda r: (r, 0, 0))]
        + ([pl.BlockSpec((dim,), lambda r: (0,))] if has_weight else []),
        [pl.BlockSpec((1, dim), lambda r: (r, 0)), pl.BlockSpec((1, n), lambda r: (r, 0)),
         pl.BlockSpec((1, n, n), lambda r: (r, 0, 0))],
        [jax.ShapeDtypeStruct((rows, dim), X.dtype), jax.ShapeDtypeStruct((rows, n), _F32),
         jax.ShapeDtypeStruct((rows, n, n), _F32)],
        (part, base.astype(_F32), scale.astype(_F32), streams) + ((norm_weight,) if has_weight else ()), interpret,
        "mhc_collapse_norm")
    return (x.reshape(*lead, dim), post.reshape(*lead, n), comb.reshape(*lead, n, n),
            streams.reshape(X.shape))


def _mix_rows(X2, fn3, post_mix, tr: int, interpret: bool):
    """The first launch on the prefill schedule: (partials [rows, D / 128, 32], the streams after the hc_post due)."""
    rows, n, dim = X2.shape
    if tr < 1 or tr & (tr - 1) or rows % tr:
        raise ValueError(f"mhc_pre_norm: rows_per_program must be a power of two dividing the {rows} rows, got {tr}")
    n_mix = dim // MIX_CHUNK
    fn32 = jnp.pad(fn3, ((0, LANES - fn3.shape[0]), (0, 0), (0, 0)))          # 24 mixing rows -> 32 (pow2 dots)
    x_spec = pl.BlockSpec((tr, n, MIX_CHUNK), lambda r, j: (r, 0, j))
    fn_spec = pl.BlockSpec((LANES, n, MIX_CHUNK), lambda r, j: (0, 0, j))
    part_spec = pl.BlockSpec((tr, 1, LANES), lambda r, j: (r, j, 0))
    part_shape = jax.ShapeDtypeStruct((rows, n_mix, LANES), _F32)
    grid = (rows // tr, n_mix)
    if post_mix is None:
        (part,) = _call(functools.partial(_mix_rows_kernel, post_mix=False, n=n), grid, [x_spec, fn_spec],
                        [part_spec], [part_shape], (X2, fn32), interpret, "mhc_mix_rows", num_warps=PREFILL_WARPS)
        return part, X2
    y, post_prev, comb_prev = post_mix
    if isinstance(y, tuple):
        raise ValueError("mhc_pre_norm: the prefill schedule takes y as one array, not the MoE's parts")
    args = (X2, y.reshape(rows, dim), post_prev.astype(_F32).reshape(rows, n),
            comb_prev.astype(_F32).reshape(rows, n * n), fn32)
    specs = [x_spec, pl.BlockSpec((tr, MIX_CHUNK), lambda r, j: (r, j)), pl.BlockSpec((tr, n), lambda r, j: (r, 0)),
             pl.BlockSpec((tr, n * n), lambda r, j: (r, 0)), fn_spec]
    return _call(functools.partial(_mix_rows_kernel, post_mix=True, n=n), grid, specs, [part_spec, x_spec],
                 [part_shape, jax.ShapeDtypeStruct(X2.shape, X2.dtype)], args, interpret, "mhc_post_mix_rows",
                 num_warps=PREFILL_WARPS)
