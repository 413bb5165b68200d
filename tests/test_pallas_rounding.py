"""The kernels' fake-quant roundings (dsv4_jax/pallas_kernels/rounding.py: floor-based, Triton has no `round`)
equal numerics/fake_quant.py's bit for bit (a zero's sign aside), ties included: plain jnp functions, checked
outside Pallas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.pallas_kernels import rounding
from dsv4_jax.numerics import fake_quant


def _with_ties(rng, shape, grid_steps):
    """Random values, a quarter of them exact midpoints between neighbours of a grid (ties) at random scales."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0) ** rng.integers(-8, 8, shape)
    ties = (rng.integers(0, 2 * grid_steps, shape) + 0.5) * np.float32(2.0) ** rng.integers(-6, 3, shape)
    return np.where(rng.random(shape) < 0.25, ties * np.sign(x), x).astype(np.float32)


def test_fp8_and_fp4_roundings_equal_fake_quant():
    rng = np.random.default_rng(0)
    x = _with_ties(rng, (256, 64), 16)
    np.testing.assert_array_equal(np.asarray(rounding.fp8_fake_quant(jnp.asarray(x))),
                                  np.asarray(fake_quant.fp8_fake_quant(jnp.asarray(x))))
    for row in _with_ties(rng, (64, 128), 4):
        got = np.asarray(rounding.fp4_fake_quant(jnp.asarray(row)))
        want = np.asarray(fake_quant.fp4_fake_quant(jnp.asarray(row)))
        np.testing.assert_array_equal(got, want)
    y = _with_ties(rng, (4096,), 16) * 64
    np.testing.assert_array_equal(np.asarray(rounding.round_to_e4m3(jnp.asarray(y))),
                                  np.asarray(fake_quant.round_to_e4m3(jnp.asarray(y))))


def test_in_kernel_e4m3_rounding_equals_the_models():
    """The kernels' e4m3 rounding (floor-based: Triton has no `round`) against numerics/fake_quant.round_to_e4m3 on
    every e4m3 value, every midpoint between neighbours (the ties, which go to the even one), points just off them,
    values past saturation and below the smallest subnormal."""
    from dsv4_jax.numerics.fake_quant import round_to_e4m3
    grid = np.unique(np.asarray(jnp.arange(256, dtype=jnp.uint8).view(jnp.float8_e4m3fn).astype(jnp.float32)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        [500.0, -1e4, 2.0 ** -12, -(2.0 ** -11) * 0.75]]).astype(np.float32)
    got = np.asarray(jax.jit(rounding.round_to_e4m3)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(round_to_e4m3(jnp.asarray(x))))
