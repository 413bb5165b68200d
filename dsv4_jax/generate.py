"""Generate text with a DeepSeek-V4 model: `python -m dsv4_jax.generate [options]`.

Without arguments it loads the small model packaged in dsv4_jax/default_model
(trained on the King James Bible) and continues a default prompt, streaming the
text as it is produced. --checkpoint DIR runs an official DeepSeek-V4
checkpoint directory (config.json, tokenizer.json, *.safetensors with
model.safetensors.index.json).

Prompts: a plain prompt is BOS + the prompt text. --chat builds the DeepSeek-V4
chat prompt (dsv4_jax.chat.encode_messages): BOS, the optional --system text,
<｜User｜>{prompt}<｜Assistant｜> and then </think> (chat mode) or <think>
(--thinking).

With --chat and no --prompt on a terminal, it holds a conversation: each line
you type is a user turn, the reply streams, Ctrl-D leaves.

Output: in plain mode each prompt is echoed, followed by its continuation; in
chat mode only the assistant's completion is printed (special tokens such as
</think> included, the final end-of-sentence token left out). Statistics
(prompt and generated tokens, load time, prefill time, decode tokens/s) go to
stderr.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import sys
import time

import jax

from . import DEFAULT_MODEL_DIR   # the packaged default model
from . import compile_cache, load
from .chat import encode_messages
from .checkpoint import CheckpointError, open_checkpoint, stored_formats
from .compile_time import CompileTimer
from .config import load_hf_config
from .engine import PREFILL_CHUNK
from .interactive import chat_loop, wants_interactive
from .memory_plan import memory_plan
from .ops.choice import record_dispatch
from .ops.plan import plan_kernels
from .settings import Settings
from .sharding import check_mesh, make_mesh
from .text import SAMPLING_DEFAULTS as DEFAULTS   # Model.complete's defaults too
from .text import TextBatch
from .text import prompt_ids as text_prompt_ids
from .tokenizer import BOS, Tokenizer

PROG = "python -m dsv4_jax.generate"
DEFAULT_PROMPT = "And it came to pass, when the king"
DEFAULT_CHAT_PROMPT = "Who was the first king of Israel?"
PROGRESS_MIN_BYTES = 2 ** 30        # show the loading bar for checkpoints this large even when stderr is no TTY
HEADER_PROMPT_CHARS = 60

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
batches:
  --prompt-file runs all its prompts as one batch (max_batch = number of
  prompts). With streaming on, the first prompt's text is streamed live and
  the others are printed when the batch finishes. Each prompt's block starts
  with a line "=== prompt i/N: <prompt> ===". --no-stream prints every block
  at the end.

--json:
  prints one JSON object (one line) on stdout and nothing else:
    {"checkpoint", "settings",
     "results": [{"prompt", "prompt_text" (the encoded prompt string),
                  "prompt_token_ids", "completion", "token_ids" (generated
                  ids, the stop token included when hit), "finish_reason"
                  ("stop" or "length")}, ...],
     "timing": {"load_s", "prefill_s", "decode_s", "compile_s", "prompt_tokens",
                "generated_tokens", "decode_tokens", "decode_tokens_per_s"},
     with --stats also "stats": {"prompt", "generated"} (per layer: the mean,
     max and min over calls of each measure, counts, and the flags)}

--stats:
  every layer measures, inside the compiled programs, over the real tokens:
  RMS of the residual streams entering it, after its attention and after its
  MoE; their max |x|; RMS of the attention and MoE outputs; the mHC mixing
  weights' range; router entropy (nats) and expert load (max / mean); the
  compressed entries a query attends; the share of activation block scales
  that saturate / underflow and the NVFP4 global scales used (act_quant).
  Two tables go to stderr: the prompt's prefill, and the generated tokens'
  decode steps (means over steps; max |x| the max). A layer is flagged for
  NaN / inf, a residual RMS growing more than 16x across a sub-layer (max |x|
  1000x), an output RMS of zero, or more than 1% of block scales saturating
  or underflowing (dsv4_jax/stats_report.py). Not with --speculative-tokens.

timing:
  prefill is the time to the first generated token, which includes compiling
  the programs on first use (compile_s, also on stderr: lowering and compiling
  or reading each new program from the cache); decode tokens/s
  counts the tokens after each sequence's first, summed over the batch.
  Compiled programs are cached in $DSV4_JAX_CACHE (default
  ~/.cache/dsv4_jax/jit; DSV4_JAX_CACHE=off or --no-compile-cache: no cache)
  unless JAX_COMPILATION_CACHE_DIR is set, which is used instead.

exit status:
  0 success; 1 bad input (checkpoint, config, tokenizer, prompt file, prompt
  too long); 2 bad command-line usage; 130 interrupted. Errors are one line on
  stderr starting with "error: ".
"""


class CLIError(Exception):
    """An expected failure: printed as one `error: ...` line, exit status `code`."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- argument parsing ------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise CLIError(f"{message} (see {PROG} --help)", EXIT_USAGE)


KERNEL_OVERRIDE_HELP = ("a per-op override of the kernel plan, OP=kernel or OP=reference (ops/choice.py; e.g. "
                        "attention_core=kernel, the opt-in decode attention kernel); repeatable")


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            allowed = f">= {low}" if high is None else f"in [{low}, {high})"
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {value}")
        return value
    return parse


_SIZE_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
PREFIX_CACHE_DEFAULT = "1G"


def byte_size(text: str) -> int:
    """argparse type: a size in bytes, "0" (off), or with a binary unit K, M, G, T (optionally followed by "iB" or
    "B"): "512M", "1G", "2GiB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.I)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 0, 512M or 1G, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _float_where(valid, requirement: str):
    """argparse type: a float for which valid(value) holds; otherwise 'must <requirement>, got ...'."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must {requirement}, got {text}")
        return value
    return parse


_temperature = _float_where(lambda v: math.isfinite(v) and v >= 0, "be a finite number >= 0")
_top_p = _float_where(lambda v: math.isfinite(v) and 0 < v <= 1, "lie in (0, 1]")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n", 1)[1].rstrip(), epilog=EPILOG, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="official DeepSeek-V4 checkpoint directory (config.json, tokenizer.json, safetensors); "
                          "default: the packaged default model")
    src.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="activation dtype (default: bfloat16)")
    src.add_argument("--act-quant", choices=("none", "fp8", "nvfp4"), default="none",
                     help="how activations meet quantized weights: none (W4A16/W8A16), fp8 (official numerics), "
                          "nvfp4 (W4A4) (default: none)")
    src.add_argument("--kernels", choices=("auto", "reference", "pallas", "interpret"), default="auto",
                     help="quantized matmuls on the GPU kernels or the pure-JAX reference: auto = on a CUDA device "
                          "the CUDA (ffi/) and Pallas kernels, elsewhere the reference; pallas = Pallas kernels only "
                          "(default: auto)")
    src.add_argument("--kernel-override", action="append", default=[], metavar="OP=CHOICE",
                     help=KERNEL_OVERRIDE_HELP)
    src.add_argument("--devices", type=_int_at_least(1), metavar="N",
                     help="devices to run on, the routed experts split over them (docs/sharding.md); "
                          "default: every local device of the default backend")
    src.add_argument("--no-simulate-quant", action="store_true",
                     help="turn off the model's built-in FP8/FP4 fake-quantization of KV and indexer")
    src.add_argument("--quantize-head", action="store_true", help="quantize the lm_head to NVFP4 at load")
    src.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                     help="how the decode state stores attention entries: auto = the activation dtype, fp8 = e4m3 "
                          "KV and e2m1 indexer keys with block scales (half the bytes; the same logits) "
                          "(default: auto)")
    src.add_argument("--max-seq-len", type=_int_at_least(1), default=4096, metavar="N",
                     help="context size the caches are allocated for; prompt + new tokens must fit (default: 4096)")
    src.add_argument("--prefill-chunk", type=_int_at_least(1), default=PREFILL_CHUNK, metavar="N",
                     help="prompt tokens per prefill step; bounds prefill memory (default: %(default)s)")
    src.add_argument("--plan", action="store_true",
                     help="print the per-device memory plan (weights, decode state, compiled temporaries of a "
                          "prefill chunk and a decode step) for these settings, and exit without loading weights")
    src.add_argument("--no-compile-cache", action="store_true",
                     help="do not use the persistent compilation cache")
    src.add_argument("--allow-long-context", action="store_true",
                     help="let --max-seq-len exceed the checkpoint's max_position_embeddings (the positions it was "
                          "trained for)")
    src.add_argument("--prefix-cache", type=byte_size, default=PREFIX_CACHE_DEFAULT, metavar="SIZE",
                     help="interactive chat: device memory for the conversation's decode-state snapshots, so that "
                          "each turn prefills only what it adds to the last prompt (e.g. 512M, 1G; 0: off; default: "
                          "%(default)s)")


    prm = p.add_argument_group("prompt")
    one = prm.add_mutually_exclusive_group()
    one.add_argument("--prompt", metavar="TEXT",
                     help=f"prompt text (default: {DEFAULT_PROMPT!r}, with --chat {DEFAULT_CHAT_PROMPT!r})")
    one.add_argument("--prompt-file", metavar="FILE",
                     help="file with one prompt per line (blank lines skipped; '-' reads stdin), run as one batch")
    prm.add_argument("--chat", action="store_true",
                     help="encode each prompt as a user turn of the DeepSeek-V4 chat format")
    prm.add_argument("--system", metavar="TEXT", help="system prompt (implies --chat)")
    prm.add_argument("--thinking", action="store_true",
                     help="thinking mode: the assistant turn opens with <think> instead of </think> (implies --chat)")
    prm.add_argument("--reasoning-effort", choices=("high", "max"),
                     help="reasoning effort in thinking mode ('max' adds the official prefix; needs --thinking)")
    prm.add_argument("--special-tokens", action="store_true",
                     help="special-token strings in a plain prompt (e.g. <｜User｜>) become control tokens; by default "
                          "every prompt character is text")

    smp = p.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=_int_at_least(1), default=DEFAULTS["max_new_tokens"], metavar="N",
                     help=f"tokens to generate per prompt at most (default: {DEFAULTS['max_new_tokens']})")
    smp.add_argument("--temperature", type=_temperature, default=DEFAULTS["temperature"], metavar="T",
                     help=f"sampling temperature, 0 = greedy (default: {DEFAULTS['temperature']})")
    smp.add_argument("--top-p", type=_top_p, default=DEFAULTS["top_p"], metavar="P",
                     help=f"nucleus sampling mass in (0, 1], 1 = off (default: {DEFAULTS['top_p']})")
    smp.add_argument("--top-k", type=_int_at_least(0), default=DEFAULTS["top_k"], metavar="K",
                     help=f"sample among the K most likely tokens, 0 = off (default: {DEFAULTS['top_k']})")
    smp.add_argument("--seed", type=_int_at_least(0, 2**32), default=DEFAULTS["seed"], metavar="S",
                     help=f"random seed; the same seed and settings give the same text (default: {DEFAULTS['seed']})")
    smp.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop a prompt's generation when its text contains TEXT (repeatable); the text ends "
                          "before it")
    smp.add_argument("--speculative-tokens", type=_int_at_least(0, 16), default=0, metavar="K",
                     help="speculative decoding: the MTP block drafts K tokens per step and the model verifies them "
                          "in one pass; greedy output is unchanged, sampled output keeps its distribution "
                          "(default: 0, off)")

    out = p.add_argument_group("output")
    out.add_argument("--no-stream", action="store_true", help="print the text when generation ends")
    out.add_argument("--json", action="store_true",
                     help="print one machine-readable JSON object on stdout (see below); implies --no-stream")
    out.add_argument("--verbose", action="store_true",
                     help="print on stderr the backend, the devices and the kernel each matmul kind takes")
    out.add_argument("--stats", action="store_true",
                     help="measure every layer's numbers on the device (residual and output sizes, mHC mixing, "
                          "routing, activation block scales) and print a per-layer table on stderr after the reply, "
                          "anomalous layers flagged (see below); in --json under \"stats\"")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.reasoning_effort is not None and not args.thinking:
        raise CLIError(f"--reasoning-effort needs --thinking (see {PROG} --help)", EXIT_USAGE)
    args.chat = args.chat or args.thinking or args.system is not None
    if args.special_tokens and args.chat:
        raise CLIError(f"--special-tokens applies to plain prompts; a chat prompt's control tokens come from the "
                       f"chat format (see {PROG} --help)", EXIT_USAGE)
    if any(not s for s in args.stop):
        raise CLIError(f"--stop needs a non-empty TEXT (see {PROG} --help)", EXIT_USAGE)
    if args.stats and args.speculative_tokens:
        raise CLIError(f"--stats needs --speculative-tokens 0 (speculative steps have no layer statistics; see "
                       f"{PROG} --help)", EXIT_USAGE)
    return args


# ---- prompts ---------------------------------------------------------------------------------------------------

def read_prompts(args) -> list[str]:
    """The user's prompt texts (before encoding)."""
    if args.prompt_file is None:
        prompt = args.prompt if args.prompt is not None else (DEFAULT_CHAT_PROMPT if args.chat else DEFAULT_PROMPT)
        if not prompt.strip():
            raise CLIError("--prompt is empty")
        return [prompt]
    name = "stdin" if args.prompt_file == "-" else args.prompt_file
    try:
        if args.prompt_file == "-":
            text = sys.stdin.read()
        else:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
    except UnicodeDecodeError as err:
        raise CLIError(f"--prompt-file {name}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise CLIError(f"--prompt-file {name}: {err.strerror or _one_line(err)}") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CLIError(f"--prompt-file {name}: no prompts (expected one prompt per line)")
    return prompts


def encode_prompt(prompt: str, args) -> str:
    """The prompt string fed to the tokenizer: BOS + text, or the DeepSeek-V4 chat encoding."""
    if not args.chat:
        return BOS + prompt
    messages = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    return encode_messages(messages, thinking_mode="thinking" if args.thinking else "chat",
                           reasoning_effort=args.reasoning_effort)


# ---- loading ---------------------------------------------------------------------------------------------------

def _setup_compile_cache(args):
    """The library turned the cache on at import (dsv4_jax.compile_cache); --no-compile-cache turns it off, unless
    the user set JAX's own cache directory."""
    if args.no_compile_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        compile_cache.disable()


class _LoadProgress:
    """tqdm bar on stderr for the weight loading (bytes read, and the rate in GB/s); shown for large checkpoints
    or when stderr is a terminal."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int):
        if self.bar is None:
            from tqdm import tqdm
            tty = sys.stderr.isatty()
            self.bar = tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1000,
                            file=sys.stderr, leave=False, disable=not (tty or total >= PROGRESS_MIN_BYTES),
                            mininterval=0.1 if tty else 5.0)
        self.bar.update(done - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _mesh(args, directory: str | None, cfg=None):
    """The mesh of --devices (None for one device: the single-device programs), checked against the model (`cfg`,
    or the config of the checkpoint in `directory`)."""
    available = len(jax.local_devices())
    n = available if args.devices is None else args.devices
    if n > available:
        raise CLIError(f"--devices {n}: only {available} local {jax.default_backend()} device(s) here")
    if n == 1:
        return None
    mesh = make_mesh(n)
    if cfg is None:
        try:
            cfg = load_hf_config(directory)
        except (ValueError, OSError):
            return mesh                               # the load reports what is wrong with the checkpoint
    try:
        check_mesh(cfg, mesh)
    except ValueError as err:
        raise CLIError(f"--devices {n}: {err}") from None
    return mesh


def _memory_plan(args, directory: str, mesh, batch: int) -> str:
    """The --plan report: the checkpoint's stored formats from its headers, programs compiled abstractly."""
    try:
        cfg = load_hf_config(directory)
        stored = stored_formats(cfg, open_checkpoint(directory), directory, args.quantize_head)
    except (CheckpointError, OSError) as err:
        raise CLIError(_one_line(err)) from None
    plan = memory_plan(cfg, mesh=mesh, max_seq_len=args.max_seq_len, max_batch=batch,
                       prefill_chunk=min(args.prefill_chunk, args.max_seq_len), dtype=args.dtype, stored=stored,
                       compiled=True, kv_cache_dtype=_kv_cache_dtype(args),
                       prefix_cache=args.prefix_cache)
    return f"{directory}: --max-seq-len {args.max_seq_len}, batch {batch}, --prefill-chunk {args.prefill_chunk}\n" \
        + plan.table()


def checked_config(args, directory: str):
    """The checkpoint's config (its errors as one line), with --max-seq-len checked against it."""
    try:
        cfg = load_hf_config(directory)
    except (ValueError, FileNotFoundError) as err:
        raise CLIError(_one_line(err)) from None
    try:                      # the Model's rule (Settings.check_context), before any weight is read
        Settings(max_seq_len=args.max_seq_len, allow_long_context=args.allow_long_context).check_context(cfg)
    except ValueError as err:
        raise CLIError(f"--max-seq-len {args.max_seq_len}: {_one_line(err)}", EXIT_USAGE) from None
    return cfg


def model_settings(args, max_batch: int):
    """The Model's settings from the command line's options (the CLI's and the server's), checked now, before any
    weight is read; the kernel plan of --kernels is made here too (e.g. 'pallas' needs a GPU)."""
    try:
        kernels = plan_kernels(args.kernels)
    except ValueError as err:
        raise CLIError(f"--kernels {args.kernels}: {err}") from None
    try:
        return Settings(dtype=args.dtype, max_seq_len=args.max_seq_len, max_batch=max_batch,
                        simulate_quant=not getattr(args, "no_simulate_quant", False),
                        act_quant=getattr(args, "act_quant", "none"), prefill_chunk=args.prefill_chunk,
                        quantize_head=getattr(args, "quantize_head", False), kernels=kernels,
                        kernel_overrides=args.kernel_override, kv_cache_dtype=_kv_cache_dtype(args),
                        prefix_cache=getattr(args, "prefix_cache", 0), allow_long_context=args.allow_long_context)
    except ValueError as err:
        raise CLIError(_one_line(err), EXIT_USAGE) from None


def _kv_cache_dtype(args):
    return None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def _check_checkpoint_dir(args) -> str:
    directory = args.checkpoint if args.checkpoint is not None else DEFAULT_MODEL_DIR
    if args.checkpoint is None and not os.path.isfile(os.path.join(directory, "model.safetensors")):
        raise CLIError(f"the packaged default model is missing ({directory}/model.safetensors); "
                       f"pass --checkpoint DIR")
    if not os.path.exists(directory):
        raise CLIError(f"--checkpoint {directory}: no such directory")
    if not os.path.isdir(directory):
        raise CLIError(f"--checkpoint {directory}: not a directory (expected an official DeepSeek-V4 checkpoint)")
    return directory


# ---- generation ------------------------------------------------------------------------------------------------

def _header(index: int, count: int, prompt: str) -> str:
    shown = prompt if len(prompt) <= HEADER_PROMPT_CHARS else prompt[:HEADER_PROMPT_CHARS - 1] + "…"
    return f"=== prompt {index + 1}/{count}: {shown} ==="


def _write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args) -> int:

    directory = _check_checkpoint_dir(args)
    # Everything that can be checked without reading weights is checked first, so bad input fails fast.
    cfg = checked_config(args, directory)
    try:
        tokenizer = Tokenizer(directory)
    except (ValueError, FileNotFoundError) as err:
        raise CLIError(_one_line(err)) from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CLIError(f"{tokenizer.path}: {tokenizer.vocab_size} tokens, but the model has only vocab_size="
                       f"{cfg.vocab_size} (tokenizer and checkpoint do not match)")

    interactive = wants_interactive(args)          # --chat on a terminal without --prompt: a conversation
    if interactive and args.stats:
        raise CLIError(f"--stats applies to one reply: give --prompt or --prompt-file (see {PROG} --help)",
                       EXIT_USAGE)
    prompts = [] if interactive else read_prompts(args)
    try:
        prompt_texts = [encode_prompt(p, args) for p in prompts]
        prompt_ids = [text_prompt_ids(tokenizer, p, chat=args.chat, system=args.system, thinking=args.thinking,
                                      reasoning_effort=args.reasoning_effort, special_tokens=args.special_tokens)
                      for p in prompts]
    except ValueError as err:  # the chat encoder rejects malformed turns
        raise CLIError(_one_line(err)) from None
    if args.speculative_tokens and not cfg.n_mtp_layers:
        raise CLIError(f"--speculative-tokens needs a model with an MTP block; {directory} has none", EXIT_USAGE)
    spare = args.speculative_tokens
    for i, ids in enumerate(prompt_ids):
        if len(ids) + args.max_new_tokens + spare > args.max_seq_len:
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            also = f" and --speculative-tokens {spare}" if spare else ""
            raise CLIError(f"{which} has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens}{also} it "
                           f"needs {len(ids) + args.max_new_tokens + spare} positions, more than --max-seq-len "
                           f"{args.max_seq_len}")

    if not interactive:
        args.prefix_cache = 0          # snapshots are kept between turns of a conversation; one reply needs none
    settings = model_settings(args, max(1, len(prompts)))
    mesh = _mesh(args, directory)
    if args.plan:
        print(_memory_plan(args, directory, mesh, batch=max(1, len(prompts))))
        return 0
    _setup_compile_cache(args)
    progress = _LoadProgress()
    t_load = time.perf_counter()
    try:
        model = load(directory, settings=settings, mesh=mesh, progress=progress)
    except (CheckpointError, OSError) as err:
        raise CLIError(_one_line(err)) from None
    finally:
        progress.close()
    load_s = time.perf_counter() - t_load
    if interactive:
        return chat_loop(model, args)

    if args.verbose:
        _describe_run(model, mesh)
    batch = len(prompts)
    streaming = not (args.no_stream or args.json)
    echo = not args.chat           # plain prompts are echoed before their continuation
    first_token_at: list[float] = []

    def stream_text(row: int, text: str):
        if streaming and row == 0:
            _write(text)

    texts = TextBatch(tokenizer, prompt_ids, args.stop, [tokenizer.eos_id], stream_text)

    def on_tokens(new_tokens: list[list[int]]):
        if not first_token_at:
            first_token_at.append(time.perf_counter())
        return texts.on_tokens(new_tokens)

    if streaming:
        if batch > 1:
            _write(_header(0, batch, prompts[0]) + "\n")
        if echo:
            _write(prompts[0])

    def compiling_notice():
        # said before it is known which programs the cache holds: the line after the run counts both
        cache = jax.config.jax_compilation_cache_dir
        source = f"read from {cache} or compiled and stored there" if cache else "compiled: no compilation cache"
        print(f"preparing the programs for these shapes ({source})", file=sys.stderr, flush=True)

    t_gen = time.perf_counter()
    try:
        with CompileTimer(on_first=compiling_notice) as compile_timer, _recording(args.verbose) as dispatch:
            result = model.generate(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stream=on_tokens,
                                    speculative_tokens=args.speculative_tokens, stats=args.stats)
    except KeyboardInterrupt:
        sys.stdout.flush()
        timing = _timing(texts, prompt_ids, load_s, t_gen, time.perf_counter(), first_token_at,
                         compile_timer.seconds)
        print("\ninterrupted; " + _statistics(batch, timing, bool(first_token_at)), file=sys.stderr)
        return EXIT_INTERRUPTED
    t_end = time.perf_counter()
    if compile_timer.seconds:
        print(f"compiled {compile_timer.compiled} programs and read {compile_timer.cache_hits} from the "
              f"compilation cache in {compile_timer.seconds:.2f} s", file=sys.stderr)
    if args.verbose:
        _describe_dispatch(dispatch)

    completions = texts.completions(result.finish_reasons)     # streams row 0's held-back text
    if streaming:
        _write("\n")
    if not args.json:
        for i in range(0 if not streaming else 1, batch):
            if batch > 1:
                _write(("\n" if i else "") + _header(i, batch, prompts[i]) + "\n")
            _write((prompts[i] if echo else "") + completions[i].text + "\n")

    timing = _timing(texts, prompt_ids, load_s, t_gen, t_end, first_token_at, compile_timer.seconds)
    if args.json:
        doc = {
            "checkpoint": os.path.abspath(directory),
            "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
                         "max_seq_len": args.max_seq_len, "prefill_chunk": args.prefill_chunk,
                         "dtype": args.dtype, "act_quant": args.act_quant, "kernels": args.kernels,
                         "kernel_overrides": dict(model.context.kernels.overrides),
                         "simulate_quant": not args.no_simulate_quant, "quantize_head": args.quantize_head,
                         "kv_cache_dtype": args.kv_cache_dtype, "speculative_tokens": args.speculative_tokens,
                         "chat": args.chat, "thinking": args.thinking, "system": args.system,
                         "reasoning_effort": args.reasoning_effort, "special_tokens": args.special_tokens},
            "results": [{"prompt": p, "prompt_text": t, "prompt_token_ids": c.prompt_token_ids,
                         "completion": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                        for p, t, c in zip(prompts, prompt_texts, completions)],
            "timing": timing,
        }
        if result.acceptance is not None:
            doc["speculative"] = {"tokens_per_step": result.acceptance, "acceptance_rates": result.acceptance_rates}
        if args.stats:
            doc["stats"] = {"prompt": result.prompt_stats.to_json(),
                            "generated": result.stats.to_json() if result.stats is not None else None}
        _write(json.dumps(doc) + "\n")
    if args.stats:
        print("\nprompt (prefill) " + result.prompt_stats.table(), file=sys.stderr)
        if result.stats is not None:
            print("\ngenerated tokens (decode steps) " + result.stats.table(), file=sys.stderr)
    if result.acceptance is not None:
        rates = ", ".join(f"{r:.2f}" for r in result.acceptance_rates)
        print(f"speculative decoding: {result.acceptance:.2f} tokens per model step; draft acceptance by position: "
              f"{rates}", file=sys.stderr)
    print(_statistics(batch, timing, bool(first_token_at)), file=sys.stderr)
    return EXIT_OK


def _timing(texts, prompt_ids, load_s: float, t_gen: float, t_end: float, first_token_at: list[float],
            compile_s: float) -> dict:
    """The run's timing (--json "timing"; also after Ctrl-C, for the tokens generated so far): prefill is the time
    to the first token, decode the rest, counting the tokens after each sequence's first."""
    generated = texts.generated_tokens
    prefill_s = (first_token_at[0] if first_token_at else t_end) - t_gen
    decode_s = t_end - t_gen - prefill_s
    decode_tokens = generated - sum(1 for s in texts.streams if s.token_ids)
    rate = decode_tokens / decode_s if decode_tokens and decode_s > 0 else None
    return {"load_s": round(load_s, 4), "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
            "compile_s": round(compile_s, 4), "prompt_tokens": sum(len(ids) for ids in prompt_ids),
            "generated_tokens": generated, "decode_tokens": decode_tokens,
            "decode_tokens_per_s": None if rate is None else round(rate, 2)}


def _statistics(batch: int, timing: dict, started: bool) -> str:
    """The statistics line on stderr; `started`: a first token arrived."""
    head = (f"{'batch ' + str(batch) + ' | ' if batch > 1 else ''}prompt tokens: {timing['prompt_tokens']} | "
            f"generated tokens: {timing['generated_tokens']} | load: {timing['load_s']:.2f} s | ")
    if not started:
        return head + f"{timing['prefill_s']:.2f} s without a first token (incl. {timing['compile_s']:.2f} s compiling)"
    rate = timing["decode_tokens_per_s"]
    return head + (f"prefill: {timing['prefill_s']:.2f} s (to first token, incl. {timing['compile_s']:.2f} s "
                   f"compiling) | decode: {timing['decode_tokens']} tokens in {timing['decode_s']:.2f} s, "
                   f"{'n/a' if rate is None else f'{rate:.1f} tokens/s'}")


def _recording(verbose: bool):
    """ops.choice.record_dispatch() when --verbose (every op's choice, recorded as programs are traced)."""
    return record_dispatch() if verbose else contextlib.nullcontext([])


def _describe_run(model, mesh):
    devices = mesh.devices.flatten().tolist() if mesh is not None else [jax.devices()[0]]
    plan = model.context.kernels
    print(f"backend: {jax.default_backend()} | devices: {len(devices)} x {devices[0].device_kind} | kernels: "
          f"{plan.mode} -> {plan.backend or 'reference (pure JAX)'}{' + ffi' if plan.ffi else ''}", file=sys.stderr)


def _describe_dispatch(records):
    """One stderr line per (op, phase, call, weight format, kernel) the traced programs chose, with its count."""
    counts = collections.Counter((c.op, c.phase, c.call, c.weight, c.kernel) for c in records)
    for (op, phase, call, fmt, used), n in sorted(counts.items(), key=str):
        what = f"{call} ({fmt})" if fmt else call
        print(f"{op} [{phase}]: {what} -> {used or 'the reference (XLA)'} x {n}", file=sys.stderr)


def main(argv=None) -> int:
    try:
        return run(parse_args(argv))
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\nerror: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (e.g. `| head`): stop quietly; point stdout at devnull so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as err:
        if not _is_out_of_memory(err):
            raise
        print(f"error: out of memory: {_one_line(err)} (a smaller --max-seq-len or fewer prompts needs less)",
              file=sys.stderr)
        return EXIT_ERROR


def _is_out_of_memory(err: Exception) -> bool:
    """XLA's allocation failure (device or host): an expected condition for big models, not a bug."""
    return type(err).__name__ == "JaxRuntimeError" and _one_line(err).startswith("RESOURCE_EXHAUSTED")


if __name__ == "__main__":
    sys.exit(main())
