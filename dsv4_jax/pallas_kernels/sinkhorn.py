"""The mHC Sinkhorn of many rows in one launch (Pallas, GPU): ops/mhc_site.py `sinkhorn` (a row softmax + eps, a
column normalisation, then iters - 1 row and column normalisations) of every row's n x n mixing logits.

    comb = sinkhorn_rows(comb_logits [..., n, n] float32, iters=20, eps=1e-6)

Why a kernel for 16 numbers a row: on XLA's path the unrolled chain of 40 normalisations is one Triton fusion up to
~512 rows, but from ~2,048 rows XLA's GPU backend splits it into about three kernels per iteration (an 8,192-row
site of Flash compiled for an H200: 36 launches, 29 of them the Sinkhorn's), whatever the jnp formulation (reductions,
explicit sums of the entries, rows minor: each moves the split elsewhere). Here a program takes a block of rows with
entry (i, j) of each row's matrix as one vector of the block ([n * n, rows] in memory; a 2,048-row site of Flash
compiled for an H200 is 9 launches with it, tests/test_kernel_counts.py), so every sum over a row or column of a
matrix is n - 1 vector adds in registers, and the 40 normalisations are one pass over 64 bytes a row.

Numerics: the jnp path's operations in float32; the sums of n entries are added in index order (XLA's reduction
order is its own), so results agree to float32 rounding, not bit for bit.

Triton backend, as the other kernels here (quantize.py says why): its tensors are vectors of a power-of-two block of
rows, and n * n must be a power of two (n = 4 for the released models).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import is_pow2, pow2_divisor

BLOCK_ROWS = 512      # rows per program (16 vectors of 512 float32 on 4 warps: 64 registers a thread)
MIN_ROWS = 16         # fewer rows, or a row count without a power-of-two divisor this large: the jnp path


def takes(rows: int, n: int) -> bool:
    """Whether the kernel takes `rows` matrices of n x n (blocks of at least MIN_ROWS rows, n * n a power of two)."""
    return is_pow2(n * n) and rows % MIN_ROWS == 0


def _total(xs):
    """x_0 + x_1 + ... in index order."""
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def _kernel(x_ref, out_ref, *, n: int, iters: int, eps: float):
    c = [[x_ref[i * n + j, :] for j in range(n)] for i in range(n)]          # c[i][j]: [rows] each

    def rows_normalised(c):
        sums = [_total(row) + eps for row in c]
        return [[x / s for x in row] for row, s in zip(c, sums)]

    def columns_normalised(c):
        sums = [_total([c[i][j] for i in range(n)]) + eps for j in range(n)]
        return [[x / s for x, s in zip(row, sums)] for row in c]

    softmax = []                                                 # jax.nn.softmax over each row, then + eps
    for row in c:
        peak = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(x - peak) for x in row]
        total = _total(e)
        softmax.append([x / total + eps for x in e])
    c = columns_normalised(softmax)
    for _ in range(iters - 1):
        c = columns_normalised(rows_normalised(c))
    for i in range(n):
        for j in range(n):
            out_ref[i * n + j, :] = c[i][j]


def sinkhorn_rows(logits: jax.Array, *, iters: int, eps: float, interpret: bool = False) -> jax.Array:
    """ops/mhc_site.py `sinkhorn` of logits [..., n, n] (float32) in one launch -> [..., n, n] float32."""
    *lead, n, n2 = logits.shape
    rows = math.prod(lead)
    if n != n2 or not takes(rows, n):
        raise ValueError(f"sinkhorn_rows takes square matrices, n * n a power of two, in a multiple of {MIN_ROWS} "
                         f"rows; got {rows} rows of {n} x {n2}")
    block = pow2_divisor(rows, BLOCK_ROWS)
    x = logits.astype(jnp.float32).reshape(rows, n * n).T                                   # [n * n, rows]
    spec = pl.BlockSpec((n * n, block), lambda r: (0, r))
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, iters=iters, eps=eps), grid=(rows // block,), in_specs=[spec],
        out_specs=spec, out_shape=jax.ShapeDtypeStruct((n * n, rows), jnp.float32), interpret=interpret,
        name="mhc_sinkhorn", compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(x)
    return out.T.reshape(logits.shape)
