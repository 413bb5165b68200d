"""RMSNorm, computed in float32 and cast back to the input dtype (docs/model.md 3.1)."""

import jax
import jax.numpy as jnp


@jax.named_scope("norm")
def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)
