"""Matmuls against stored weights: the dispatcher between GPU kernels and the pure-jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .formats import dequantize


def linear(x: jax.Array, weight, out_dtype=None) -> jax.Array:
    """y = x @ W^T for W [out, in] in any stored format; activations in x.dtype, fp32 accumulation."""
    w = dequantize(weight, x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def grouped_linear(x: jax.Array, weight, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    """Rows of x [m, in] sorted by group; group g multiplies W[g]^T (W [G, out, in]); returns [m, out]."""
    w = jnp.swapaxes(dequantize(weight, x.dtype), -1, -2)
    y = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
