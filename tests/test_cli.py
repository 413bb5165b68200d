"""End-to-end tests of the CLI, `python -m dsv4_jax.generate`, run as subprocesses on CPU.

The model is the packaged default model when dsv4_jax/default_model/model.safetensors exists, otherwise a random
tiny checkpoint written here (with the packaged tokenizer): never a skip. All subprocesses start together in one
module fixture (most time goes to importing JAX and tracing/compiling, which overlap well), and the successful runs
share their compiled programs: the batch runs use the same batch size, cache size and prefill chunk.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import pytest

from dsv4_jax import generate as cli
from dsv4_jax.chat import encode_messages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "dsv4_jax", "default_model")
HAS_DEFAULT_MODEL = os.path.isfile(os.path.join(DEFAULT_MODEL, "model.safetensors"))
SYSTEM = "You are a scribe."
BATCH_PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying, Speak unto the children"]
BATCH_ARGS = ["--max-new-tokens", "6", "--max-seq-len", "256", "--prefill-chunk", "8", "--seed", "3"]
GREEDY_ARGS = ["--prompt", "And the LORD spake", "--temperature", "0", "--max-new-tokens", "24", "--json"]
STOPS = [" the", ","]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Checkpoint dirs for the runs: the model (default or synthetic) and broken ones for the error cases."""
    root = tmp_path_factory.mktemp("cli")
    dirs = {}
    if HAS_DEFAULT_MODEL:
        dirs["model"] = None                                  # no --checkpoint: the packaged model
        model_dir = DEFAULT_MODEL
    else:
        from ckpt_writer import write_checkpoint
        from dsv4_jax import presets
        model_dir = str(root / "synthetic")
        write_checkpoint(model_dir, presets.tiny().replace(vocab_size=4096), seed=0)
        shutil.copy(os.path.join(DEFAULT_MODEL, "tokenizer.json"), model_dir)
        dirs["model"] = model_dir
    (root / "empty").mkdir()
    dirs["empty"] = str(root / "empty")
    not_v4 = root / "not_v4"
    not_v4.mkdir()
    (not_v4 / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    dirs["not_v4"] = str(not_v4)
    no_tok = root / "no_tokenizer"
    no_tok.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), no_tok)
    dirs["no_tokenizer"] = str(no_tok)
    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), no_weights)
    shutil.copy(os.path.join(DEFAULT_MODEL, "tokenizer.json"), no_weights)
    dirs["no_weights"] = str(no_weights)
    (root / "prompts.txt").write_text("\n".join(BATCH_PROMPTS[:1] + ["", "  "] + BATCH_PROMPTS[1:]) + "\n")
    dirs["prompts"] = str(root / "prompts.txt")
    (root / "blank.txt").write_text("\n  \n\n")
    dirs["blank"] = str(root / "blank.txt")
    return dirs


def model_args(dirs):
    return [] if dirs["model"] is None else ["--checkpoint", dirs["model"]]


# name -> (argv builder, expected exit code, expected text in the error line). These run as subprocesses.
ERROR_CASES = {
    "missing_dir": (lambda d: ["--checkpoint", d["empty"] + "/nope"], 1, "no such directory"),
    "not_a_checkpoint": (lambda d: ["--checkpoint", d["empty"]], 1, "no config.json"),
    "not_deepseek_v4": (lambda d: ["--checkpoint", d["not_v4"]], 1, "deepseek_v4"),
    "missing_tokenizer": (lambda d: ["--checkpoint", d["no_tokenizer"]], 1, "tokenizer"),
    "unknown_option": (lambda d: ["--frobnicate"], 2, "--frobnicate"),
    "negative_max_new_tokens": (lambda d: ["--max-new-tokens", "-3"], 2, "--max-new-tokens"),
    "nan_temperature": (lambda d: ["--temperature", "nan"], 2, "--temperature"),
    "top_p_above_one": (lambda d: ["--top-p", "1.5"], 2, "--top-p"),
    "negative_top_k": (lambda d: ["--top-k", "-1"], 2, "--top-k"),
    "bad_dtype": (lambda d: ["--dtype", "float16"], 2, "--dtype"),
    "prompt_too_long": (lambda d: model_args(d) + ["--prompt", "And the LORD said " * 40, "--max-seq-len", "64",
                                                   "--max-new-tokens", "4"], 1, "--max-seq-len 64"),
    "empty_prompt_file": (lambda d: model_args(d) + ["--prompt-file", d["blank"]], 1, "no prompts"),
}
# More bad input, checked in-process through `main` (same code path, without paying a JAX import each).
IN_PROCESS_ERROR_CASES = {
    "no_weights": (lambda d: ["--checkpoint", d["no_weights"]], 1, "safetensors"),
    "top_p_zero": (lambda d: ["--top-p", "0"], 2, "--top-p"),
    "infinite_temperature": (lambda d: ["--temperature", "inf"], 2, "--temperature"),
    "zero_max_new_tokens": (lambda d: ["--max-new-tokens", "0"], 2, "--max-new-tokens"),
    "non_integer_top_k": (lambda d: ["--top-k", "2.5"], 2, "--top-k"),
    "bad_act_quant": (lambda d: ["--act-quant", "int8"], 2, "--act-quant"),
    "bad_kernels": (lambda d: ["--kernels", "cuda"], 2, "--kernels"),
    "prompt_and_file": (lambda d: ["--prompt", "a", "--prompt-file", d["prompts"]], 2,
                        "not allowed with argument"),
    "effort_without_thinking": (lambda d: ["--reasoning-effort", "max"], 2, "--thinking"),
    "missing_prompt_file": (lambda d: model_args(d) + ["--prompt-file", d["empty"] + "/none.txt"], 1,
                            "none.txt"),
    "empty_prompt": (lambda d: model_args(d) + ["--prompt", "  "], 1, "--prompt is empty"),
    "checkpoint_is_a_file": (lambda d: ["--checkpoint", d["prompts"]], 1, "not a directory"),
    "more_devices_than_there_are": (lambda d: model_args(d) + ["--devices", "64"], 1, "--devices 64: only"),
    "zero_devices": (lambda d: ["--devices", "0"], 2, "--devices"),
    "empty_stop": (lambda d: ["--stop", ""], 2, "--stop"),
    "special_tokens_in_chat": (lambda d: ["--chat", "--special-tokens"], 2, "--special-tokens"),
    "stats_with_speculative": (lambda d: ["--stats", "--speculative-tokens", "2"], 2, "--stats needs"),
    "bad_prefix_cache_size": (lambda d: ["--prefix-cache", "lots"], 2, "--prefix-cache"),
    "past_the_trained_positions": (lambda d: model_args(d) + ["--max-seq-len", "8192"], 2,
                                   "--allow-long-context"),
}
if jax.default_backend() != "gpu":
    IN_PROCESS_ERROR_CASES["pallas_without_gpu"] = (lambda d: model_args(d) + ["--kernels", "pallas"], 1,
                                                    "needs an NVIDIA GPU")
if not HAS_DEFAULT_MODEL:
    IN_PROCESS_ERROR_CASES["default_model_missing"] = (lambda d: [], 1, "default model is missing")


def run_cli(argv):
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "dsv4_jax.generate", *argv], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=600)


@pytest.fixture(scope="module")
def runs(workdir):
    """Start every subprocess at once; returns name -> CompletedProcess."""
    d = workdir
    jobs = {
        # The headline: no options (a synthetic checkpoint stands in while the default model is absent).
        "default": model_args(d),
        "batch_stream": model_args(d) + ["--prompt-file", d["prompts"], "--thinking", "--system", SYSTEM] + BATCH_ARGS,
        "batch_json": model_args(d) + ["--prompt-file", d["prompts"], "--thinking", "--system", SYSTEM, "--json"]
        + BATCH_ARGS,
        "greedy_json": model_args(d) + GREEDY_ARGS,
        "greedy_stop_json": model_args(d) + GREEDY_ARGS + [arg for s in STOPS for arg in ("--stop", s)]
        + ["--verbose", "--kv-cache-dtype", "fp8"],      # compact caches: the same logits, so the same tokens
    }
    jobs.update({name: build(d) for name, (build, _, _) in ERROR_CASES.items()})
    # The slow runs first: the error cases fill the gaps.
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(run_cli, argv) for name, argv in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def stats_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if "tokens/s" in line or "decode:" in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_default_run_streams_a_continuation(runs):
    proc = runs["default"]
    assert_ok(proc)
    assert proc.stdout.startswith(cli.DEFAULT_PROMPT), proc.stdout[:200]
    assert len(proc.stdout) > len(cli.DEFAULT_PROMPT) + 1
    line = stats_line(proc)
    for part in ("prompt tokens:", "generated tokens:", "prefill:", "tokens/s"):
        assert part in line, line
    generated = int(line.split("generated tokens:")[1].split("|")[0])
    assert 1 <= generated <= 100
    # compilation is announced before it starts (not claiming a compile the cache may spare) and its time reported
    # apart from the prefill figure
    assert "preparing the programs for these shapes (read from " in proc.stderr, proc.stderr
    assert re.search(r"compiled \d+ programs and read \d+ from the compilation cache in \d+\.\d\d s", proc.stderr)
    assert re.search(r"prefill: [\d.]+ s \(to first token, incl\. [\d.]+ s compiling\)", line), line


def test_json_batch_structure_and_thinking_prompts(runs):
    proc = runs["batch_json"]
    assert_ok(proc)
    doc = json.loads(proc.stdout)                               # stdout is exactly one JSON object
    assert set(doc) == {"checkpoint", "settings", "results", "timing"}
    assert doc["settings"]["thinking"] is True and doc["settings"]["chat"] is True
    assert [r["prompt"] for r in doc["results"]] == BATCH_PROMPTS   # blank lines skipped, order kept
    from dsv4_jax.tokenizer import Tokenizer
    tok = Tokenizer(DEFAULT_MODEL)
    for res, prompt in zip(doc["results"], BATCH_PROMPTS):
        expected = encode_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                   thinking_mode="thinking")
        assert res["prompt_text"] == expected
        assert res["prompt_text"].endswith("<｜User｜>" + prompt + "<｜Assistant｜><think>")
        assert res["prompt_token_ids"] == tok.encode(expected, allow_special=True)
        assert res["prompt_token_ids"][0] == tok.bos_id
        assert 1 <= len(res["token_ids"]) <= 6
        assert res["finish_reason"] in ("stop", "length")
        assert (res["finish_reason"] == "stop") == (res["token_ids"][-1] == tok.eos_id)
        if res["finish_reason"] == "length":
            assert len(res["token_ids"]) == 6
        ids = res["token_ids"][:-1] if res["finish_reason"] == "stop" else res["token_ids"]
        assert res["completion"] == tok.decode(ids)
    timing = doc["timing"]
    assert timing["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in doc["results"])
    assert timing["generated_tokens"] == sum(len(r["token_ids"]) for r in doc["results"])
    assert timing["load_s"] >= 0 and timing["prefill_s"] > 0 and timing["decode_s"] >= 0
    assert 0 <= timing["compile_s"] <= timing["prefill_s"] + timing["decode_s"]
    assert "tokens/s" in stats_line(proc)                        # human summary on stderr only


def test_batch_streaming_matches_json(runs):
    """The streamed batch prints the same text as the JSON run (same seed): prompt 1 streamed, prompt 2 after."""
    stream, js = runs["batch_stream"], runs["batch_json"]
    assert_ok(stream)
    assert_ok(js)
    results = json.loads(js.stdout)["results"]
    expected = "".join(("\n" if i else "") + cli._header(i, 2, r["prompt"]) + "\n" + r["completion"] + "\n"
                       for i, r in enumerate(results))
    assert stream.stdout == expected
    assert stats_line(stream).startswith("batch 2 |")


def test_stop_strings_cut_the_text_and_verbose_names_the_kernels(runs):
    """--stop: the completion is the unstopped greedy text cut before the first stop string, and its ids end with
    the token that completed it (that run also stores its caches compact: --kv-cache-dtype fp8 gives the same
    logits); --verbose: backend, devices and each matmul kind's kernel on stderr."""
    plain, stopped = runs["greedy_json"], runs["greedy_stop_json"]
    assert_ok(plain)
    assert_ok(stopped)
    full, cut = json.loads(plain.stdout)["results"][0], json.loads(stopped.stdout)["results"][0]
    hits = [full["completion"].find(s) for s in STOPS if s in full["completion"]]
    if hits:
        assert cut["completion"] == full["completion"][:min(hits)]
        assert cut["finish_reason"] == "stop"
        assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
        from dsv4_jax.tokenizer import Tokenizer
        decoded = Tokenizer(DEFAULT_MODEL).decode(cut["token_ids"])
        assert any(decoded.startswith(cut["completion"] + s) for s in STOPS)        # the last id completed a stop
        assert not any(s in Tokenizer(DEFAULT_MODEL).decode(cut["token_ids"][:-1]) for s in STOPS)
    else:
        assert cut == full
    assert json.loads(stopped.stdout)["settings"]["stop"] == STOPS
    assert json.loads(stopped.stdout)["settings"]["kv_cache_dtype"] == "fp8"
    assert re.search(r"^backend: cpu \| devices: 1 x .* \| kernels: auto -> reference", stopped.stderr, re.M), \
        stopped.stderr
    assert re.search(r"^matmul \[decode\]: linear \(Fp8BlockWeight\) -> the reference \(XLA\) x \d+$", stopped.stderr,
                     re.M), stopped.stderr
    assert re.search(r"^mhc_site \[prefill\]: mhc_site -> the reference \(XLA\) x \d+$", stopped.stderr, re.M), \
        stopped.stderr


def test_ctrl_c_prints_the_statistics_so_far(workdir, monkeypatch, capsys):
    from dsv4_jax import api

    def interrupted(self, prompts, stream=None, **options):
        stream([[5, 6, 7]])                                 # one chunk of three tokens arrives, then Ctrl-C
        raise KeyboardInterrupt
    monkeypatch.setattr(api.Model, "generate", interrupted)
    assert cli.main(model_args(workdir) + ["--max-new-tokens", "8"]) == cli.EXIT_INTERRUPTED
    out, err = capsys.readouterr()
    assert out.startswith(cli.DEFAULT_PROMPT)
    assert re.search(r"^interrupted; prompt tokens: \d+ \| generated tokens: 3 \| load: [\d.]+ s \| prefill: ", err,
                     re.M), err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_bad_input_gives_one_error_line(runs, name):
    proc = runs[name]
    _, code, needle = ERROR_CASES[name]
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("name", sorted(IN_PROCESS_ERROR_CASES))
def test_bad_input_in_process(workdir, capsys, name):
    build, code, needle = IN_PROCESS_ERROR_CASES[name]
    assert cli.main(build(workdir)) == code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert out == ""


# ---- in-process checks of the prompt building (no model) ---------------------------------------------------------

def test_prompt_encoding_modes():
    args = cli.parse_args(["--prompt", "hi"])
    assert not args.chat and cli.encode_prompt("hi", args) == "<｜begin▁of▁sentence｜>hi"
    args = cli.parse_args(["--chat", "--prompt", "hi"])
    assert cli.encode_prompt("hi", args) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    args = cli.parse_args(["--system", "Be brief.", "--prompt", "hi"])            # --system implies --chat
    assert cli.encode_prompt("hi", args) == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜></think>"
    args = cli.parse_args(["--thinking", "--prompt", "hi"])                       # --thinking implies --chat
    assert cli.encode_prompt("hi", args) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
    args = cli.parse_args(["--thinking", "--reasoning-effort", "max"])
    text = cli.encode_prompt(cli.read_prompts(args)[0], args)
    assert text.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert text.endswith(cli.DEFAULT_CHAT_PROMPT + "<｜Assistant｜><think>")


def test_defaults_stated_in_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--temperature", "0.6"), ("--top-p", "0.95"), ("--top-k", "0"),
                            ("--max-new-tokens", "100")):
        after = help_text.split(option + " ", 2)[-1]              # the option's own help entry
        assert f"(default: {default})" in after.split(" --")[0], (option, after[:120])
    args = cli.parse_args([])
    assert (args.temperature, args.top_p, args.top_k, args.max_new_tokens) == (0.6, 0.95, 0, 100)


def test_out_of_memory_is_one_line_but_other_errors_propagate(monkeypatch, capsys):
    import jax

    def out_of_memory(args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.\nmore")
    monkeypatch.setattr(cli, "run", out_of_memory)
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory: RESOURCE_EXHAUSTED")

    def bug(args):
        raise ValueError("a genuine bug")
    monkeypatch.setattr(cli, "run", bug)
    with pytest.raises(ValueError, match="genuine bug"):
        cli.main([])


@pytest.mark.parametrize("total, shown", [(33_000_000, False), (cli.PROGRESS_MIN_BYTES, True)])
def test_load_progress_bar_only_for_large_checkpoints_off_a_tty(capsys, total, shown):
    progress = cli._LoadProgress()
    for done in range(0, total + 1, total // 100):
        progress(done, total)
    progress.close()
    out, err = capsys.readouterr()
    assert out == ""
    assert ("loading weights" in err) == shown, err[-200:]
