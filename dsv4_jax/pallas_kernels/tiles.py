"""Shapes and scalar loads for Pallas's Triton lowering, shared by the kernels here: its loads and stores take
power-of-two tensor shapes, and it has no 0-d load (a scalar is a 1-element slice, summed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap (a power of two): a chunk width that tiles n."""
    return min(n & -n, cap)


def scalar(ref, *index):
    """The value of `ref` at `index` (default: element 0 of a 1-D ref) as a 0-d value inside a kernel."""
    *lead, last = index or (0,)
    return jnp.sum(ref[(*lead, pl.ds(last, 1))])


def pow2(p: jax.Array) -> jax.Array:
    """2^p as float32 for integer p, exact on every backend and inside a kernel (no exp2 on the special-function
    unit): p + 127 written as the float's exponent field, p clipped to the normal range [-126, 127] (where the
    callers' values are either exact or far below anything that matters)."""
    return jax.lax.bitcast_convert_type((jnp.clip(p + 127, 1, 254) << 23).astype(jnp.uint32), jnp.float32)
