"""sampling.sample_rows: its three paths (every row greedy, no row filtering, some row filtering) give each row the
token the sorting path gives it, so a row's tokens do not depend on its batch; and the draws follow the filtered,
tempered distribution, checked against a float64 numpy reference of temperature, top-k and top-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import sampling
from dsv4_jax.sampling import Sampling, sample_rows

ROWS = [dict(temperature=0.0, top_k=0, top_p=1.0),          # greedy
        dict(temperature=0.7, top_k=0, top_p=1.0),          # temperature only
        dict(temperature=1.0, top_k=5, top_p=1.0),
        dict(temperature=0.6, top_k=0, top_p=0.8),
        dict(temperature=1.3, top_k=40, top_p=0.9),
        dict(temperature=0.0, top_k=3, top_p=0.5)]          # greedy: its filters do not matter


def _rows(params, seed=7, first_choice=0):
    return Sampling.rows(len(params), temperature=[p["temperature"] for p in params],
                         top_k=[p["top_k"] for p in params], top_p=[p["top_p"] for p in params], seed=seed,
                         first_choice=first_choice)


@pytest.mark.parametrize("step", [0, 5])
def test_a_rows_token_does_not_depend_on_its_batch(step):
    """Each row alone (its own path: argmax, the Gumbel-max over the vocabulary, or the sort) against the batch of
    all rows (the sorting path for every row), with the same key and step."""
    logits = jnp.asarray(np.random.default_rng(step).normal(size=(len(ROWS), 300)) * 2, jnp.float32)
    steps = jnp.full((len(ROWS),), step, jnp.int32)
    together = np.asarray(sample_rows(logits, steps, _rows(ROWS)))
    for r, params in enumerate(ROWS):
        alone = sample_rows(logits[r:r + 1], steps[r:r + 1], _rows([params], first_choice=r))
        assert int(alone[0]) == together[r], f"row {r} ({params})"
    assert together[0] == np.argmax(logits[0]) and together[5] == np.argmax(logits[5])


def _reference_distribution(logits, temperature, top_k, top_p):
    """float64: softmax(logits / T) over the kept prefix of the tokens by probability (top-k, then the smallest
    prefix whose probability reaches top_p, renormalised over the top-k), in vocabulary order."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    k = top_k if top_k > 0 else len(scaled)
    probs = np.exp(scaled[order[:k]] - scaled[order[0]])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = before < top_p if top_p < 1 else np.ones(k, bool)
    out = np.zeros(len(scaled))
    out[order[:k][kept]] = probs[kept] / probs[kept].sum()
    return out


@pytest.mark.parametrize("params", ROWS[1:5], ids=["temperature", "top_k", "top_p", "top_k_top_p"])
def test_draws_follow_the_filtered_distribution(params):
    """4,000 draws of one row's parameters (its key folded with steps 0..3999; the temperature-only rows on the
    unsorted path, the others on the sorting one): the kept tokens only, at frequencies within 5 standard errors of
    the float64 reference."""
    vocab, n = 24, 4000
    logits = np.random.default_rng(1).normal(size=vocab) * 1.5
    batch = jnp.asarray(np.repeat(logits[None], n, 0), jnp.float32)
    rows = _rows([params] * n)
    tokens = np.asarray(sample_rows(batch, jnp.arange(n, dtype=jnp.int32), rows))
    want = _reference_distribution(logits, params["temperature"], params["top_k"], params["top_p"])
    assert np.all(want[tokens] > 0), "a token the filters drop was drawn"
    freq = np.bincount(tokens, minlength=vocab) / n
    se = np.sqrt(np.maximum(want * (1 - want), 1e-4) / n)
    assert np.all(np.abs(freq - want) < 5 * se + 1e-3), np.abs(freq - want) / se


def test_the_sample_function_keeps_its_filters():
    """`sample` (one key for the batch) under jit equals its rows drawn one by one with the same noise rule."""
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(3, 50)), jnp.float32)
    key = jax.random.PRNGKey(4)
    got = jax.jit(sampling.sample)(logits, key, jnp.float32(0.9), jnp.int32(4), jnp.float32(0.7))
    noise = jax.random.gumbel(key, logits.shape, jnp.float32)
    for r in range(3):
        want = _reference_distribution(np.asarray(logits[r]), 0.9, 4, 0.7)
        scores = np.where(want > 0, np.asarray(logits[r], np.float64) / 0.9 + np.asarray(noise[r]), -np.inf)
        assert int(got[r]) == int(np.argmax(scores))
