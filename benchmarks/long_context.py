"""Prefill chunk time and decode step time against the context in use, up to 256K tokens, in one process.

    python benchmarks/long_context.py --out docs/bench/long_context.json --plot docs/long_context.png

The packaged default model (bf16), one sequence of random tokens prefilled `--chunk` tokens at a time to
`--max-context`: the time of every chunk against its position (the first chunk of each context bucket also
compiles; those are marked and left out of the plot), and at each `--decode-at` context the ms per decode step in
the jitted generation loop (`--steps` steps per call, best of 2 calls after a compiling one, on a copy of the
state). Once with the caches in the activation dtype and once with `kv_cache_dtype="fp8"`. Also the process's
peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax import api, generation  # noqa: E402
from dsv4_jax.sampling import Sampling  # noqa: E402


def decode_ms(model, state, logits, position: int, steps: int) -> float:
    """ms per decode step from `position` on, in the generation loop, on a copy of `state`."""
    gen, _ = generation.start(jax.tree.map(jnp.copy, state), logits, Sampling.rows(1, max_new_tokens=10 ** 7))
    kw = dict(cfg=model.config, ctx=model.context_for(position + 3 * steps + 1), max_seq_len=model.max_seq_len,
              chunk=steps)
    best = float("inf")
    for call in range(3):                                  # the first call compiles
        t = time.perf_counter()
        gen, out = generation.generate_chunk(model.params, gen, jnp.zeros((1,), bool), **kw)
        jax.block_until_ready(out.tokens)
        if call:
            best = min(best, time.perf_counter() - t)
    return best / steps * 1e3


def run(kv_cache_dtype, args) -> dict:
    # the default model was trained for 4,096 positions: its cost at longer contexts is what is measured here
    model = dsv4_jax.load(max_seq_len=args.max_context + 4 * args.steps, prefill_chunk=args.chunk,
                          kv_cache_dtype=kv_cache_dtype, allow_long_context=True)
    tokens = np.random.default_rng(0).integers(2, model.config.vocab_size, (1, args.max_context)).astype(np.int32)
    state = model.init_state(1)
    chunks, decode, seen_buckets = [], [], set()
    for start in range(0, args.max_context, args.chunk):
        end = start + args.chunk
        bucket = api.context_bucket(end, model.max_seq_len)
        t = time.perf_counter()
        logits, state = model.prefill(tokens[:, start:end], state=state)
        jax.block_until_ready(logits)
        chunks.append({"position": end, "ms": 1e3 * (time.perf_counter() - t), "compiles": bucket not in seen_buckets})
        seen_buckets.add(bucket)
        if end in args.decode_at:
            decode.append({"context": end, "ms_per_step": decode_ms(model, state, logits, end, args.steps)})
            print(f"{kv_cache_dtype or 'bf16':>5} context {end:>7}: decode {decode[-1]['ms_per_step']:.2f} ms/step, "
                  f"prefill chunk {chunks[-1]['ms']:.0f} ms", flush=True)
    assert np.isfinite(np.asarray(logits)).all(), "non-finite logits at the end of the prefill"
    return {"kv_cache_dtype": kv_cache_dtype, "state_bytes": model.state_bytes(), "chunks": chunks,
            "decode": decode}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for side in result["runs"]:
        label = side["kv_cache_dtype"] or "bf16 caches"
        warm = [c for c in side["chunks"] if not c["compiles"]]
        left.plot([c["position"] for c in warm], [c["ms"] for c in warm], ".", ms=3, label=label)
        right.plot([d["context"] for d in side["decode"]], [d["ms_per_step"] for d in side["decode"]], "o-",
                   label=label)
    left.set(xlabel="position at the end of the chunk (tokens)", ylabel=f"ms per {result['chunk']}-token chunk",
             title="prefill chunk time")
    right.set(xscale="log", xlabel="context (tokens)", ylabel="ms per decode step", title="decode step time")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"default model, {result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-context", type=int, default=262144)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode-at", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"], choices=("auto", "fp8"))
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.max_context % args.chunk or any(c % args.chunk for c in args.decode_at):
        ap.error("--max-context and every --decode-at must be multiples of --chunk")
    result = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
              "command": " ".join(["python benchmarks/long_context.py"] + (argv or sys.argv[1:])),
              "chunk": args.chunk, "runs": []}
    for name in args.kv_cache_dtypes:
        result["runs"].append(run(None if name == "auto" else name, args))
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if args.out:                              # after each run: a run that is stopped keeps what it finished
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"peak resident memory {result['peak_rss_bytes'] / 2**30:.2f} GiB")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
