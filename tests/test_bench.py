"""The model benchmark runs end to end on the CPU for the tiny preset: every section of its JSON is there, the
reference side ran, the profiles attributed a decode step's and a prefill chunk's kernels, and the figures are
written. Never a time."""

import json
import os

import pytest

from dsv4_jax.bench.__main__ import main, parse_args
from dsv4_jax.source_digest import source_digest


def test_tiny_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    figures = tmp_path / "figures"
    assert main(["--preset", "tiny", "--batches", "2", "--contexts", "160", "--prompts", "40", "--steps", "3",
                 "--calls", "1", "--prefill-calls", "1", "--out", str(out), "--profile", str(tmp_path / "trace"),
                 "--profile-prefill", str(tmp_path / "trace_prefill"), "--prefill-chunk", "16",
                 "--bandwidth-bytes", str(1 << 20), "--matmul-n", "128", "--kv-cache-dtype", "fp8",
                 "--temperature", "0.8", "--top-p", "0.9"]) == 0
    result = json.loads(out.read_text())
    assert result["model"]["preset"] == "tiny" and result["model"]["layers"] == 4
    assert result["source"] == source_digest() and result["source"]["files"] > 50      # the code that ran
    assert result["model"]["kv_cache_dtype"] == "fp8"                  # synthetic states stored compact
    assert result["model"]["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    assert {"bandwidth_bytes_per_s", "fp8_flops_per_s", "bf16_flops_per_s"} <= set(result["device"])
    decode = {c["kernels"]: c for c in result["decode"]}
    assert set(decode) == {"auto", "reference"}
    for case in decode.values():
        assert (case["batch"], case["context"], case["steps_per_call"]) == (2, 160, 3)
        assert case["ms_per_step"] > 0 and case["floor_ms"] > 0 and case["floor_bytes"] > 0
    assert {c["kernels"] for c in result["prefill"]} == {"auto", "reference"}
    assert all(c["prompt_tokens"] == 40 and c["tokens_per_s"] > 0 for c in result["prefill"])
    assert {"decode_step_s_auto", "decode_step_s_reference", "generate_chunk_s_auto",
            "generate_chunk_s_reference"} <= set(result["compile"])
    profile = result["profile"]
    assert profile["launches"]["launches_per_call"] > 0
    assert "fp4 matmul" in profile["by_family"] and "mhc" in profile["by_family"]
    assert sum(row["percent"] for row in profile["by_family"].values()) == pytest.approx(100.0)
    sites = profile["top_sites"]                                        # the ops that take the most, by time
    assert sites and [s["ms"] for s in sites] == sorted((s["ms"] for s in sites), reverse=True)
    assert all(s["family"] in profile["by_family"] and s["kernels"] > 0 for s in sites)
    assert any("routed_experts" in s["site"] for s in sites)
    assert sum(s["percent"] for s in sites) <= 100.0 + 1e-9
    chunk = result["profile_prefill"]                                   # one 16-token chunk of one sequence
    assert chunk["chunk"] == 16 and chunk["launches"]["launches_per_call"] > 0
    assert {"fp4 matmul", "attention", "compressor"} <= set(chunk["by_family"])
    assert sum(row["percent"] for row in chunk["by_family"].values()) == pytest.approx(100.0)
    printed = capsys.readouterr().out
    assert "ms/step" in printed and "ttft ms" in printed and "one 16-token prefill chunk" in printed
    assert "sites that take the most" in printed

    pytest.importorskip("matplotlib")
    assert main(["--replot", str(out), "--plot", str(figures)]) == 0
    assert sorted(os.listdir(figures)) == ["tiny_4l_decode.png", "tiny_4l_decode_profile.png"]


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "positive integers"),
    (["--contexts", "none"], "at least one value"),
    (["--replot", "x.json"], "--replot needs --plot"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--kernels", "reference"], "add --reference none"),
    (["--top-p", "0"], "argument --top-p: must lie in (0, 1], got 0"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got -1"),
    (["--top-k", "-2"], "argument --top-k: must be an integer >= 0, got -2"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_context_too_short_for_the_steps_is_refused():
    from dsv4_jax import init_random, presets
    from dsv4_jax.bench.cases import time_decode
    model = init_random(presets.tiny(), kernels="reference")
    with pytest.raises(ValueError, match="shorter than the 40 steps"):
        time_decode(model.params, model.config, model.context, 1, 30, steps=10, calls=3)



def test_the_decode_rows_sample_as_asked():
    """The benchmark's generation rows carry --temperature / --top-k / --top-p (greedy when none is given)."""
    from dsv4_jax import init_random, presets
    from dsv4_jax.bench.cases import _generation, synthetic_state
    model = init_random(presets.tiny(), kernels="reference")
    state = synthetic_state(model.config, 3, 64, 10, model.context.jnp_dtype)
    greedy = _generation(state, model.config, 3).sampling
    sampled = _generation(state, model.config, 3, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}).sampling
    assert (greedy.temperature == 0).all() and (greedy.top_k == 0).all() and (greedy.top_p == 1).all()
    assert (sampled.temperature == 0.7).all() and (sampled.top_k == 5).all() and (sampled.top_p == 0.9).all()
