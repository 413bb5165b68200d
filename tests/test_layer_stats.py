"""Per-layer statistics computed on the device (RunContext.stats, ops/layer_stats.py, stats_report.py): the values
against a float64 reference of the spec, padding left out, the failures they exist for injected and flagged at the
right layer and sub-layer, a healthy model flagged nowhere, and no transfer or traced op added."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_np import reference_forward_hidden, softplus, sub

import dsv4_jax
from dsv4_jax import engine, presets, stats_report
from dsv4_jax.numerics.formats import Fp8BlockWeight, Mxfp4Weight
from dsv4_jax.ops import layer_stats
from dsv4_jax.ops import matmul as matmul_module

SEQ = 150          # crosses the 128-token window, completes CSA entries and one HCA entry


@pytest.fixture(scope="module")
def default_f32():
    return dsv4_jax.load(dtype="float32", max_batch=2, max_seq_len=512)


@pytest.fixture(scope="module")
def prompt(default_f32):
    return np.random.default_rng(7).integers(2, default_f32.config.vocab_size, (1, SEQ)).astype(np.int32)


def _rms(a, axes):
    return np.sqrt(np.mean(np.square(a), axis=axes))


def test_forward_stats_match_a_float64_reference(tiny_checkpoint):
    """Every measure of every layer against the same measure taken from the float64 reference's intermediates."""
    directory, weights = tiny_checkpoint
    model = dsv4_jax.load(directory, dtype="float32", simulate_quant=False)
    cfg = model.config
    tokens = np.random.default_rng(11).integers(0, cfg.vocab_size, (1, SEQ)).astype(np.int32)
    logits, summary = model.forward(tokens, stats=True)
    assert np.array_equal(np.asarray(logits), np.asarray(model.forward(tokens)))     # the model is unchanged
    s = jax.device_get(summary)
    assert float(s["calls"]) == 1 and float(s["tokens"]) == SEQ
    trace: dict = {}
    _, streams = reference_forward_hidden(cfg, weights, tokens, simulate_quant=False, return_layers=True, trace=trace)
    every = (0, 1, 2, 3)
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        ours = {k: float(v[layer]) for k, v in s["sum"].items()}
        mid, out = trace[p + "mid"], trace[p + "out"]
        post_comb = [trace[p + n] for n in ("hc_attn_post", "hc_attn_comb", "hc_ffn_post", "hc_ffn_comb")]
        scores = np.sqrt(softplus(trace[p + "ffn_in"] @ sub(weights, p + "ffn.gate.")["weight"].T))
        probs = scores / scores.sum(-1, keepdims=True)
        expected = {
            "in_resid_rms": _rms(streams[layer], every), "in_resid_max": np.abs(streams[layer]).max(),
            "attn_resid_rms": _rms(mid, every), "attn_resid_max": np.abs(mid).max(),
            "moe_resid_rms": _rms(out, every), "moe_resid_max": np.abs(out).max(),
            "attn_out_rms": _rms(trace[p + "attn_out"], (0, 1, 2)),
            "moe_out_rms": _rms(trace[p + "ffn_out"], (0, 1, 2)),
            "mix_min": min(w.min() for w in post_comb), "mix_max": max(w.max() for w in post_comb),
            "router_entropy": np.mean(-np.sum(probs * np.log(probs), axis=-1)),
        }
        for key, value in expected.items():
            # float32 against float64: streams of size ~1-30 agree to ~1e-5 relative; the smallest mixing weights
            # (~1e-8, after 20 Sinkhorn rounds) to an absolute ~1e-7
            np.testing.assert_allclose(ours[key], value, rtol=2e-4, atol=1e-6, err_msg=f"layer {layer} {key}")
        ratio = cfg.compress_ratios[layer]
        t = np.arange(SEQ)
        if ratio == 4:
            entries = (trace[p + "attn.index_selected"] & (np.arange(SEQ // 4)[None, :] < ((t + 1) // 4)[:, None])
                       ).sum(-1).mean()
        elif ratio:
            entries = np.minimum((t + 1) // ratio, SEQ // ratio).mean()
        else:
            entries = 0.0
        np.testing.assert_allclose(ours["entries_attended"], entries, rtol=1e-6, err_msg=f"layer {layer}")
        load = np.bincount(trace[p + "router_idx"].reshape(-1), minlength=cfg.n_routed_experts)
        # a top-k decision within float32 rounding of a tie could move one assignment between two experts
        assert np.abs(s["count"]["expert_load"][layer] - load).sum() <= 2, f"layer {layer}"
        for key in ("attn_nonfinite", "moe_nonfinite", "attn_quant_blocks", "moe_quant_blocks"):
            assert s["count"][key][layer] == 0, (layer, key)          # act_quant="none": no block quantized


def test_padding_and_inactive_rows_do_not_count(default_f32):
    """A prefill of two rows, one padded: the statistics are those of the real tokens whatever the padding holds
    (poisoned with other ids, then with the same ids), and the token count is the real tokens'."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(2, default_f32.config.vocab_size, (2, 40)).astype(np.int32)
    lengths = np.array([40, 23], np.int32)
    summaries = []
    for fill in (rng.integers(2, 4096, 17), np.full(17, 5)):
        padded = tokens.copy()
        padded[1, 23:] = fill
        _, _, summary = default_f32.prefill(padded, lengths, stats=True)
        summaries.append(jax.device_get(summary))
    a, b = summaries
    assert float(a["tokens"]) == 63 and float(a["calls"]) == 1
    for group in ("sum", "max", "min", "count"):
        for key in a[group]:
            np.testing.assert_allclose(a[group][key], b[group][key], rtol=1e-6, err_msg=f"{group} {key}")
    cfg = default_f32.config
    np.testing.assert_array_equal(a["count"]["expert_load"].sum(-1),
                                  np.full(cfg.n_layers, 63 * cfg.n_activated_experts))


def test_quantization_tallies_against_numpy():
    """The block-scale tallies of both activation quantizers on rows with planted blocks, against numpy."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 80)).astype(np.float32)             # K = 80: a trailing partial block of each kind
    x[1, 16:32] = 1e-12                                          # NVFP4: underflows (ratio < 2^-9)
    x[2, :] = 0.0                                                # an all-zero row: no data, not counted
    x[3, :] = 1e-6                                               # FP8: under the 1e-4 floor
    gs = np.maximum(np.abs(x).max(-1, keepdims=True), 6 * 448 * 2.0 ** -126) / (6 * 448)   # floored as the model's
    gs[4] /= 1000                                                # a global scale 1000x too small: blocks saturate
    with layer_stats.collecting() as taps:
        layer_stats.tap_nvfp4(jnp.asarray(x), jnp.asarray(gs, jnp.float32))
        layer_stats.tap_fp8(jnp.asarray(x))
    nv, f8 = (jax.device_get(t) for t in taps)
    live = np.abs(x).max(-1) > 0
    xb = np.pad(x, ((0, 0), (0, 16 * 5 - 80))).reshape(6, 5, 16)
    ratio = (np.abs(xb).max(-1) / (6 * gs.astype(np.float64)))[live]
    assert nv["blocks"] == 25
    assert nv["saturated"] == np.sum(ratio > 448 * (1 + 1e-5)) == 5          # row 4: every block
    assert nv["underflow"] == np.sum((ratio > 0) & (ratio < 2.0 ** -9)) == 1  # row 1's planted block
    np.testing.assert_allclose([nv["scale_min"], nv["scale_max"]], [gs[live].min(), gs[live].max()], rtol=1e-6)
    fb = np.pad(x, ((0, 0), (0, 128 - 80))).reshape(6, 1, 128)[live]
    assert f8["blocks"] == 5 and f8["saturated"] == 0
    assert f8["underflow"] == np.sum(np.abs(fb).max(-1) < 1e-4) == 1
    assert np.isinf(f8["scale_min"]) and np.isinf(f8["scale_max"])


def test_summaries_merge_as_mean_max_min_and_sum():
    rng = np.random.default_rng(9)
    records = [{**{k: jnp.asarray(rng.normal(size=3), jnp.float32) for k in layer_stats.VALUE_KEYS},
                **{k: jnp.asarray(rng.integers(0, 9, size=(3, 4) if k == "expert_load" else 3), jnp.float32)
                   for k in layer_stats.COUNT_KEYS}} for _ in range(3)]
    total = layer_stats.empty(3, 4)
    for record, tokens in zip(records, (5, 0, 2), strict=True):       # the second call had no real token
        total = layer_stats.merge(total, layer_stats.summarize(record, jnp.int32(tokens)))
    kept = [records[0], records[2]]
    assert float(total["calls"]) == 2 and float(total["tokens"]) == 7
    for k in layer_stats.VALUE_KEYS:
        np.testing.assert_allclose(total["sum"][k], kept[0][k] + kept[1][k], rtol=1e-6)
        np.testing.assert_array_equal(total["max"][k], np.maximum(kept[0][k], kept[1][k]))
        np.testing.assert_array_equal(total["min"][k], np.minimum(kept[0][k], kept[1][k]))
    for k in layer_stats.COUNT_KEYS:
        np.testing.assert_array_equal(total["count"][k], kept[0][k] + kept[1][k])


def test_stats_off_traces_none_of_it(default_f32, monkeypatch):
    """With stats off no statistic is traced: the programs lower with every measuring function made to fail (the
    StableHLO is the same as before the feature: docs/debugging.md shows the comparison)."""
    def refuse(*_, **__):
        raise AssertionError("a statistic was traced with stats off")
    for name in ("streams_record", "mix_record", "router_record", "quant_record", "entries_record", "summarize",
                 "tap_fp8", "tap_nvfp4", "empty", "stack_layers"):
        monkeypatch.setattr(layer_stats, name, refuse)
    m = default_f32
    state = m.init_state(1)
    tokens = jnp.zeros((1, 8), jnp.int32)
    engine.prefill_chunk.lower(m.params, state, tokens, jnp.full((1,), 8, jnp.int32), jnp.zeros((1, 4096)),
                               cfg=m.config, ctx=m.context)
    engine.decode_step.lower(m.params, state, jnp.zeros((1,), jnp.int32), cfg=m.config, ctx=m.context,
                             max_seq_len=m.max_seq_len)
    for act_quant in ("fp8", "nvfp4"):
        engine.forward.lower(m.params, tokens, cfg=m.config, ctx=m.context.replace(act_quant=act_quant))
    with pytest.raises(AssertionError, match="traced with stats off"):      # and the switch does reach them
        engine.forward.lower(m.params, tokens, cfg=m.config, ctx=m.context.replace(stats=True))


def test_generate_with_stats_reads_nothing_more(default_f32, monkeypatch):
    """generate(stats=True) runs under transfer_guard("disallow") with as many device reads as without, gives the
    same tokens, and reports over the generated tokens' steps."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    default_f32.generate(prompts, max_new_tokens=20, stats=True)       # compile outside the guard
    default_f32.generate(prompts, max_new_tokens=20)
    reads = []
    real_get = jax.device_get

    def counting_get(x):                 # a read is a call with device arrays in it (a report of host values is none)
        if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
            reads.append(1)
        return real_get(x)
    monkeypatch.setattr(jax, "device_get", counting_get)
    counts = {}
    with jax.transfer_guard("disallow"):
        for stats in (False, True):
            reads.clear()
            result = default_f32.generate(prompts, max_new_tokens=20, stats=stats)
            counts[stats] = (len(reads), result)
    assert counts[True][0] == counts[False][0] > 0
    plain, measured = counts[False][1], counts[True][1]
    assert measured.tokens == plain.tokens and plain.stats is None
    rep = measured.stats
    assert rep.calls == 19 and rep.tokens == 2 * 19        # the first token comes from the prefill
    assert measured.prompt_stats.tokens == 9 and measured.prompt_stats.calls == 1
    assert not rep.flags and not measured.prompt_stats.flags
    assert "no layer flagged" in rep.table()
    json.dumps(rep.to_json())


def test_cli_prints_the_tables_and_puts_them_in_json(capsys):
    from dsv4_jax import generate as cli
    assert cli.main(["--prompt", "The capital of France", "--max-new-tokens", "5", "--dtype", "float32",
                     "--stats", "--json"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    doc = json.loads(out)
    n_layers = dsv4_jax.load().config.n_layers
    assert doc["stats"]["prompt"]["calls"] == 1 and len(doc["stats"]["prompt"]["layers"]) == n_layers
    assert doc["stats"]["generated"]["tokens"] == 4 and doc["stats"]["generated"]["flags"] == []
    assert err.count("layer statistics over") == 2 and err.count("no layer flagged") == 2, err


def test_e8m0_scale_read_as_a_number_is_flagged_at_its_layer(default_f32, prompt):
    """One expert's E8M0 scale bytes taken as plain numbers (2^(e-127) -> e, about x2^13 here): the layer that holds
    it is flagged in its MoE, and no earlier layer is."""
    m = default_f32
    _, summary = m.forward(prompt, stats=True)
    healthy = stats_report.report(summary, m.config)
    assert not healthy.flags, healthy.table()
    layer = 2
    expert = int(np.argmax(healthy.layers[layer]["expert_load"]))           # the expert most tokens pick
    params = jax.tree.map(lambda a: a, m.params, is_leaf=lambda a: isinstance(a, (Mxfp4Weight, Fp8BlockWeight)))
    params["layers"] = list(params["layers"])
    experts = dict(params["layers"][layer]["ffn"]["experts"])
    w2 = experts["w2"]["weight"]
    e = np.asarray(w2.scale[expert]).astype(np.float64)
    misread = np.clip(np.round(127 + np.log2(e)), 0, 254).astype(np.uint8)   # the byte whose value is ~e
    experts["w2"] = {"weight": Mxfp4Weight(w2.packed, w2.scale.at[expert].set(misread))}
    params["layers"][layer] = {**params["layers"][layer], "ffn": {**params["layers"][layer]["ffn"], "experts": experts}}
    broken = dsv4_jax.Model(m.config, params, settings=m.settings)
    _, summary = broken.forward(prompt, stats=True)
    rep = stats_report.report(summary, m.config)
    assert (layer, "moe") in rep.flagged, rep.table()
    assert min(f.layer for f in rep.flags) == layer
    assert any("residual jump" in f.reason for f in rep.flags if f.layer == layer)


def test_zeroed_attention_output_is_flagged_at_its_layer(default_f32, prompt):
    m = default_f32
    layer = 3
    params = dict(m.params)
    params["layers"] = list(params["layers"])
    attn = dict(params["layers"][layer]["attn"])
    wo_b = attn["wo_b"]["weight"]
    attn["wo_b"] = {"weight": Fp8BlockWeight(wo_b.weight, jnp.zeros_like(wo_b.scale))}   # E8M0 byte 0 = 2^-127
    params["layers"][layer] = {**params["layers"][layer], "attn": attn}
    _, summary = dsv4_jax.Model(m.config, params, settings=m.settings).forward(prompt, stats=True)
    rep = stats_report.report(summary, m.config)
    assert rep.flagged == {(layer, "attention")}, rep.table()
    assert "output vanished" in rep.flags[0].reason


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    from ckpt_writer import write_checkpoint
    directory = tmp_path_factory.mktemp("nvfp4_stats")
    write_checkpoint(str(directory), presets.tiny(), seed=3, num_shards=1, expert_format="nvfp4")
    return str(directory)


def test_checkpoint_input_scale_as_nvfp4_global_scale_is_flagged(nvfp4_checkpoint, monkeypatch):
    """Under act_quant="nvfp4" the experts' activation global scale taken from the checkpoint's FP8-calibrated
    input_scale: every layer's MoE is flagged for saturating block scales; the live global scale flags nothing."""
    from dsv4_jax.numerics.formats import Nvfp4Weight
    model = dsv4_jax.load(nvfp4_checkpoint, dtype="float32", act_quant="nvfp4")
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, (1, 64)).astype(np.int32)
    _, summary = model.forward(tokens, stats=True)
    healthy = stats_report.report(summary, model.config)
    assert not healthy.flags, healthy.table()
    assert all(row["moe_quant_blocks"] > 0 and row["moe_saturated_share"] == 0 for row in healthy.layers)
    runtime = matmul_module._nvfp4_activation_global_scale

    def from_checkpoint(x, weight, row_groups):
        gsa = runtime(x, weight, row_groups)
        if isinstance(weight, Nvfp4Weight) and weight.input_scale is not None and row_groups is not None:
            return jnp.broadcast_to(weight.input_scale[row_groups][:, None], gsa.shape)
        return gsa
    monkeypatch.setattr(matmul_module, "_nvfp4_activation_global_scale", from_checkpoint)
    jax.clear_caches()                                   # the seam is read while tracing
    _, summary = model.forward(tokens, stats=True)
    rep = stats_report.report(summary, model.config)
    assert rep.flagged == {(layer, "moe") for layer in range(model.config.n_layers)}, rep.table()
    assert all("saturate" in f.reason for f in rep.flags)


def _flash_flags_nothing(cfg):
    model = dsv4_jax.init_random(cfg, seed=0, max_seq_len=512)
    tokens = np.random.default_rng(4).integers(2, model.config.vocab_size, 300).tolist()
    result = model.generate([tokens], max_new_tokens=8, stats=True)
    for rep in (result.prompt_stats, result.stats):
        assert rep.tokens > 0 and not rep.flags, rep.table()


@pytest.mark.slow
def test_random_flash_geometry_model_flags_nothing_on_the_cpu():
    """Two layers of the Flash geometry with 16 of its 256 experts (all 256 need ~40 GB on the CPU; the GPU test
    below runs them), random weights, bf16: the prompt's and the generated tokens' statistics flag nothing."""
    _flash_flags_nothing(presets.named("flash", 2).replace(n_routed_experts=16))


@pytest.mark.gpu
def test_random_flash_geometry_model_flags_nothing():
    """Four layers of the Flash geometry, random weights, bf16, the GPU's kernels: nothing flagged."""
    _flash_flags_nothing(presets.named("flash", 4))
