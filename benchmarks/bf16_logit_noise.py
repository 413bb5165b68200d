"""How far the default model's bf16 logits are from its float32 logits, both on the reference path: the noise floor
for any bf16-vs-reference comparison of the model (tests/test_kernel_dispatch.py's GPU model test takes its bounds
from this). For each random prompt (2 sequences x 12 tokens): relative Frobenius error of the prefill and one decode
step's logits, and whether each sequence's top token is in the other path's top 5 (both ways). Last line per mode:
a different prompt, i.e. what an unrelated (wrong) result looks like.

    PYTHONPATH=. python3 benchmarks/bf16_logit_noise.py [--prompts 20] [--act-quant none,fp8] [--interpret]   # CPU

--interpret also runs the bf16 model with the Pallas kernels in interpret mode (the CPU's stand-in for the GPU
kernels) and prints its largest error against the bf16 reference (slow: a few minutes).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from tests.logit_checks import top_tokens_agree  # noqa: E402

DEFAULT_MODEL = os.path.join(dsv4_jax.__path__[0], "default_model")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def prefill_and_step(model, prompt):
    logits, state = model.prefill(prompt)
    return logits, model.decode(jnp.asarray([3, 4], jnp.int32), state)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--act-quant", default="none,fp8")
    ap.add_argument("--interpret", action="store_true", help="also bf16 with the kernels in interpret mode")
    args = ap.parse_args()
    for act_quant in args.act_quant.split(","):
        kw = dict(max_seq_len=128, max_batch=2, act_quant=act_quant, kernels="reference")
        f32 = dsv4_jax.load(DEFAULT_MODEL, dtype="float32", **kw)
        b16 = dsv4_jax.load(DEFAULT_MODEL, dtype="bfloat16", **kw)
        kernels = dsv4_jax.load(DEFAULT_MODEL, dtype="bfloat16", **{**kw, "kernels": "interpret"}) \
            if args.interpret else None
        errors, agree, kernel_errors = [], True, []
        for seed in range(args.prompts):
            prompt = np.random.default_rng(100 + seed).integers(0, 4096, (2, 12)).astype(np.int32)
            (lf, df), (lb, db) = prefill_and_step(f32, prompt), prefill_and_step(b16, prompt)
            errors.append(max(rel(lb, lf), rel(db, df)))
            agree &= top_tokens_agree(lb, lf) and top_tokens_agree(db, df)
            if kernels is not None:
                lk, dk = prefill_and_step(kernels, prompt)
                kernel_errors.append(max(rel(lk, lb), rel(dk, db)))
        e = np.array(errors)
        print(f"act_quant={act_quant}: bf16 vs float32 logits over {len(e)} prompts: median {np.median(e):.4f}, "
              f"90th pct {np.quantile(e, 0.9):.4f}, max {e.max():.4f}; top tokens within each other's top 5: {agree}")
        if kernel_errors:
            print(f"act_quant={act_quant}: bf16 with the kernels (interpret) vs the bf16 reference: max "
                  f"{max(kernel_errors):.2e} over {len(kernel_errors)} prompts")
        other = np.random.default_rng(7).integers(0, 4096, (2, 12)).astype(np.int32)
        lo = b16.prefill(other)[0]
        lf = f32.prefill(np.random.default_rng(100).integers(0, 4096, (2, 12)).astype(np.int32))[0]
        print(f"act_quant={act_quant}: a different prompt's logits: rel {rel(lo, lf):.3f}, "
              f"top tokens agree: {top_tokens_agree(lo, lf)}")


if __name__ == "__main__":
    main()
