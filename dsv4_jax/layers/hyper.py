"""Manifold-constrained hyper-connections (mHC, docs/model.md 4.2 and 4.7): the final collapse of the streams
before the head. An mHC site between sub-layers (hc_post, hc_pre, the norm) is an op: ops/mhc_site.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..ops.mhc_site import mix_logits


@jax.named_scope("mhc")
def hc_head(X: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final collapse of the streams before the last norm: sum_i (sigmoid(m_i s + b_i) + eps) X_i."""
    m = mix_logits(X, fn, cfg.norm_eps)
    pre = jax.nn.sigmoid(m * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + cfg.hc_eps
    return jnp.einsum("...n,...nd->...d", pre, X.astype(jnp.float32)).astype(X.dtype)
