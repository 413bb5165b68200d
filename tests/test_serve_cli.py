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
                             "--max-seq-len", "128", "--chunk", "4", "--dtype", "float32"],
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


def test_warm_up_compiles_what_a_first_client_would_wait_for():
    """After the warm-up, a request with logprobs and one with a long prompt compile nothing new."""
    import threading

    import dsv4_jax
    from dsv4_jax import engine, generation
    from dsv4_jax.serving.scheduler import Finished, Request, Scheduler
    model = dsv4_jax.load(dtype="float32", max_seq_len=512, max_batch=2, prefill_chunk=128, prefix_cache=16 << 20)
    scheduler = Scheduler(model, chunk=4, max_queue=8).start()
    try:
        serve.warm_up(scheduler)
        sizes = (engine.prefill_chunk._cache_size(), generation.generate_chunk._cache_size())
        for prompt, logprobs in (([0] + list(range(5, 305)), None), ([0, 9, 10], 5), ([0, 11], 0)):
            done = threading.Event()
            scheduler.submit([Request(prompt_ids=prompt, max_tokens=6, logprobs=logprobs,
                                      on_event=lambda e, done=done: isinstance(e, Finished) and done.set())])
            assert done.wait(120)
        assert (engine.prefill_chunk._cache_size(), generation.generate_chunk._cache_size()) == sizes
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
