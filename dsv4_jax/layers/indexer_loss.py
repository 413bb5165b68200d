"""The Lightning indexer's training loss (as in DeepSeek-V3.2's DSA): the indexer only chooses which compressed
entries a CSA query reads, so the language-model loss gives its weights no gradient. Each CSA layer adds instead
the KL divergence from the main attention's distribution over the compressed entries (the softmax over all visible
entries, summed over heads and renormalised: a constant target) to the softmax of the indexer scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_kl(q: jax.Array, compressed: jax.Array, scores: jax.Array, visible: jax.Array) -> jax.Array:
    """Mean over the queries that see at least one entry of KL(target || softmax(scores)).

    q [B, S, H, hd]: the main attention's queries (normalised, rotated); compressed [B, N, hd]: the compressed
    entries; scores [B, S, N] float32: the indexer's scores (its gradient path); visible [B, S, N] bool."""
    head_dim = q.shape[-1]
    q, compressed = jax.lax.stop_gradient((q, compressed))
    logits = jnp.einsum("bshd,bnd->bshn", q, compressed, preferred_element_type=jnp.float32) * head_dim ** -0.5
    probs = jax.nn.softmax(jnp.where(visible[:, :, None, :], logits, -jnp.inf), axis=-1)
    target = jnp.sum(jnp.nan_to_num(probs), axis=2)                     # rows with nothing visible: 0
    target = jax.lax.stop_gradient(target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-9))
    log_p = jax.nn.log_softmax(jnp.where(visible, scores, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(visible, target * (jnp.log(jnp.maximum(target, 1e-9)) - log_p), 0.0), axis=-1)
    has = visible[:, :, 0]
    return jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(jnp.sum(has), 1)
