"""sampling.sample_rows: its paths (every row greedy, no row filtering, the filters by rejection, the filters by a
sort) give each row the token the sorting path gives it, so a row's tokens do not depend on its batch; the draws
follow the filtered, tempered distribution, checked against a float64 numpy reference of temperature, top-k and
top-p; and the filters without a sort draw the Gumbel-max over the reference's kept tokens, or leave the row to
the sort."""

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
    """Each row alone (its own path: argmax, the Gumbel-max over the vocabulary, or the filters by rejection)
    against the batch of all rows (the filters by rejection for every row: some rows filter), with the same key and
    step."""
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
    """4,000 draws of one row's parameters (its key folded with steps 0..3999; temperature only: the Gumbel-max over
    the vocabulary; top-k, top-p or both: by rejection): the kept tokens only, at frequencies within 5 standard
    errors of the float64 reference."""
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


def _kept_reference(logits, temperature, top_k, top_p):
    """float64: (kept [V] bool, ambiguous): the tokens temperature, top-k and top-p keep, as the sorting path defines
    them (descending tempered logit, ties by ascending id; top-p over the top-k's renormalised probabilities); a row
    is ambiguous where some token's preceding probability lies within 1e-5 of top_p (float32 sums may decide it
    either way). Temperature 0 is taken as the sampler's 1e-6 floor."""
    scaled = np.asarray(logits, np.float64) / np.float64(np.maximum(np.float32(temperature), np.float32(1e-6)))
    order = np.lexsort((np.arange(len(scaled)), -scaled))
    k = top_k if top_k > 0 else len(scaled)
    probs = np.exp(scaled[order[:k]] - scaled[order[0]])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept_ranks = before < top_p if top_p < 1 else np.ones(k, bool)
    kept = np.zeros(len(scaled), bool)
    kept[order[:k][kept_ranks]] = True
    return kept, top_p < 1 and bool(np.any(np.abs(before - top_p) < 1e-5))


def _mixed_rows(rng, rows, vocab, both=False):
    """Random logits (flat to peaked rows, and rows of few distinct values: ties) and a mix of greedy, temperature
    only, top-k only (1 to the vocabulary) and top-p only rows; `both`: some rows with top-k and top-p."""
    scale = rng.uniform(0.1, 5.0, size=(rows, 1))
    logits = rng.normal(size=(rows, vocab)) * scale
    ties = rng.random(rows) < 0.25
    logits[ties] = rng.integers(0, 4, size=(int(ties.sum()), vocab)) * scale[ties]
    kind = rng.integers(0, 4 + both, size=rows)
    temperature = np.where(kind == 0, 0.0, rng.uniform(0.3, 1.5, rows)).astype(np.float32)
    top_k = np.where((kind == 2) | (kind == 4), rng.choice([1, 2, 5, 40, vocab // 2, vocab], rows), 0)
    top_p = np.where((kind == 3) | (kind == 4), rng.choice([0.05, 0.5, 0.9, 0.95, 0.999], rows), 1.0)
    return (logits.astype(np.float32), temperature, top_k.astype(np.int32), top_p.astype(np.float32))


@pytest.mark.parametrize("both", [False, True], ids=["one_filter", "with_top_k_and_top_p"])
def test_rejection_draws_the_kept_tokens_gumbel_max(both):
    """_draw_by_rejection (no sort) against a float64 reference of the kept set: each row's token is the argmax of
    its float32 tempered logits plus noise over the kept tokens; rows with ties decide by id; greedy rows are
    decided; with the default rounds every row of this mix is decided (`both`: some rows with top-k and top-p, whose
    top-p renormalises over the top-k: the k-th value by a radix search)."""
    rng = np.random.default_rng(11 + both)
    logits, temperature, top_k, top_p = _mixed_rows(rng, 300, 400, both)
    noise = np.asarray(jax.random.gumbel(jax.random.PRNGKey(2), logits.shape, jnp.float32))
    token, decided = sampling._draw_by_rejection(jnp.asarray(logits), jnp.asarray(noise), jnp.asarray(temperature),
                                                 jnp.asarray(top_k), jnp.asarray(top_p))
    token, decided = np.asarray(token), np.asarray(decided)
    assert decided.all()
    checked = 0
    for r in range(len(logits)):
        if temperature[r] == 0:
            continue
        kept, ambiguous = _kept_reference(logits[r], temperature[r], top_k[r], top_p[r])
        if ambiguous:
            continue
        perturbed = logits[r] / np.maximum(temperature[r], np.float32(1e-6)) + noise[r]     # float32, as drawn
        assert token[r] == np.argmax(np.where(kept, perturbed, -np.inf)), f"row {r}"
        checked += 1
    assert checked > 150


def test_rows_still_open_go_to_the_sort():
    """After one round some rows are still open; _draw_filtered (what sample_rows' filtering path runs) gives every
    row the sorting path's token whether rejection decided the batch or the sort took it."""
    rng = np.random.default_rng(12)
    args = [jnp.asarray(a) for a in _mixed_rows(rng, 200, 300, both=True)]
    logits, temperature, top_k, top_p = args
    noise = jax.random.gumbel(jax.random.PRNGKey(3), logits.shape, jnp.float32)
    _, decided_once = sampling._draw_by_rejection(logits, noise, temperature, top_k, top_p, max_rounds=1)
    assert not np.asarray(decided_once).all()
    by_sort = np.asarray(sampling._draw(logits, noise, temperature, top_k, top_p, filtered=True))
    clear = np.array([not _kept_reference(*(np.asarray(a[r]) for a in args))[1] for r in range(len(by_sort))])
    draw = jax.jit(sampling._draw_filtered)
    np.testing.assert_array_equal(np.asarray(draw(logits, noise, temperature, top_k, top_p))[clear], by_sort[clear])
    forced = jax.jit(sampling._draw_filtered, static_argnames="max_rounds")(logits, noise, temperature, top_k,
                                                                            top_p, max_rounds=1)   # to the sort
    np.testing.assert_array_equal(np.asarray(forced), by_sort)
