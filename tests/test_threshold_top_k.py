"""ops/threshold_top_k: the k largest of each row without a sort, against a float64 numpy reference (a stable sort
by descending value, +0.0 before -0.0, ties to the lower index), with ties, -inf entries (the indexer's invisible
ones), signed zeros and k from 1 to the whole row; and its set against lax.top_k's (on this backend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.ops.threshold_top_k import kth_largest_key, order_keys, threshold_top_k


def _reference(values: np.ndarray, k: int) -> np.ndarray:
    """float64: each row's k largest indices (descending value, +0.0 before -0.0, ties by ascending index), in
    ascending order."""
    out = []
    for row in np.asarray(values, np.float64).reshape(-1, values.shape[-1]):
        order = np.lexsort((np.arange(len(row)), np.signbit(row), -row))
        out.append(np.sort(order[:k]))
    return np.array(out).reshape(values.shape[:-1] + (k,))


def _scores(rng, shape):
    """Scores as the indexer's: continuous values, rows of few distinct values (ties), -inf tails of random
    length (invisible entries), and some exact zeros of either sign."""
    values = rng.normal(size=shape).astype(np.float32)
    flat = values.reshape(-1, shape[-1])
    for r in range(flat.shape[0]):
        if r % 3 == 1:
            flat[r] = rng.integers(-2, 3, size=shape[-1])
        flat[r, rng.integers(0, shape[-1]):] = -np.inf
        zeros = rng.random(shape[-1]) < 0.05
        flat[r, zeros] = np.where(rng.random(int(zeros.sum())) < 0.5, -0.0, 0.0)
    return values


@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_the_picks_are_the_k_largest(k):
    values = _scores(np.random.default_rng(k), (2, 9, 300))
    got_values, got_idx = jax.jit(threshold_top_k, static_argnums=1)(jnp.asarray(values), k)
    want = _reference(values, k)
    np.testing.assert_array_equal(np.asarray(got_idx), want)
    np.testing.assert_array_equal(np.asarray(got_values), np.take_along_axis(values, want, axis=-1))


def test_the_set_is_lax_top_ks():
    values = _scores(np.random.default_rng(5), (4, 50, 500))
    _, idx = threshold_top_k(jnp.asarray(values), 37)
    _, top_idx = jax.lax.top_k(jnp.asarray(values), 37)
    np.testing.assert_array_equal(np.asarray(idx), np.sort(np.asarray(top_idx), axis=-1))


@pytest.mark.parametrize("bits_per_pass", [1, 2, 4, 8])
def test_kth_largest_key_at_each_digit_width(bits_per_pass):
    """The k-th largest value of each row, a k per row from 1 to the whole row, against float64 numpy: the same
    value whatever number of bits each pass settles (1 is plain bisection)."""
    rng = np.random.default_rng(bits_per_pass)
    values = _scores(rng, (12, 257))
    k = rng.integers(1, 258, size=12).astype(np.int32)
    k[:2] = (1, 257)
    key = jax.jit(kth_largest_key, static_argnums=2)(order_keys(jnp.asarray(values)), jnp.asarray(k), bits_per_pass)
    want = [np.sort(np.asarray(row, np.float64))[::-1][kk - 1] for row, kk in zip(values, k)]
    got = np.asarray(key)
    # the key back to its float32 value (order_keys inverted), compared as values: -0.0 and +0.0 may both be the
    # k-th of a row, and which one is the k-th largest in order_keys' order is checked through test_the_picks
    bits = np.where(got >> 31 == 1, got & 0x7FFFFFFF, ~got).astype(np.uint32)
    np.testing.assert_array_equal(bits.view(np.float32).astype(np.float64), want)


def test_a_digit_width_that_does_not_divide_32_is_refused():
    with pytest.raises(ValueError, match="bits_per_pass must be 1, 2, 4 or 8"):
        kth_largest_key(jnp.zeros((2, 5), jnp.uint32), 1, 3)


def test_k_outside_the_row_is_refused():
    with pytest.raises(ValueError, match=r"k must lie in \[1, 5\]"):
        threshold_top_k(jnp.zeros((2, 5)), 6)


def test_model_prefill_takes_it_and_equals_the_reference_plan():
    """The tiny preset, float32, a 700-token prompt (up to 175 visible entries) picking index_topk = 48 of them: on
    the interpret plan with only the indexer's top-k switched (every other op on the reference) every CSA layer's
    prefill picks come from the threshold select, and the logits equal the reference plan's (same picks; the
    attention's sums over them in another order)."""
    from dsv4_jax import presets
    from one_op_prefill import one_op_prefill

    cfg = presets.tiny().replace(index_topk=48)
    prefill = one_op_prefill(cfg, "indexer_top_k", seed=4, max_seq_len=1024)
    err, choices = prefill(np.random.default_rng(9).integers(0, cfg.vocab_size, (1, 700)).astype(np.int32))
    assert choices and {(c.kernel, c.path) for c in choices if c.phase == "prefill"} == {("threshold_top_k",
                                                                                         "interpret")}, choices
    assert err < 1e-5, err
