"""Compact decode-state entries (kv_cache_dtype="fp8", dsv4_jax/numerics/kv_cache.py): exact for values on the training
roundings' grids, the same logits as the activation-dtype caches under simulate_quant, half the bytes per token."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsv4_jax
from dsv4_jax import presets
from dsv4_jax.numerics import kv_cache
from dsv4_jax.numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard
from dsv4_jax.state import state_bytes


def _blocks_with_edge_maxima(rng, n_blocks: int, block: int, edges: list[float]) -> np.ndarray:
    """Random blocks; in some, the largest magnitude sits just above a value where rounding halves the block's
    power-of-two scale (224 of 448 for e4m3, 3 of 6 for e2m1), times a random power of two."""
    x = rng.standard_normal((n_blocks, block)) * 2.0 ** rng.integers(-20, 20, (n_blocks, 1))
    for i, edge in enumerate(edges * 8):
        scale = 2.0 ** rng.integers(-20, 20)
        x[i] = rng.uniform(-edge, edge, block) * scale / 2
        x[i, rng.integers(block)] = edge * (1 + 1e-3 * rng.random()) * scale * rng.choice([-1, 1])
    x[-1] = 0.0                                                 # an all-zero block
    return x.astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_grid_entries_are_stored_exactly(dtype):
    rng = np.random.default_rng(0)
    nope, rope = 448, 64
    kv = _blocks_with_edge_maxima(rng, 7 * 64, 64, [224.0, 240.0, 448.0]).reshape(64, 7 * 64)
    kv = np.concatenate([kv, rng.standard_normal((64, rope)).astype(np.float32)], axis=-1)
    rounded = jnp.concatenate([fp8_fake_quant(jnp.asarray(kv[:, :nope])), jnp.asarray(kv[:, nope:])], -1)
    rounded = rounded.astype(dtype)
    like = kv_cache.empty((64,), nope + rope, rope, dtype, "kv", "fp8")
    back = like.encode(rounded).decode(dtype)
    assert back.dtype == dtype and np.array_equal(np.asarray(back), np.asarray(rounded))

    keys = _blocks_with_edge_maxima(rng, 4 * 64, 32, [3.0, 3.4, 6.0]).reshape(64, 128)
    rounded = fp4_fake_quant(hadamard(jnp.asarray(keys))).astype(dtype)
    like = kv_cache.empty((64,), 128, rope, dtype, "index", "fp8")
    stored = like.encode(rounded)
    assert stored.fp4.shape == (64, 64) and stored.scale.shape == (64, 4)
    assert np.array_equal(np.asarray(stored.decode(dtype)), np.asarray(rounded))


def test_off_grid_entries_round_like_the_training_rounding():
    """Without simulate_quant the stored values are the block rounding of the entries (saturating, RNE)."""
    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.standard_normal((16, 512)) * 3, jnp.float32)
    like = kv_cache.empty((16,), 512, 64, jnp.float32, "kv", "fp8")
    back = like.encode(kv).decode(jnp.float32)
    assert np.array_equal(np.asarray(back[:, :448]), np.asarray(fp8_fake_quant(kv[:, :448])))
    assert np.array_equal(np.asarray(back[:, 448:]), np.asarray(kv[:, 448:]))


def test_flash_state_halves_per_token():
    cfg = presets.flash()
    per_token = {k: (state_bytes(cfg, 1, 2 ** 17, kv_cache_dtype=k) - state_bytes(cfg, 1, 2 ** 16,
                                                                                   kv_cache_dtype=k)) / 2 ** 16
                 for k in (None, "fp8")}
    assert per_token[None] == 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128          # 6,880
    # e4m3 nope + E8M0 per 64 + bf16 rope, and packed e2m1 + E8M0 per 32 indexer keys
    fp8_entry, index_entry = 448 + 448 // 64 + 64 * 2, 128 // 2 + 128 // 32
    assert per_token["fp8"] == 21 * (fp8_entry + index_entry) / 4 + 20 * fp8_entry / 128
    assert per_token["fp8"] <= 3600
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        state_bytes(cfg, 1, 4096, kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_caches_give_the_same_logits(dtype):
    """Prefill across the 128 window and both compression ratios (in chunks of 48), then decode steps: every logit
    equals the activation-dtype caches' bit for bit, and so do the greedy tokens."""
    options = dict(dtype=dtype, max_seq_len=384, prefill_chunk=48)
    plain, compact = dsv4_jax.load(**options), dsv4_jax.load(kv_cache_dtype="fp8", **options)
    tokens = np.random.default_rng(2).integers(0, plain.config.vocab_size, (1, 300)).astype(np.int32)
    outs = []
    for model in (plain, compact):
        logits, state = model.prefill(tokens)
        steps = [logits]
        for t in np.random.default_rng(3).integers(0, model.config.vocab_size, 6):
            logits, state = model.decode(np.array([t], np.int32), state)
            steps.append(logits)
        outs.append(np.asarray(jnp.stack(steps)))
        if model is compact:
            assert compact.state_bytes() < plain.state_bytes()
            assert state.layers[1].window_kv.nope.dtype == jnp.float8_e4m3fn
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0], outs[1])
    ids = [int(t) for t in tokens[0, :40]]
    assert plain.generate([ids], max_new_tokens=12).tokens == compact.generate([ids], max_new_tokens=12).tokens


def test_fp8_caches_without_simulated_quantization_stay_close():
    options = dict(dtype="float32", max_seq_len=384, prefill_chunk=64, simulate_quant=False)
    tokens = np.random.default_rng(4).integers(0, 4096, (1, 260)).astype(np.int32)
    plain = np.asarray(dsv4_jax.load(**options).prefill(tokens)[0])
    compact = np.asarray(dsv4_jax.load(kv_cache_dtype="fp8", **options).prefill(tokens)[0])
    assert np.isfinite(compact).all() and not np.array_equal(plain, compact)       # stored rounded
    assert np.abs(compact - plain).max() < 0.1 * np.abs(plain).max()
