"""On-device sampling: greedy, temperature, top-k, top-p, all from traced parameters (no recompiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filtered_sorted(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(order, tempered logits in descending order, the kept ranks): the distribution temperature, top-k and top-p
    leave, over the last axis."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, top_k, vocab)
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose probability reaches top_p (the top token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    return order, sorted_logits, keep & (before < top_p)


@jax.named_scope("sampling")
def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """logits [B, V] float32 -> token ids [B] int32. temperature 0 means greedy; top_k 0 and top_p 1 disable."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order, sorted_logits, keep = _filtered_sorted(logits, temperature, top_k, top_p)
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@jax.named_scope("sampling")
def probabilities(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution `sample` draws from for temperature > 0, float32 [..., V] in vocabulary order."""
    order, sorted_logits, keep = _filtered_sorted(logits, temperature, top_k, top_p)
    sorted_probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(sorted_probs, jnp.argsort(order, axis=-1), axis=-1)
