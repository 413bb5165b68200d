"""What each numerics mode costs in accuracy: the KL divergence of the default model's next-token distributions
under each `dtype` x `act_quant` mode from the float32 truth (float32 activations, act_quant "none": every
quantized weight dequantized exactly, activations unrounded), teacher-forced over the same texts.

    python benchmarks/act_quant_kl.py --tokens 256 --out out/act_quant_kl.json      # CPU, a few minutes

The texts: the float32 model's own greedy continuations (--tokens each) of the held-out prompts
(scripts/held_out_prompts.py), so every mode reads the same in-distribution tokens. Per mode: mean and 99th
percentile of KL(truth || mode) in nats over all positions, and how often the mode's top token is the truth's.
Every mode keeps the model's trained roundings (`simulate_quant`); the kernels are the reference's (on a GPU the
kernel plans give these numerics to float32 rounding, tests/test_kernel_dispatch.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from scripts.held_out_prompts import HELD_OUT_PROMPTS  # noqa: E402

MODES = [("bfloat16", "none"), ("bfloat16", "fp8"), ("bfloat16", "nvfp4"), ("float32", "fp8"), ("float32", "nvfp4")]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def texts(truth, tokens: int) -> np.ndarray:
    """[P, L] ids: BOS, each held-out prompt, the float32 model's greedy continuation (up to `tokens`); prompts and
    continuations cut to the shortest so the texts form one batch."""
    tok = truth.tokenizer
    prompts = [[tok.bos_id] + tok.encode(p) for p in HELD_OUT_PROMPTS]
    shortest = min(len(p) for p in prompts)
    prompts = [p[:shortest] for p in prompts]
    out = truth.generate(prompts, max_new_tokens=tokens)
    n = min(len(t) for t in out.tokens)                    # (a text may end early on EOS)
    return np.array([p + list(t[:n]) for p, t in zip(prompts, out.tokens)], np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="generated tokens per held-out prompt (default 256)")
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args(argv)
    model = dsv4_jax.load(dtype="float32", max_batch=len(HELD_OUT_PROMPTS))
    ids = texts(model, args.tokens)
    truth = log_softmax(np.asarray(model.forward(ids)))
    p_truth = np.exp(truth)
    rows = []
    print(f"{ids.shape[0]} texts x {ids.shape[1]} tokens; KL(float32 truth || mode) in nats per position")
    print(f"{'dtype':>9} {'act_quant':>9} {'mean KL':>10} {'p99 KL':>10} {'top-1 agrees':>12}")
    for dtype, act_quant in MODES:
        mode = log_softmax(np.asarray(dsv4_jax.load(dtype=dtype, act_quant=act_quant).forward(ids)))
        kl = (p_truth * (truth - mode)).sum(axis=-1)
        agree = float((truth.argmax(-1) == mode.argmax(-1)).mean())
        rows.append({"dtype": dtype, "act_quant": act_quant, "mean_kl": float(kl.mean()),
                     "p99_kl": float(np.percentile(kl, 99)), "top1_agreement": agree})
        print(f"{dtype:>9} {act_quant:>9} {kl.mean():>10.2e} {np.percentile(kl, 99):>10.2e} {100 * agree:>11.1f}%",
              flush=True)
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(),
                "processor": platform.processor() or platform.machine(), "backend": jax.default_backend(),
                "command": "python benchmarks/act_quant_kl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "texts": int(ids.shape[0]), "tokens_per_text": int(ids.shape[1])}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "modes": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
