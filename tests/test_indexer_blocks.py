"""The Lightning indexer beyond INDEXER_BLOCK compressed entries: scores formed a block at a time with a running
top-k pick exactly what one top_k over all entries picks (ties to the lower index), and a prefill chunk's memory no
longer grows with the context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.ops import indexer as attention
from dsv4_jax import engine, presets
from dsv4_jax.ops.norm_rope import rope_inv_freq
from dsv4_jax.params import init_params
from dsv4_jax.run_context import RunContext
from dsv4_jax.state import init_state


@pytest.mark.parametrize("n_entries", [100, 96])           # a partial last block, and whole blocks
def test_blocked_top_k_picks_what_one_top_k_picks(monkeypatch, n_entries):
    monkeypatch.setattr(attention, "INDEXER_BLOCK", 16)
    rng = np.random.default_rng(n_entries)
    B, S, H, D, k = 2, 9, 3, 8, 6
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
    keys = rng.standard_normal((B, n_entries, D)).astype(np.float32)
    keys[:, 40] = keys[:, 3]                                # exact ties across blocks: the lower index must win
    keys[:, 71] = keys[:, 70]                               # and within one
    keys = jnp.asarray(keys)
    head_weights = jnp.asarray(rng.uniform(0.1, 1.0, (B, S, H)), jnp.float32)
    positions = jnp.asarray(np.stack([np.arange(S) * 37 + 3, np.arange(S) * 11 + 300]), jnp.int32)
    got_scores, got_idx = jax.jit(attention._blocked_top_k, static_argnums=4)(q, head_weights, keys, positions, k)
    # float64 numpy: scores of every entry, invisible ones -inf, a stable descending sort (ties: lower index)
    dots = np.einsum("bshd,bnd->bshn", np.asarray(q, np.float64), np.asarray(keys, np.float64))
    scores = np.einsum("bshn,bsh->bsn", np.maximum(dots, 0), np.asarray(head_weights, np.float64))
    visible = np.arange(n_entries)[None, None, :] < ((np.asarray(positions) + 1) // 4)[:, :, None]
    scores = np.where(visible, scores, -np.inf)
    want_idx = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    want_scores = np.take_along_axis(scores, want_idx, -1)
    valid = np.isfinite(want_scores)
    assert (np.isfinite(np.asarray(got_scores)) == valid).all()
    assert not valid.all() and valid.any(), "the positions must leave some queries with fewer than k visible"
    np.testing.assert_array_equal(np.asarray(got_idx)[valid], want_idx[valid])
    # float32 dots of 8 terms can cancel to a small score, so the bound is on the terms' size, not the score's
    term_scale = np.einsum("bshd,bnd->bsn", np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(keys, np.float64)))
    np.testing.assert_allclose(np.asarray(got_scores)[valid], want_scores[valid], rtol=1e-5,
                               atol=1e-6 * term_scale.max())


def test_indexer_block_grows_while_the_scores_stay_bounded():
    """A decode step scores a 1M-token context (262,144 entries) in one pass; a 512-token prefill chunk keeps
    INDEXER_BLOCK; the scores of one block never pass INDEXER_SCORE_BYTES unless at INDEXER_BLOCK."""
    heads = presets.flash().index_n_heads
    assert attention.indexer_block(1, 1, heads) >= 262144
    assert attention.indexer_block(1, 512, heads) == attention.INDEXER_BLOCK
    for batch, seq in [(1, 1), (8, 1), (64, 4), (4, 64), (1, 512)]:
        block = attention.indexer_block(batch, seq, heads)
        assert block == attention.INDEXER_BLOCK or batch * seq * heads * 4 * block <= attention.INDEXER_SCORE_BYTES
        assert batch * seq * heads * 4 * 2 * block > attention.INDEXER_SCORE_BYTES       # the largest that fits


def test_indexer_select_takes_the_blocks_beyond_one_block(monkeypatch):
    """indexer_select of the tiny model's CSA layer over 300 positions (75 entries): with blocks of 16 the same
    picks as with one block (random inputs: no float32 near-ties)."""
    cfg = presets.tiny()
    params = init_params(cfg, jax.random.PRNGKey(4))["layers"][1]["attn"]["indexer"]
    rng = np.random.default_rng(67)
    B, S = 1, 300
    x = jnp.asarray(rng.standard_normal((B, S, cfg.dim)), jnp.float32)
    q_latent = jnp.asarray(rng.standard_normal((B, S, cfg.q_lora_rank)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, S // 4, cfg.index_head_dim)), jnp.float32)
    positions = jnp.arange(S, dtype=jnp.int32)[None]
    ctx = RunContext.create(dtype="float32", kernels="reference")
    inv_freq = rope_inv_freq(cfg, 4)

    def select():
        return jax.jit(lambda *a: attention.indexer_select(params, cfg, *a, inv_freq, ctx))(x, q_latent, positions,
                                                                                          keys)
    one_idx, one_valid = select()
    # the valid picks come first, as many as the visible entries (at most k): a decode step's attention masks the
    # picks by their place alone (attention._attend_one_token)
    visible = (np.asarray(positions) + 1) // 4
    np.testing.assert_array_equal(np.asarray(one_valid),
                                  np.arange(one_valid.shape[-1])[None, None, :] < visible[:, :, None])
    monkeypatch.setattr(attention, "INDEXER_BLOCK", 16)
    monkeypatch.setattr(attention, "INDEXER_SCORE_BYTES", 0)           # blocks of exactly 16
    idx, valid = select()
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(one_valid))
    np.testing.assert_array_equal(np.asarray(idx)[np.asarray(valid)], np.asarray(one_idx)[np.asarray(one_valid)])


@pytest.mark.slow
def test_prefill_chunk_memory_does_not_grow_with_the_context():
    """A 2-layer Flash-geometry model (CSA + HCA), prefill chunk of 512, compiled on the CPU from abstract
    arguments: the temporaries at max_seq_len 2^20 exceed those at 4096 by less than 2 GiB. Measured 2026-12-02
    (2-core CPU, reference kernels): 32.38 GiB at 4K, 128K and 1M with the blocked indexer; 32.38 / 34.65 /
    90.62 GiB when the indexer scores every entry at once."""
    cfg = presets.flash().replace(n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1)
    ctx = RunContext.create(kernels="reference")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    temp = {}
    for max_seq_len in (4096, 2 ** 20):
        state = jax.eval_shape(lambda: init_state(cfg, 1, max_seq_len, jnp.bfloat16))
        compiled = engine.prefill_chunk.trace(
            params, state, jax.ShapeDtypeStruct((1, 512), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32), cfg=cfg, ctx=ctx).lower().compile()
        temp[max_seq_len] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[2 ** 20] - temp[4096] < 2 * 2 ** 30, {k: v / 2 ** 30 for k, v in temp.items()}
