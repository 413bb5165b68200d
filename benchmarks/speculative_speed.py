"""Speculative decoding with the MTP block on the packaged default model: acceptance and wall time per token.

    python benchmarks/speculative_speed.py --out docs/bench/speculative_cpu.json

One process, the packaged default model (kernels as planned for this machine), batch 1, the opening words of each
held-out chapter's first verse (chapters the default model never trained on: docs/default_model_data.md) as
prompts. For speculative_tokens k = 0 (plain decoding, the baseline) and each --ks value, greedy and sampled
(temperature 0.6, top-p 0.95, the CLI's defaults; --temperatures): tokens per main-model step, draft acceptance by position, and
wall ms per generated token (after a compiling warm-up run of each setting; best of --repeats runs). Prints a
table and writes --out JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import dsv4_jax  # noqa: E402
from scripts.held_out_prompts import HELD_OUT_PROMPTS  # noqa: E402


def measure(model, prompts, k: int, temperature: float, max_new_tokens: int, repeats: int) -> dict:
    """Every prompt alone (batch 1): ms per generated token over all prompts, best of `repeats` passes."""
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
              speculative_tokens=k)
    model.generate([prompts[0]], **kw)                                # compile (prefill buckets, loop)
    best, results = float("inf"), []
    for _ in range(repeats):
        t = time.perf_counter()
        results = [model.generate([p], seed=i, **kw) for i, p in enumerate(prompts)]
        best = min(best, time.perf_counter() - t)
    tokens = sum(len(r.tokens[0]) for r in results)
    row = {"k": k, "temperature": temperature, "tokens": tokens, "ms_per_token": best / tokens * 1e3,
           "outputs": [r.tokens[0] for r in results]}
    if k:
        # per prompt the loop reports tokens per step; weigh by steps ~ tokens / acceptance
        steps = [len(r.tokens[0]) / r.acceptance for r in results]
        row["tokens_per_step"] = tokens / sum(steps)
        row["acceptance_rates"] = [sum(r.acceptance_rates[j] * s for r, s in zip(results, steps)) / sum(steps)
                                   for j in range(k)]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="1,2,3", help="speculative_tokens values besides 0 (comma-separated)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--temperatures", default="0,0.6", help="sampling temperatures to run (0: greedy)")
    p.add_argument("--out", metavar="FILE")
    args = p.parse_args(argv)
    ks = [0] + [int(v) for v in args.ks.split(",") if v]

    model = dsv4_jax.load(dtype=args.dtype, max_seq_len=512)
    tok = model.tokenizer
    prompts = [[tok.bos_id] + tok.encode(text) for text in HELD_OUT_PROMPTS]
    result = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
              "machine": {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                          "host": platform.node(), "cpu_count": os.cpu_count(), "jax": jax.__version__},
              "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": HELD_OUT_PROMPTS, "rows": []}
    print(f"{'sampling':>9} {'k':>2} {'tokens/step':>11} {'acceptance by position':>24} {'ms/token':>9} "
          f"{'speed-up':>8}")
    for temperature in [float(v) for v in args.temperatures.split(",")]:
        base = None
        for k in ks:
            row = measure(model, prompts, k, temperature, args.max_new_tokens, args.repeats)
            base = base or row
            row["speedup"] = base["ms_per_token"] / row["ms_per_token"]
            if k and temperature == 0:
                row["greedy_equals_plain"] = row["outputs"] == base["outputs"]
            result["rows"].append(row)
            rates = " ".join(f"{r:.2f}" for r in row.get("acceptance_rates", []))
            print(f"{'greedy' if temperature == 0 else f'T={temperature}':>9} {k:>2} {row.get('tokens_per_step', 1.0):>11.2f} "
                  f"{rates:>24} {row['ms_per_token']:>9.2f} {row['speedup']:>7.2f}x", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
