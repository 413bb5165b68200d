"""`python -m dsv4_jax.serve`: bad arguments are one error line, and a real server process reports ready on
stderr with its address, answers, and stops on Ctrl-C."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from dsv4_jax import serve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,code,message", [
    (["--max-batch", "0"], 2, "--max-batch: must be an integer >= 1, got 0"),
    (["--port", "70000"], 2, "--port: must be an integer in [0, 65536), got 70000"),
    (["--chunk", "x"], 2, "--chunk: expected an integer, got 'x'"),
    (["--bogus"], 2, "unrecognized arguments: --bogus"),
    (["--checkpoint", "/nonexistent/dir", "--port", "0"], 1, "--checkpoint /nonexistent/dir: no such directory"),
    (["--max-seq-len", "100000000", "--port", "0"], 2, "exceeds the model's max_position_embeddings"),
    (["--random-weights", "flash:99", "--port", "0"], 2, "layers must be an integer in [1, 43]"),
    (["--random-weights", "tiny", "--checkpoint", "x", "--port", "0"], 2, "exclude each other"),
    (["--admit-batch", "3", "--port", "0"], 2, "--admit-batch 3: must be a power of two at most --max-batch 8"),
    (["--prefill-step", "-1"], 2, "--prefill-step: must be an integer >= 0, got -1"),
])
def test_bad_arguments_are_one_line(capsys, argv, code, message):
    assert serve.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_port_in_use_is_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve.main(["--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot listen on 127.0.0.1:{port}"), err


def test_server_process_reports_ready_answers_and_stops():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_jax.serve", "--port", "0", "--max-batch", "2",
                             "--max-seq-len", "128", "--chunk", "4", "--dtype", "float32",
                             "--prefill-chunk", "8",             # (the warm-up compiles each chunk size: 1 to 8)
                             "--prefill-step", "4"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        ready = None
        while ready is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited before it was ready"
            assert time.time() < deadline, "no readiness line"
            ready = re.match(r"dsv4_jax\.serve: ready on (http://127\.0\.0\.1:\d+/v1) \(model 'dsv4-default'", line)
        base = ready.group(1)
        assert httpx.get(base + "/models").json()["data"][0]["id"] == "dsv4-default"
        r = httpx.post(base + "/completions", json={"prompt": "In the beginning", "max_tokens": 5, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest


@pytest.mark.parametrize("prefix_cache, threads, step", [("16M", 2, 0), ("0", 1, 0), ("0", 1, 256)])
def test_warm_up_compiles_what_a_first_client_would_wait_for(prefix_cache, threads, step):
    """After the warm-up no request compiles a prefill or decode program, whatever its prompt length (every chunk
    size, one chunk or several), logprobs and context bucket (max_seq_len 8192 has two: 4,096 positions and the
    whole buffers; a completion crosses from one to the other, and with the prefix cache a short continuation of
    a long prompt prefills its few tokens in the large one; with --prefill-step 256 the long prompts are prefilled
    in steps beside the other row); the warm-up compiles each of its programs once, also with its prefill programs
    compiled two at a time (--warm-up-threads 2)."""
    import threading

    import jax

    from dsv4_jax import engine, generation
    from dsv4_jax.serving.scheduler import Finished, Request, Scheduler
    jax.clear_caches()              # this test's programs are counted from here (the other parameter's too)
    args = serve.build_parser().parse_args(["--random-weights", "tiny:1", "--dtype", "float32", "--max-batch", "2",
                                            "--max-seq-len", "8192", "--allow-long-context", "--prefill-chunk", "64",
                                            "--prefix-cache", prefix_cache])
    model, _ = serve.build_model(args)
    assert model.prefix_cache.enabled == (prefix_cache != "0")
    scheduler = Scheduler(model, chunk=4, max_queue=32, prefill_step=step).start()

    def programs():
        return engine.prefill_chunk._cache_size(), generation.generate_chunk._cache_size()
    try:
        serve.warm_up(scheduler, threads=threads)
        prefill, decode = serve.warm_up_programs(model, chunk=4, prefill_step=step)
        assert {b for _, b in prefill} == {b for b, *_ in decode} == {4096, None}
        first_prefill, first_decode = serve.warm_up_programs(model, chunk=4, context=4096)     # --warm-up-context
        assert {b for _, b in first_prefill} == {b for b, *_ in first_decode} == {4096}
        assert set(first_prefill) < set(prefill) and set(first_decode) < set(decode)
        assert programs() == (len(prefill), len(decode))
        rng = np.random.default_rng(0)
        long_prompt = [0] + rng.integers(1, 4096, 4199).tolist()
        requests = [(rng.integers(1, 4096, n).tolist(), 3, [None, 0, 5][n % 3])    # (none extends another)
                    for n in (1, 2, 3, 5, 9, 17, 33, 65, 100, 129, 200, 300)]
        requests += [([0] + rng.integers(1, 4096, 4089).tolist(), 12, None),   # decodes across position 4,096
                     (long_prompt, 3, 5)]
        dones = []

        def submit(batch):
            for prompt, max_tokens, logprobs in batch:
                dones.append(threading.Event())
                scheduler.submit([Request(prompt_ids=prompt, max_tokens=max_tokens, logprobs=logprobs,
                                          on_event=lambda e, done=dones[-1]: isinstance(e, Finished) and done.set())])
        submit(requests)                                        # two rows: short and long requests side by side
        assert all(done.wait(120) for done in dones)
        submit([(long_prompt[:-1] + [7, 8, 9, 10, 11, 12], 3, 0)])    # the prefix cache has all but 6 tokens
        assert dones[-1].wait(120)
        assert programs() == (len(prefill), len(decode))
        assert (scheduler.stats["prefill_steps"] > 0) == bool(step)
    finally:
        scheduler.stop()


def test_warm_up_compiles_the_programs_of_requests_admitted_together():
    """--admit-batch 2 (and the prefix cache): after the warm-up, pairs of requests submitted at once (admitted as
    groups of two, prompts of every chunk size, some continuing a cached prefix, some with logprobs) compile no
    prefill, admission or prefix-cache program (the warm-up's prefill programs compiled two at a time)."""
    import threading

    import jax

    from dsv4_jax import engine, prefix_cache
    from dsv4_jax.serving import slots
    from dsv4_jax.serving.scheduler import Finished, Request, Scheduler
    jax.clear_caches()
    args = serve.build_parser().parse_args(["--random-weights", "tiny:1", "--dtype", "float32", "--max-batch", "2",
                                            "--max-seq-len", "1024", "--prefill-chunk", "64", "--admit-batch", "2",
                                            "--admit-tokens", "512"])
    model, _ = serve.build_model(args)
    scheduler = Scheduler(model, chunk=4, max_queue=32, admit_batch=2, admit_tokens=512).start()

    def programs():
        jitted = [engine.prefill_chunk, slots.admit] + [getattr(prefix_cache, name) for name in dir(prefix_cache)
                                                        if hasattr(getattr(prefix_cache, name), "_cache_size")]
        return [f._cache_size() for f in jitted]
    try:
        serve.warm_up(scheduler, threads=2)
        before = programs()
        calls_before = scheduler.stats["admit_calls"]
        rng = np.random.default_rng(1)
        lengths = (1, 2, 3, 5, 9, 17, 33, 65, 100, 129, 200)
        prompts = [rng.integers(1, 4096, n).tolist() for n in lengths]
        pairs = [(prompts[i], prompts[i + 1]) for i in range(0, len(prompts) - 1, 2)]
        pairs.append((prompts[-1] + [5, 6], prompts[-2] + [7]))            # both continue a cached prefix
        for i, pair in enumerate(pairs):
            dones = [threading.Event() for _ in pair]
            scheduler.submit([Request(prompt_ids=p, max_tokens=3, logprobs=5 if i % 2 and j == 0 else None,
                                      on_event=lambda e, done=done: isinstance(e, Finished) and done.set())
                              for j, (p, done) in enumerate(zip(pair, dones))])
            assert all(done.wait(120) for done in dones)
        assert scheduler.stats["admit_calls"] - calls_before == len(pairs)          # each pair one prefill call
        assert programs() == before
    finally:
        scheduler.stop()


def test_random_weights_serve_a_preset_geometry():
    """--random-weights tiny:2: the preset's first two layers with random weights in the stored formats, the
    packaged tokenizer (tiny's 512-id vocabulary raised to the tokenizer's 4,096, so every id it writes is a row),
    named after the spec, with the options of the command line; the scheduler takes it like any model (it serves
    the default model in the other tests)."""
    import dsv4_jax

    args = serve.build_parser().parse_args(["--random-weights", "tiny:2", "--max-seq-len", "128", "--max-batch", "2",
                                            "--dtype", "float32", "--prefix-cache", "0"])
    model, name = serve.build_model(args)
    assert name == "tiny-2-random"
    assert model.config == dsv4_jax.presets.named("tiny", 2).replace(vocab_size=model.tokenizer.vocab_size)
    assert (model.max_seq_len, model.max_batch, model.settings.dtype) == (128, 2, "float32")
    assert model.tokenizer.vocab_size == model.config.vocab_size == 4096
    experts = model.params["layers"][0]["ffn"]["experts"]["w1"]["weight"]
    assert type(experts).__name__ == "Mxfp4Weight"                      # the stored format, not bf16
