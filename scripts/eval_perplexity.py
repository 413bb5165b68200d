"""Held-out perplexity of a checkpoint (and of its float32 master weights), plus sample continuations.

    python scripts/eval_perplexity.py                                    # dsv4_jax/default_model, both dtypes
    python scripts/eval_perplexity.py --npz out/train_tiny/params.npz    # add the unquantized master weights
    python scripts/eval_perplexity.py --samples 64 --json out/eval.json  # + greedy / sampled continuations

Text: `--valid` (default data/corpus/valid.txt), one document (chapter) per blank-line-separated block, each
encoded as BOS + tokens + EOS and concatenated. The stream is cut into non-overlapping windows of `--seq-len` tokens;
each window runs teacher-forced from a fresh state (position 0), so every token except the very first is predicted
exactly once with 0..seq_len-1 tokens of context. Perplexity = exp(mean negative log-likelihood).

Rows (all with the architecture's activation fake quant on, `simulate_quant=True`):
  shipped  bf16 / float32   the checkpoint as stored (FP8-block attention, MXFP4 experts) via `dsv4_jax.load`
  master   bf16 / float32   the float32 master weights of `scripts/train_tiny.py` (`--npz`), unquantized; "bf16"
                            rounds every weight the official format stores as BF16, FP8 or FP4 to bf16 and runs
                            with bf16 activations (the model as a bf16 checkpoint would hold it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax.params import tree_set, weight_specs  # noqa: E402
from train_tiny import eval_windows, token_stream  # noqa: E402  (same data pipeline as training)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_DIR = os.path.join(REPO, "data", "corpus")   # inside the repository; data/ is gitignored
DEFAULT_CKPT = os.path.join(REPO, "dsv4_jax", "default_model")
BOS, EOS = 0, 1

PROMPTS = [
    "Genesis 1\nIn the beginning God created",
    "Psalms 23\nThe LORD is my shepherd;",
    "John 3\nThere was a man of the Pharisees, named Nicodemus,",
    "Matthew 5\nAnd seeing the multitudes, he went up into a mountain:",
    "And the LORD spake unto Moses, saying,",
]


@jax.jit
def _nll(logits, targets, mask):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


def perplexity(model, inputs, targets, mask, batch: int) -> dict:
    total, count = 0.0, 0.0
    t0 = time.time()
    for a in range(0, len(inputs), batch):
        inp, tgt, msk = inputs[a:a + batch], targets[a:a + batch], mask[a:a + batch]
        if len(inp) < batch:                       # one shape, one compilation
            pad = batch - len(inp)
            inp = np.concatenate([inp, np.full((pad, inp.shape[1]), EOS, np.int32)])
            tgt = np.concatenate([tgt, np.full((pad, tgt.shape[1]), EOS, np.int32)])
            msk = np.concatenate([msk, np.zeros((pad, msk.shape[1]), np.float32)])
        s, c = jax.device_get(_nll(model.forward(inp), jnp.asarray(tgt), jnp.asarray(msk)))
        total += float(s)
        count += float(c)
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(count), "seconds": round(time.time() - t0, 1)}


def master_model(npz_path: str, dtype: str, max_seq_len: int):
    """A dsv4_jax.Model over the float32 master weights of scripts/train_tiny.py (dense arrays at every weight)."""
    from dsv4_jax.api import Model
    from dsv4_jax.config import from_hf_config
    with np.load(npz_path) as z:
        cfg = from_hf_config(json.loads(str(z["__config__"])), source=npz_path)
        arrays = {k: z[k] for k in z.files if k != "__config__"}
    tree: dict = {}
    for spec in weight_specs(cfg):
        value = arrays[spec.name]
        if spec.fmt == "i64":
            value = jnp.asarray(value.astype(np.int32))
        elif spec.fmt == "f32" or dtype == "float32":
            value = jnp.asarray(value, jnp.float32)
        else:                                      # BF16 / FP8 / FP4 in the official format -> bf16 here
            value = jnp.asarray(value, jnp.bfloat16)
        tree_set(tree, spec.name, value)
    return Model(cfg, tree, dtype=dtype, simulate_quant=True, max_seq_len=max_seq_len)


def samples(ckpt: str, tokenizer, max_new_tokens: int, prompts: list[str], seed: int) -> list[dict]:
    """Continuations through dsv4_jax.load(ckpt).generate: greedy and temperature 0.8 / top-p 0.95."""
    model = dsv4_jax.load(ckpt)
    out = []
    for prompt in prompts:
        ids = [BOS] + tokenizer.encode(prompt).ids
        row = {"prompt": prompt}
        for mode, kwargs in (("greedy", {"temperature": 0.0}),
                             ("t0.8_p0.95", {"temperature": 0.8, "top_p": 0.95, "seed": seed})):
            res = model.generate([ids], max_new_tokens=max_new_tokens, **kwargs)
            row[mode] = tokenizer.decode(res.tokens[0], skip_special_tokens=True)
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=DEFAULT_CKPT, help="official-format checkpoint directory")
    ap.add_argument("--npz", default=None, help="float32 master weights (params.npz of scripts/train_tiny.py)")
    ap.add_argument("--valid", default=os.path.join(CORPUS_DIR, "valid.txt"))
    ap.add_argument("--tokenizer", default=None, help="default: <ckpt>/tokenizer.json")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--max-windows", type=int, default=0, help="only the first N windows (0: all)")
    ap.add_argument("--no-shipped", action="store_true", help="skip the checkpoint rows (master weights only)")
    ap.add_argument("--samples", type=int, default=0, help="also generate this many tokens per built-in prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(args.tokenizer or os.path.join(args.ckpt, "tokenizer.json"))
    tokenizer.encode_special_tokens = True  # documents and prompts are text: special-token strings in them stay text
    stream = token_stream(tokenizer, args.valid)
    inputs, targets, mask = eval_windows(stream, args.seq_len)
    if args.max_windows:
        inputs, targets, mask = inputs[:args.max_windows], targets[:args.max_windows], mask[:args.max_windows]
    print(f"{args.valid}: {len(stream):,} tokens, {len(inputs)} windows of {args.seq_len}; device {jax.devices()[0]}")

    rows = []
    for dtype in args.dtypes.split(","):
        variants = []
        if args.npz:
            variants.append(("master (unquantized)", lambda: master_model(args.npz, dtype, args.seq_len)))
        if not args.no_shipped:
            variants.append(("shipped (FP8 + MXFP4)", lambda: dsv4_jax.load(args.ckpt, dtype=dtype,
                                                                            max_seq_len=args.seq_len)))
        for weights, make in variants:
            result = perplexity(make(), inputs, targets, mask, args.batch)
            rows.append({"weights": weights, "dtype": dtype, **result})
            print(f"  {weights:24s} {dtype:9s} loss {result['loss']:.4f} ppl {result['ppl']:8.3f} "
                  f"({result['tokens']} tokens, {result['seconds']}s)", flush=True)

    print()
    print("| weights | activations | valid loss (nats/token) | perplexity |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['dtype']} | {r['loss']:.4f} | {r['ppl']:.2f} |")
    report = {"ckpt": args.ckpt, "npz": args.npz, "valid": args.valid, "seq_len": args.seq_len,
              "tokens": int(mask.sum()), "rows": rows}
    if args.samples:
        report["samples"] = samples(args.ckpt, tokenizer, args.samples, PROMPTS, args.seed)
        for s in report["samples"]:
            print(f"\n--- {s['prompt']!r}\n[greedy] {s['greedy']}\n[sampled] {s['t0.8_p0.95']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
