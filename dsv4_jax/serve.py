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
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import DEFAULT_MODEL_DIR, init_random, load, presets
from .api import context_bucket, prefill_chunk_size
from .checkpoint import CheckpointError
from .engine import PREFILL_CHUNK
from .generate import (EXIT_USAGE, KERNEL_OVERRIDE_HELP, CLIError, _check_checkpoint_dir, _int_at_least,
                       PREFIX_CACHE_DEFAULT, _LoadProgress, _mesh, _one_line, _setup_compile_cache, byte_size,
                       checked_config, model_settings)
from .serving.scheduler import Failed, Finished, Request, Scheduler
from .serving.slots import MAX_TOP_LOGPROBS
from .settings import Settings
from .tokenizer import Tokenizer

PROG = "python -m dsv4_jax.serve"
# Contexts whose every program the warm-up compiles: one context bucket (api.MIN_CONTEXT_BUCKET), each prompt length
# and decode variant in it. Every further bucket multiplies them (each chunk size meets each bucket with the prefix
# cache): at 1M positions all of them are ~144 programs, an hour of compiling for Flash.
WARM_UP_CONTEXT = 4096


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
    s.add_argument("--admit-batch", type=_int_at_least(1), default=1, metavar="N",
                   help="prefill up to N waiting requests together (a power of two; 1: each alone; default 1): the "
                        "weights are read once for the group, and the warm-up compiles the prefill programs of "
                        "batch 2, 4, ... N too")
    s.add_argument("--admit-tokens", type=_int_at_least(1), default=8192, metavar="N",
                   help="a group's rows (a power of two) times its longest prompt stay within N tokens (default "
                        "8192)")
    s.add_argument("--prefill-step", type=_int_at_least(0), default=0, metavar="N",
                   help="while other requests are generating, prefill a prompt longer than N tokens N at a time, one "
                        "step between their decode chunks, so that a long prompt does not stall them for its whole "
                        "prefill (0: off, the default: each prompt at once)")
    s.add_argument("--max-queue", type=_int_at_least(0), default=256, metavar="N",
                   help="requests that may wait for a row; more get 429 (default 256)")
    s.add_argument("--speculative-tokens", type=_int_at_least(0, 17), default=0, metavar="K",
                   help="draft K tokens per step with the model's MTP block and verify them in one pass (0: off)")
    s.add_argument("--prefix-cache", type=byte_size, default=PREFIX_CACHE_DEFAULT, metavar="SIZE",
                   help="device memory for decode-state snapshots of earlier prompts, so that a prompt that extends "
                        "one prefills only the rest (e.g. 512M, 1G; 0: off; default: %(default)s)")
    s.add_argument("--no-warmup", action="store_true", help="report ready before compiling the programs")
    s.add_argument("--warm-up-context", type=_int_at_least(1), default=WARM_UP_CONTEXT, metavar="N",
                   help="compile before reporting ready every program of contexts up to N positions (default "
                        f"{WARM_UP_CONTEXT}; the programs of longer contexts compile when first met and the "
                        "compilation cache keeps them; N = --max-seq-len: all)")
    s.add_argument("--warm-up-threads", type=_int_at_least(1), default=1, metavar="N",
                   help="prefill programs the warm-up compiles at once, in threads (default 1: one after another; "
                        "on a GPU each compile also times kernel candidates there, and at once they share it)")
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
    _status(f"making {args.random_weights}'s random weights")
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
    _status(f"loading {directory}")
    try:
        model = load(directory, settings=settings, mesh=mesh, progress=progress)
    except (CheckpointError, OSError, ValueError) as err:
        raise CLIError(_one_line(err)) from None
    finally:
        progress.close()
    name = args.served_model_name or ("dsv4-default" if args.checkpoint is None
                                      else os.path.basename(os.path.normpath(directory)))
    return model, name


def _buckets(lo: int, hi: int, max_seq_len: int) -> list[int | None]:
    """The context buckets (api.context_bucket) of calls whose tokens end at positions lo..hi, in order."""
    found = []
    while lo <= hi:
        found.append(context_bucket(lo, max_seq_len))
        if found[-1] is None:
            break
        lo = found[-1] + 1
    return found


def warm_up_programs(model, chunk: int, speculative_tokens: int = 0, context: int | None = None,
                     prefill_step: int = 0) -> tuple[list, list]:
    """The programs a request that fits the server can meet, as (prefill, decode): `prefill` the (chunk size,
    context bucket) pairs of engine.prefill_chunk, `decode` the (context bucket, logprobs, n_top) triples of
    generation.generate_chunk on the shared batch (a bucket None: the whole buffers); their other static arguments
    are the server's own. It follows Model.prefill and prefill_prompts (api.py): n tokens run in chunks of
    min(prefill_chunk, the next power of two >= n), each with the bucket of the position the last one reaches;
    with the prefix cache a prompt's head (all but its last token) continues any cached prefix, so every head
    chunk size meets every bucket up to the longest prompt, and the last token runs alone (chunk 1) at every
    bucket. Decode chunks meet every bucket from the first chunk's bound up to max_seq_len. `context`: only the
    programs of calls whose tokens lie below that many positions (their bucket's; None: all). A long prompt
    prefilled in steps (`prefill_step`, the scheduler's) meets what a continued one does, cache or not: steps of
    every chunk size up to the step's at every bucket, then the last token alone; without the cache, prompts are
    also prefilled whole (those no longer than a step, and any while no row is generating)."""
    k = speculative_tokens
    longest = model.max_seq_len - k - 1        # the longest prompt (app.py: it leaves k + 1 positions)
    if longest < 1:
        return [], []
    pc, max_seq_len = model.prefill_chunk, model.max_seq_len
    cached = model.prefix_cache.enabled
    # the largest chunk of a prompt prefilled in pieces: a head after a cached prefix (any), or a step
    piece = pc if cached else prefill_chunk_size(prefill_step, pc) if prefill_step else 0
    prefill = set()
    size = 1
    while size // 2 < longest:          # the lengths (size / 2, size] run in chunks of min(prefill_chunk, size)
        if not cached:                  # whole prompts (also with steps: those no longer than a step)
            prefill.add((prefill_chunk_size(size, pc), context_bucket(min(size, longest), max_seq_len)))
        # a piece of such a length ends at most at longest - 1
        if prefill_chunk_size(size, pc) <= piece and size // 2 < longest - 1:
            prefill.update((prefill_chunk_size(size, pc), b)
                           for b in _buckets(size // 2 + 1, longest - 1, max_seq_len))
        size *= 2
    if piece:                           # the last token alone
        prefill.update((1, b) for b in _buckets(1, longest, max_seq_len))
    # The logprob variants too at every bucket: a batch decodes with logprobs (and the top 20) while any of its rows
    # asks for them, at the bucket of its longest row, so a short request with logprobs beside a long conversation
    # meets them at a large bucket, and a compile in the device loop stalls every row for its duration.
    variants = [(False, 0)] if k else [(False, 0), (True, 0), (True, MAX_TOP_LOGPROBS)]
    first_bound = min(2 + chunk * (k + 1), max_seq_len)      # a 1-token prompt's first decode chunk (scheduler.py)
    decode = [(b, *v) for b in _buckets(first_bound, max_seq_len, max_seq_len) for v in variants]
    limit = max_seq_len if context is None else context_bucket(min(context, max_seq_len), max_seq_len) or max_seq_len
    prefill = [p for p in prefill if (p[1] or max_seq_len) <= limit]
    decode = [d for d in decode if (d[0] or max_seq_len) <= limit]
    return sorted(prefill, key=lambda p: (p[1] or max_seq_len, p[0])), decode


def warm_up(scheduler, context: int | None = None, threads: int = 1) -> None:
    """Compile (or read from the compilation cache) every prefill and decode program a request that fits the server
    can meet (warm_up_programs) before the server says it is ready: a client would wait for a compile, and so would
    every other row of the device loop. `context`: only those of calls below that many positions (None: all; the
    others compile when first met, and the compilation cache keeps them). `threads`: prefill programs compiled at
    once (--warm-up-threads).
    - First, while the loop is idle (it has had no request yet), directly: every prefill chunk, each on a fresh
      one-row state whose position is set near its bucket's end (one chunk's work), `threads` at a time; then
      every decode chunk (every bucket, with and without logprobs) on the shared batch with every row halted (its
      loop ends at once).
    - Then real requests through the loop, one at a time, for what lies around the prefill chunks (admission, the
      prefix cache's copies): a prompt per chunk size (1, 2, 4, ... up to --prefill-chunk; with the prefix cache
      2**j + 1 tokens, a head of 2**j and the last token), each starting with a token of its own so that none
      continues another; then the first prompt and one token more, which continues it from the prefix cache and
      keeps its completion there, asking for logprobs and for their top 20 (two requests; one without logprobs
      under --speculative-tokens).
    Then the prefix cache is emptied of the warm-up's prompts."""
    model = scheduler.model
    k = scheduler.speculative_tokens
    prefill, decode = warm_up_programs(model, scheduler.chunk, k, context, scheduler.prefill_step)
    if not prefill:
        return
    first = context_bucket(1, model.max_seq_len)
    cache = model.prefix_cache
    longest = model.max_seq_len - k - 1
    sizes = sorted({c for c, b in prefill if b == first})
    lengths = [min(c, longest - 1) + 1 if cache.enabled else min(c, longest) for c in sizes]
    _status(f"warm-up: compiling {len(prefill)} prefill and {len(decode)} decode programs (kept by the compilation "
            f"cache for the next start; --no-warmup skips this)")
    t0 = time.perf_counter()
    track = scheduler.track_mtp
    _compile_prefills(model, [(1, size, bucket) for size, bucket in prefill], track, threads)
    _status(f"warm-up: {len(prefill)} prefill programs ({threads} at a time) in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for bucket, logprobs, n_top in decode:
        scheduler.compile_decode(bucket or model.max_seq_len, logprobs, n_top)
    _status(f"warm-up: {len(decode)} decode programs in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    vocab = model.config.vocab_size
    prompts = [[(i + 1 + 17 * j) % vocab for j in range(n)] for i, n in enumerate(lengths)]
    extension = (prompts[0] + [5 % vocab])[:longest]
    requests = [(p, 1, None) for p in prompts]
    requests += [(extension, min(scheduler.chunk + 1, model.max_seq_len - k - len(extension)), logprobs)
                 for logprobs in ([None] if k else [0, MAX_TOP_LOGPROBS])]
    failures = []
    for prompt, max_tokens, logprobs in requests:     # one at a time: each compiles its own programs
        done = threading.Event()

        def on_event(event, done=done):
            if isinstance(event, Failed):
                failures.append(event.message)
            if isinstance(event, (Finished, Failed)):
                done.set()
        scheduler.submit([Request(prompt_ids=prompt, max_tokens=max_tokens, on_event=on_event, logprobs=logprobs)])
        done.wait()
    groups = _warm_up_groups(scheduler, prefill, track, threads)
    cache.clear()
    if failures or groups:
        raise CLIError(f"warm-up request failed: {(failures + groups)[0]}")
    _status(f"warm-up: {len(requests)} requests (admission and the prefix cache's programs) in "
            f"{time.perf_counter() - t0:.1f} s")


def _compile_prefills(model, programs: list[tuple[int, int, int | None]], track: bool, threads: int) -> None:
    """Run one prefill of each (rows, chunk size, context bucket) in `programs`, directly on a fresh state of that
    many rows whose position is set so that the chunk ends at the bucket's end (one chunk's work, with the program
    a request's chunk of that size and bucket runs), `threads` at a time (XLA compiles with the GIL released)."""
    def run(rows: int, size: int, bucket: int | None) -> None:
        end = bucket or model.max_seq_len            # a chunk whose tokens end here has this bucket
        start = max(0, end - size)
        state = model.init_state(rows)
        # (the positions as a jitted op leaves them: committed to their sharding or not, else a program of its own)
        state = state.replace(positions=state.positions + start)
        logits, _ = model.prefill(np.zeros((rows, size), np.int32), np.full((rows,), end - start), state=state,
                                  track_mtp=track, positions=np.full((rows,), start))
        logits.block_until_ready()
    with ThreadPoolExecutor(threads, thread_name_prefix="warm-up") as pool:
        for done in [pool.submit(run, *program) for program in programs]:
            done.result()


def _submit_and_wait(scheduler, prompts: list[list[int]], first_logprobs: int | None = None) -> list[str]:
    """Submit requests of one new token each at once (so the loop may admit them as one group), the first asking
    for `first_logprobs`; wait for all. Returns the failures' messages."""
    failures, left = [], [len(prompts)]
    done = threading.Event()

    def on_event(event):
        if isinstance(event, Failed):
            failures.append(event.message)
        if isinstance(event, (Finished, Failed)):
            left[0] -= 1
            if not left[0]:
                done.set()
    scheduler.submit([Request(prompt_ids=p, max_tokens=1, on_event=on_event,
                              logprobs=first_logprobs if i == 0 else None) for i, p in enumerate(prompts)])
    done.wait()
    return failures


def _warm_up_groups(scheduler, prefill: list, track: bool, threads: int) -> list[str]:
    """With --admit-batch N > 1, the programs of requests prefilled together, for each batch b = 2, 4, ... N:
    every prefill program of warm_up_programs that a group of b can meet (chunks up to its rows' share of
    --admit-tokens), directly on a fresh b-row state, then a group of b two-token prompts through the loop and a
    group extending them by a token, one asking for logprobs (admission of a b-row prefill with and without the top
    logprobs, the prefix cache's copies). Returns failures."""
    model = scheduler.model
    failures = []
    b = 2
    while b <= scheduler.admit_batch:
        t0 = time.perf_counter()
        # the chunk a group's longest prompt (at most its rows' share of --admit-tokens) runs in
        cap = prefill_chunk_size(max(1, scheduler.admit_tokens // b), model.prefill_chunk)
        direct = [(b, size, bucket) for size, bucket in prefill if size <= cap]
        _compile_prefills(model, direct, track, threads)
        vocab = model.config.vocab_size
        prompts = [[(1000 * b + 7 * i) % vocab, 3 % vocab] for i in range(b)]
        failures += _submit_and_wait(scheduler, prompts)
        failures += _submit_and_wait(scheduler, [p + [4 % vocab] for p in prompts],
                                     None if scheduler.speculative_tokens else MAX_TOP_LOGPROBS)
        _status(f"warm-up: {len(direct)} prefill programs and admission of {b} requests together in "
                f"{time.perf_counter() - t0:.1f} s")
        b *= 2
    return failures


def _status(message: str) -> None:
    """A line of the server's progress on stderr (loading and compiling can take minutes before it is ready)."""
    print(f"dsv4_jax.serve: {message}", file=sys.stderr, flush=True)


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
    if args.admit_batch & (args.admit_batch - 1) or args.admit_batch > args.max_batch:
        raise CLIError(f"--admit-batch {args.admit_batch}: must be a power of two at most --max-batch "
                       f"{args.max_batch}", EXIT_USAGE)
    sock = listen(args.host, args.port)            # first: a port in use fails before minutes of loading
    t0 = time.perf_counter()
    model, name = build_model(args)
    _status(f"model {name!r} loaded in {time.perf_counter() - t0:.1f} s")
    scheduler = Scheduler(model, chunk=args.chunk, max_queue=args.max_queue,
                          speculative_tokens=args.speculative_tokens, admit_batch=args.admit_batch,
                          admit_tokens=args.admit_tokens, prefill_step=args.prefill_step).start()
    t0 = time.perf_counter()
    if not args.no_warmup:
        warm_up(scheduler, args.warm_up_context, args.warm_up_threads)
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
