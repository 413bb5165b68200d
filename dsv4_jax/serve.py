"""python -m dsv4_jax.serve: an OpenAI-compatible server (chat and text completions, streaming) over one model.

Serves the packaged default model unless --checkpoint names a DeepSeek-V4 checkpoint directory (or
--random-weights a preset's geometry with random weights, for benchmarks). Requests share one
static decode batch of --max-batch rows (continuous batching: a request joins at the next chunk of --chunk decode
steps and leaves as soon as it ends); beyond that they wait in a queue of --max-queue, and past it get 429. The
programs are compiled before the server reports ready on stderr:
    dsv4_jax.serve: ready on http://127.0.0.1:8000/v1 (model 'dsv4-default', ...)
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from . import DEFAULT_MODEL_DIR, init_random, load, presets
from .checkpoint import CheckpointError
from .engine import PREFILL_CHUNK
from .generate import (EXIT_USAGE, KERNEL_OVERRIDE_HELP, CLIError, _check_checkpoint_dir, _int_at_least,
                       PREFIX_CACHE_DEFAULT, _LoadProgress, _mesh, _one_line, _setup_compile_cache, byte_size,
                       checked_config, model_settings)
from .serving.scheduler import Failed, Finished, Request, Scheduler
from .settings import Settings
from .tokenizer import Tokenizer

PROG = "python -m dsv4_jax.serve"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise CLIError(f"{message} (see {PROG} --help)", EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n", 1)[1].rstrip(), allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", metavar="DIR", help="a DeepSeek-V4 checkpoint directory (default: the packaged "
                   "small model)")
    m.add_argument("--random-weights", metavar="PRESET[:LAYERS]",
                   help="instead of a checkpoint, a preset's geometry (tiny, flash, pro; its first LAYERS layers) with "
                        "random weights in the stored formats, made on the device, and the packaged tokenizer "
                        "widened to the preset's vocabulary (ids past it read <id>; a smaller vocabulary is raised "
                        "to the tokenizer's): for benchmarks, e.g. flash:4")
    m.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients name (default: the checkpoint directory's name; 'dsv4-default' for "
                   "the packaged model)")
    m.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    m.add_argument("--kernels", choices=("auto", "reference", "pallas", "interpret"), default="auto")
    m.add_argument("--kernel-override", action="append", default=[], metavar="OP=CHOICE", help=KERNEL_OVERRIDE_HELP)
    m.add_argument("--devices", type=_int_at_least(1), metavar="N",
                   help="devices of the mesh the model is sharded over (default: all local devices)")
    m.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    m.add_argument("--max-seq-len", type=_int_at_least(2), default=4096, metavar="N",
                   help="positions per sequence, prompt and completion together (default 4096)")
    m.add_argument("--prefill-chunk", type=_int_at_least(1), default=PREFILL_CHUNK, metavar="N")
    m.add_argument("--allow-long-context", action="store_true",
                   help="let --max-seq-len exceed the checkpoint's max_position_embeddings (the positions it was "
                        "trained for)")
    m.add_argument("--no-compile-cache", action="store_true")
    s = p.add_argument_group("serving")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_int_at_least(0, 65536), default=8000, help="0 picks a free port")
    s.add_argument("--max-batch", type=_int_at_least(1), default=8, metavar="N",
                   help="rows of the shared decode batch: requests generated at once (default 8)")
    s.add_argument("--chunk", type=_int_at_least(1), default=8, metavar="N",
                   help="decode steps between the points where requests join and leave (default 8)")
    s.add_argument("--max-queue", type=_int_at_least(0), default=256, metavar="N",
                   help="requests that may wait for a row; more get 429 (default 256)")
    s.add_argument("--speculative-tokens", type=_int_at_least(0, 17), default=0, metavar="K",
                   help="draft K tokens per step with the model's MTP block and verify them in one pass (0: off)")
    s.add_argument("--prefix-cache", type=byte_size, default=PREFIX_CACHE_DEFAULT, metavar="SIZE",
                   help="device memory for decode-state snapshots of earlier prompts, so that a prompt that extends "
                        "one prefills only the rest (e.g. 512M, 1G; 0: off; default: %(default)s)")
    s.add_argument("--no-warmup", action="store_true", help="report ready before compiling the programs")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    return p


def _random_weights_config(spec: str):
    """--random-weights PRESET[:LAYERS] -> the (truncated) preset's config; a mistake is one CLIError line."""
    name, _, layers = spec.partition(":")
    try:
        return presets.named(name, int(layers) if layers else None)
    except ValueError as err:
        raise CLIError(f"--random-weights {spec}: {_one_line(err)} (expected PRESET[:LAYERS], e.g. flash:4)",
                       EXIT_USAGE) from None


def _random_weights_model(args):
    """The model of --random-weights: init_random on the device with the packaged tokenizer widened to its vocab."""
    if args.checkpoint is not None:
        raise CLIError("--random-weights and --checkpoint exclude each other", EXIT_USAGE)
    cfg = _random_weights_config(args.random_weights)
    try:
        Settings(max_seq_len=args.max_seq_len, allow_long_context=args.allow_long_context).check_context(cfg)
    except ValueError as err:
        raise CLIError(f"--max-seq-len {args.max_seq_len}: {_one_line(err)}", EXIT_USAGE) from None
    if args.speculative_tokens and not cfg.n_mtp_layers:
        raise CLIError(f"--speculative-tokens needs a model with an MTP block; {args.random_weights} has none",
                       EXIT_USAGE)
    tokenizer = Tokenizer(os.path.join(DEFAULT_MODEL_DIR, "tokenizer.json"))
    if tokenizer.vocab_size > cfg.vocab_size:          # (tiny: 512) every id the tokenizer writes must be a row
        cfg = cfg.replace(vocab_size=tokenizer.vocab_size)
    tokenizer = tokenizer.widened(cfg.vocab_size)
    settings = model_settings(args, args.max_batch)
    mesh = _mesh(args, None, cfg)
    _setup_compile_cache(args)
    try:
        model = init_random(cfg, seed=0, mesh=mesh, settings=settings, tokenizer=tokenizer)
    except ValueError as err:
        raise CLIError(f"--random-weights {args.random_weights}: {_one_line(err)}") from None
    name = args.served_model_name or f"{args.random_weights.replace(':', '-')}-random"
    return model, name


def build_model(args):
    """Load the model of `args` (checked the way `python -m dsv4_jax.generate` checks them)."""
    if args.random_weights is not None:
        return _random_weights_model(args)
    directory = _check_checkpoint_dir(args)
    cfg = checked_config(args, directory)
    if args.speculative_tokens and not cfg.n_mtp_layers:
        raise CLIError(f"--speculative-tokens needs a model with an MTP block; {directory} has none", EXIT_USAGE)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise CLIError(f"{directory}: no tokenizer.json (the server needs the model's tokenizer)")
    settings = model_settings(args, args.max_batch)
    mesh = _mesh(args, directory)
    _setup_compile_cache(args)
    progress = _LoadProgress()
    try:
        model = load(directory, settings=settings, mesh=mesh, progress=progress)
    except (CheckpointError, OSError, ValueError) as err:
        raise CLIError(_one_line(err)) from None
    finally:
        progress.close()
    name = args.served_model_name or ("dsv4-default" if args.checkpoint is None
                                      else os.path.basename(os.path.normpath(directory)))
    return model, name


def warm_up(scheduler) -> None:
    """Run requests through the loop so that the programs a first client would wait for are compiled (or read from
    the compilation cache) before the server says it is ready: the prefill of a short prompt, of a 256-token one and
    of a whole --prefill-chunk (long system and tool prompts; with the prefix cache also the separate last-token
    prefill), admission and decode chunks with and without logprobs."""
    model = scheduler.model
    room = model.max_seq_len - scheduler.speculative_tokens - scheduler.chunk - 2
    lengths = sorted({n for n in (2, 257, model.prefill_chunk + 1) if n <= room})
    requests, failures = [], []
    # then a short prompt with logprobs, top alternatives or not (each a variant of the programs)
    extra = [] if scheduler.speculative_tokens else [0, 20]
    for i, (n, logprobs) in enumerate([(n, None) for n in lengths] + [(2, k) for k in extra]):
        done = threading.Event()

        def on_event(event, done=done):
            if isinstance(event, Failed):
                failures.append(event.message)
            if isinstance(event, (Finished, Failed)):
                done.set()
        prompt = [scheduler.tokenizer.bos_id] + [(17 * i + 3 * k) % model.config.vocab_size for k in range(n - 1)]
        requests.append((done, Request(prompt_ids=prompt, max_tokens=scheduler.chunk + 1, on_event=on_event,
                                       logprobs=logprobs)))
    for done, request in requests:                # one at a time: each compiles its own programs
        scheduler.submit([request])
        done.wait()
    if failures:
        raise CLIError(f"warm-up request failed: {failures[0]}")


def listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as err:
        raise CLIError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def serve(args) -> int:
    # lazy: fastapi and uvicorn are the optional `serve` extra (pyproject.toml)
    import uvicorn

    from .serving.app import create_app
    sock = listen(args.host, args.port)            # first: a port in use fails before minutes of loading
    model, name = build_model(args)
    scheduler = Scheduler(model, chunk=args.chunk, max_queue=args.max_queue,
                          speculative_tokens=args.speculative_tokens).start()
    t0 = time.perf_counter()
    if not args.no_warmup:
        warm_up(scheduler)
    host, port = sock.getsockname()[:2]
    print(f"dsv4_jax.serve: ready on http://{host}:{port}/v1 (model {name!r}, max_batch {args.max_batch}, "
          f"max_seq_len {args.max_seq_len}, compiled in {time.perf_counter() - t0:.1f} s)", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(create_app(scheduler, name), log_level=args.log_level, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        scheduler.stop()
    return 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(name)s: %(message)s")
        return serve(args)
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
