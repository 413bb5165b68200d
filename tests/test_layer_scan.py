"""The repeated layer pattern under lax.scan (layer_scan.py) computes what the unrolled layers compute: the same
logits for forward, prefill and decode, the same caches, the same weights back from the stacks; and a decode step
compiles once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import Model, engine, generation, presets
from dsv4_jax.sampling import Sampling
from dsv4_jax.layer_scan import ScanPlan, StackedLayers, scan_plan, stack_layers, unstack_layers

# Tiny widths, 8 layers: 0-1 hash-routed (window, CSA), then (HCA, CSA) twice under the scan, then HCA and a
# window layer after it: the layers before, inside and after the scan all run.
CONFIG = presets.tiny().replace(n_layers=8, compress_ratios=(0, 4, 128, 4, 128, 4, 128, 0, 0))
SEQ = 140          # past the 128-token window and the first completed HCA entry (position 127)


def test_scan_plans_of_the_presets():
    assert scan_plan(presets.flash()) == ScanPlan(start=3, period=2, repeats=20)      # layers 3..42
    assert scan_plan(presets.pro()) == ScanPlan(start=3, period=2, repeats=29)        # layers 3..60
    assert scan_plan(presets.tiny()) is None                                         # nothing repeats
    assert scan_plan(CONFIG) == ScanPlan(start=2, period=2, repeats=2)
    assert scan_plan(presets.truncated(presets.flash(), 4)) is None


@pytest.fixture(scope="module")
def models():
    options = dict(dtype="float32", simulate_quant=False, max_seq_len=256, max_batch=2, prefill_chunk=64)
    unrolled = dsv4_jax.init_random(CONFIG, seed=3, **options)
    scanned = dsv4_jax.init_random(CONFIG, seed=3, scan_layers=True, **options)
    assert scanned.scan_layers and not unrolled.scan_layers
    return unrolled, scanned


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(5).integers(0, CONFIG.vocab_size, (2, SEQ)).astype(np.int32)


def _relative_error(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() / np.abs(b).max()


def test_stacked_weights_unstack_to_the_per_layer_ones(models):
    unrolled, scanned = models
    assert isinstance(scanned.params["layers"], StackedLayers)
    back = unstack_layers(scanned.params["layers"])
    assert len(back) == CONFIG.n_layers
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled.params["layers"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # The module of a scanned model holds the same weights, per layer.
    w = scanned.module.layers[4].attn.wo_b.weight[...]
    np.testing.assert_array_equal(np.asarray(w), np.asarray(unrolled.module.layers[4].attn.wo_b.weight[...]))


def test_stacking_consumes_only_when_asked():
    layers = [{"w": jnp.full((3,), float(i))} for i in range(6)]
    plan = ScanPlan(start=1, period=2, repeats=2)
    kept = stack_layers(layers, plan)
    assert not any(layer["w"].is_deleted() for layer in layers)
    np.testing.assert_array_equal(np.asarray(kept.phases[1]["w"][:, 0]), [2.0, 4.0])   # layers 2 and 4
    assert [float(t["w"][0]) for t in kept.before + kept.after] == [0.0, 5.0]
    consumed = stack_layers(layers, plan, consume=True)
    assert [layer["w"].is_deleted() for layer in layers] == [False, True, True, True, True, False]
    np.testing.assert_array_equal(np.asarray(consumed.phases[0]["w"][:, 0]), [1.0, 3.0])


def test_forward_logits_equal_the_unrolled_model(models, tokens):
    unrolled, scanned = models
    want = unrolled.forward(tokens)
    got = scanned.forward(tokens)
    assert _relative_error(got, want) < 1e-5          # the same float32 ops, differently fused


def test_prefill_decode_and_caches_equal_the_unrolled_model(models, tokens):
    unrolled, scanned = models
    prompt = SEQ - 12
    lengths = np.array([prompt, prompt - 7], np.int32)
    logits_u, state_u = unrolled.prefill(tokens[:, :prompt], lengths)
    logits_s, state_s = scanned.prefill(tokens[:, :prompt], lengths)
    assert isinstance(state_s.layers, StackedLayers)
    assert _relative_error(logits_s, logits_u) < 1e-5
    compiled = None
    for step in range(12):
        next_tokens = jnp.asarray(tokens[:, prompt + step])
        logits_u, state_u = unrolled.decode(next_tokens, state_u)
        logits_s, state_s = scanned.decode(next_tokens, state_s)
        assert _relative_error(logits_s, logits_u) < 1e-5, f"decode step {step}"
        if step == 1:
            compiled = engine.decode_step._cache_size()
    assert engine.decode_step._cache_size() == compiled, "the scanned decode step recompiled"
    caches = unstack_layers(state_s.layers)
    for layer, (got, want) in enumerate(zip(caches, state_u.layers, strict=True)):
        for field in dataclasses.fields(want):
            name = field.name
            for a, b in zip(jax.tree.leaves(getattr(got, name)), jax.tree.leaves(getattr(want, name)), strict=True):
                a, b = np.asarray(a), np.asarray(b)
                finite = np.isfinite(b)
                np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=f"layer {layer} {name}")
                assert np.abs(a[finite] - b[finite]).max() <= 1e-4 * max(1.0, np.abs(b[finite]).max()), \
                    f"layer {layer} {name}"


def test_scanned_decode_and_generation_never_touch_the_host(models, tokens):
    _, model = models
    logits, state = model.prefill(tokens[:1, :9])
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    _, state = model.decode(token, state)                     # compile outside the guard
    sampling = Sampling.rows(1, max_new_tokens=50, stop_tokens=[1])
    halt = jnp.zeros((1,), bool)
    kwargs = dict(cfg=model.config, ctx=model.context, max_seq_len=model.max_seq_len, chunk=8)
    gen = generation.start(model.prefill(tokens[:1, :9])[1], logits, sampling)[0]
    gen, out = generation.generate_chunk(model.params, gen, halt, **kwargs)
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            _, state = model.decode(token, state)
        gen, out = generation.generate_chunk(model.params, gen, halt, **kwargs)
    assert out.tokens.shape == (1, 8)


def test_a_model_takes_already_stacked_params(models):
    _, scanned = models
    again = Model(CONFIG, scanned.params, dtype="float32", simulate_quant=False)
    assert again.scan_layers and again.params["layers"] is scanned.params["layers"]
