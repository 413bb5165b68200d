"""The checks that let the float64 reference take the model's decisions (tests/shared_decisions.py) accept exactly
the decisions a rounding tie explains and reject everything else: a wrong rounding, a wrong value before it, a
selection that is not a tie. Synthetic records, no model."""

from __future__ import annotations

import numpy as np
import pytest

import reference_np as R
from shared_decisions import NOISE, ModelDecisions

SITE = "layers.1.attn.kv"


def _values(rng, shape=(3, 40, 128)):
    """Random values with a different magnitude per 64-block, float32-representable."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, shape[:-1] + (1,))
    return x.astype(np.float32).astype(np.float64)


def _model_side(x, rel_noise, rng, round_fn=lambda v: R.fp8_fake_quant(v, 64)):
    """What a float32 model would record: its value (x moved by float32-like noise) and its rounding of it."""
    value = (x * (1 + rel_noise * rng.standard_normal(x.shape))).astype(np.float32)
    return value, round_fn(value.astype(np.float64)).astype(np.float32)


def _near_ties(rng, n_blocks=512, block=64):
    """Blocks whose second element sits exactly on an e4m3 rounding midpoint (1.0625 between 1 and 1.125, in a
    block scaled so that amax 448 has scale 1): any noise decides which way it rounds."""
    x = rng.uniform(-1, 1, (n_blocks, block)) * 400
    x[:, 0] = 448.0
    x[:, 1] = 1.0625
    return x


def test_takes_decisions_that_float32_noise_flips():
    rng = np.random.default_rng(0)
    x = _near_ties(rng)
    value, rounded = _model_side(x, 1e-7, rng)
    decisions = ModelDecisions({SITE: (value, rounded)})
    got = decisions.fp8(SITE, x)
    np.testing.assert_array_equal(got, rounded)
    own = R.fp8_fake_quant(x, 64)
    flipped = int(np.sum(own != rounded))
    assert flipped > 0, "the noise must flip some ties for this test to mean anything"
    assert decisions.stats[SITE].taken == flipped
    assert np.all(np.isin(np.abs(got[:, 1]), [1.0, 1.125])), "a tie goes to one of its two neighbours"


def test_rejects_a_rounding_that_is_not_the_specs():
    rng = np.random.default_rng(1)
    x = _values(rng) * 10.0 ** rng.uniform(-3, 0, (3, 40, 128))   # spread within blocks: scale decides subnormals

    def round_half_away(v):     # e4m3 grid, but ties away from zero instead of to even
        nudged = v + np.sign(v) * np.abs(v) * 1e-9
        return R.fp8_fake_quant(nudged, 64)

    def block_32(v):
        return R.fp8_fake_quant(v, 32)

    for wrong in (round_half_away, block_32):
        value = x.astype(np.float32)
        if wrong is round_half_away:     # make sure ties exist for the half-away rounding to differ on
            value = _near_ties(rng).astype(np.float32)
        decisions = ModelDecisions({SITE: (value, wrong(value.astype(np.float64)).astype(np.float32))})
        with pytest.raises(AssertionError, match="rounding of its own values differs from the spec"):
            decisions.fp8(SITE, value.astype(np.float64))


def test_rejects_a_wrong_value_before_rounding():
    rng = np.random.default_rng(2)
    x = _values(rng)
    for rel in (1e-3, 10 * NOISE):
        value, rounded = _model_side(x, rel, rng)
        with pytest.raises(AssertionError, match="value before rounding differs from the reference"):
            ModelDecisions({SITE: (value, rounded)}).fp8(SITE, x)
    wrong_rope = x.copy()
    wrong_rope[..., -32:] *= -1     # e.g. the rotation of the last dims with the wrong sign
    value, rounded = _model_side(wrong_rope, 0.0, rng)
    with pytest.raises(AssertionError, match="value before rounding differs"):
        ModelDecisions({SITE: (value, rounded)}).fp8(SITE, x)


def test_fp4_site_and_incomplete_compressor_rows():
    """FP4 sites check the same way; compressor sites also round windows not complete yet (extra rows), which
    are ignored."""
    rng = np.random.default_rng(3)
    x = _values(rng, (2, 10, 64))
    value, rounded = _model_side(x, 1e-7, rng, lambda v: R.fp4_fake_quant(v, 32))
    extra = np.full((2, 3, 64), np.nan, np.float32)
    record = (np.concatenate([value, extra], 1), np.concatenate([rounded, extra], 1))
    site = "layers.1.attn.indexer.compressor"
    got = ModelDecisions({site: record}).fp4(site, x)
    np.testing.assert_array_equal(got, rounded)
    with pytest.raises(AssertionError, match="rounding of its own values differs"):
        wrong = R.fp8_fake_quant(value.astype(np.float64), 64).astype(np.float32)
        ModelDecisions({site: (value, wrong)}).fp4(site, x)


def _router_record(ids):
    return (None, (np.asarray(ids, np.int32), None))


def test_top_k_takes_ties_and_rejects_other_picks():
    rng = np.random.default_rng(4)
    site = "layers.2.ffn.gate"
    scores = rng.uniform(0, 1, (6, 8))
    scores[0, [2, 5]] = [0.9, 0.9 * (1 + 1e-7)]          # row 0: a tie for the second place
    scores[0, [0, 1, 3, 4, 6, 7]] = np.linspace(0.1, 0.3, 6)
    scores[0, 1] = 0.95
    own = R.SpecDecisions().top_k(site, scores, 2)
    assert set(np.nonzero(own[0])[0]) == {1, 5}
    model_ids = np.array([np.nonzero(row)[0] for row in own])
    model_ids[0] = [1, 2]                                  # the other side of the tie
    decisions = ModelDecisions({site: _router_record(model_ids)})
    picked = decisions.top_k(site, scores, 2)
    assert set(np.nonzero(picked[0])[0]) == {1, 2}
    assert decisions.stats[site].taken == 1

    model_ids[0] = [1, 3]                                  # 0.14 is nowhere near the second-best 0.9
    with pytest.raises(AssertionError, match="not tied with the k-th best"):
        ModelDecisions({site: _router_record(model_ids)}).top_k(site, scores, 2)


def test_indexer_selection_respects_visibility():
    """Invisible entries (-inf) are never a legitimate pick, and each row picks min(k, visible) entries."""
    site = "layers.1.attn.indexer"
    scores = np.array([[[0.5, -np.inf, -np.inf], [0.2, 0.7, -np.inf]]])     # [B=1, S=2, N=3]
    idx = np.array([[[0, 1], [1, 0]]])
    valid = np.array([[[True, False], [True, True]]])
    got = ModelDecisions({site: (None, (idx, valid))}).top_k(site, scores, 2)
    np.testing.assert_array_equal(got, [[[True, False, False], [True, True, False]]])
    with pytest.raises(AssertionError, match="does not allow"):
        ModelDecisions({site: (None, (idx, np.ones_like(valid)))}).top_k(site, scores, 2)
