"""Decode cost against max_seq_len at a short context: the context buckets make a step read the compressed caches
only up to what its positions can see (run_context.RunContext.context_limit, api.context_bucket).

    python benchmarks/context_cost.py --json out.json

One process, the packaged default model (bf16, kernels as planned for this machine), one sequence with a 64-token
prompt: ms per decode step from the jitted generation loop (`--steps` steps per call, best of `--repeats` calls,
divided), at each max_seq_len, with the buckets on and off (off: every step reads the whole max_seq_len buffers,
as before the buckets). Then the number of distinct generation programs compiled over a `--long`-token generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax import api, generation  # noqa: E402
from dsv4_jax.sampling import Sampling  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(dsv4_jax.__file__), "default_model")


def step_ms(model, prompt, bucketed: bool, steps: int, repeats: int) -> float:
    logits, state = model.prefill(prompt)
    gen, _ = generation.start(state, logits, Sampling.rows(1, max_new_tokens=10 ** 6))
    halt = jnp.zeros((1,), bool)
    ctx = model.context_for(prompt.shape[1] + steps * (repeats + 1)) if bucketed else model.context
    kw = dict(cfg=model.config, ctx=ctx, max_seq_len=model.max_seq_len, chunk=steps)
    gen, out = generation.generate_chunk(model.params, gen, halt, **kw)        # compile
    jax.block_until_ready(out.tokens)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        gen, out = generation.generate_chunk(model.params, gen, halt, **kw)
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - t)
    return best / steps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-seq-lens", type=int, nargs="+", default=[4096, 65536, 262144])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=0, help="also count the programs of a generation this long")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    prompt = np.random.default_rng(0).integers(2, 4096, (1, 64)).astype(np.int32)
    rows = []
    print(f"{'max_seq_len':>11} {'buckets':>8} {'ms/step':>8}")
    for max_seq_len in args.max_seq_lens:
        model = dsv4_jax.load(DEFAULT_MODEL, max_seq_len=max_seq_len, allow_long_context=True)
        for bucketed in (True, False):
            ms = step_ms(model, prompt, bucketed, args.steps, args.repeats)
            rows.append(dict(max_seq_len=max_seq_len, buckets=bucketed, ms_per_step=ms))
            print(f"{max_seq_len:>11} {'on' if bucketed else 'off':>8} {ms:>8.2f}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "context": 64,
              "rows": rows}
    if args.long:
        model = dsv4_jax.load(DEFAULT_MODEL, max_seq_len=args.long + 128, allow_long_context=True)
        before = generation.generate_chunk._cache_size()
        t = time.perf_counter()
        model.generate([list(prompt[0])], max_new_tokens=args.long, chunk=256, stop_tokens=[-5])
        programs = generation.generate_chunk._cache_size() - before
        buckets = sorted({api.context_bucket(64 + k, model.max_seq_len) or model.max_seq_len
                          for k in range(0, args.long + 256, 256)})
        print(f"{args.long}-token generation: {programs} generation programs compiled (buckets {buckets}), "
              f"{time.perf_counter() - t:.0f} s")
        result["long"] = dict(tokens=args.long, programs=programs, buckets=buckets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
