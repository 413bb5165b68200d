"""Bytes a batch-1 decode step reads per device, and the collectives it needs, for a partitioning of DeepSeek-V4
over n devices: the arithmetic behind sharding.rules (docs/sharding.md).

    python benchmarks/sharding_arithmetic.py --preset flash --devices 1 2 8 --json out.json

Layouts compared (the routed experts are split over the devices in all):
    ep      attention, shared expert, embedding and head replicated; one all-reduce per MoE layer (the routed
            experts' partial sums). What dsv4_jax does below 4 devices.
    ep+tp   additionally attention heads (wq_b rows, wo_a groups, wo_b inputs), the indexer heads and the shared
            expert split over the same devices, vLLM-style: an all-reduce after attention and one after the MoE.
    rules   what sharding.rules(cfg, n) splits, read off the weight description: from 4 devices the attention
            heads and output groups and the shared expert (its partial sums join the MoE all-reduce), with the
            indexer, compressors, wq_a / wkv and the head replicated. What dsv4_jax does.

Bytes come from the weight description (params.weight_specs, in the stored formats) with jax.eval_shape, nothing
allocated. Routed experts read at batch 1: top-k experts per layer, spread over the devices; the slowest device
is what a step waits for, taken here as ceil(top_k / n) experts (even spread; a device that got more waits
longer). The step's time is estimated as bytes / HBM bandwidth + collectives x latency, with two assumptions,
both flags: 4.0 TB/s read per H200 (its HBM3e is rated 4.8 TB/s) and 20 us per small all-reduce (published NCCL
figures on H100: 10-25 us in sglang PR #2904, vllm PR #24532 and marin issue #6736; none for 2xH200).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_jax import presets  # noqa: E402
from dsv4_jax.memory_plan import weight_bytes_per_device  # noqa: E402
from dsv4_jax.sharding import splits_heads  # noqa: E402


def weight_groups(cfg, n_split: int | None = None) -> dict[str, float]:
    """Bytes per kind of weight for the whole model: 'attention' (all of attn.*), 'shared', 'routed' (all
    experts), 'embed', 'head', 'other' (norms, mHC, router). With `n_split`: the bytes one of n_split devices holds
    under sharding.rules."""
    groups = dict.fromkeys(("attention", "shared", "routed", "embed", "head", "other"), 0)
    for name, size in weight_bytes_per_device(cfg, n_split or 1).items():
        if ".experts." in name:
            groups["routed"] += size
        elif ".shared_experts." in name:
            groups["shared"] += size
        elif ".attn." in name:
            groups["attention"] += size
        elif name.startswith(("embed", "head")):
            groups[name.split(".")[0]] += size
        else:
            groups["other"] += size
    return groups


def decode_step(cfg, groups: dict, n: int, layout: str, bandwidth: float, latency: float) -> dict:
    layers = cfg.n_layers                                   # the MTP block is not run by a plain decode step
    expert = groups["routed"] / ((layers + cfg.n_mtp_layers) * cfg.n_routed_experts)   # one expert, one layer
    if layout == "rules":
        groups = {**weight_groups(cfg, n), "routed": groups["routed"]}   # what one device holds of the rest
    per_layer = lambda kind: groups[kind] * layers / (layers + cfg.n_mtp_layers)  # noqa: E731  backbone share
    split = n if layout == "ep+tp" else 1
    read = {
        "attention": per_layer("attention") / split,
        "shared": per_layer("shared") / split,
        "routed": layers * math.ceil(cfg.n_activated_experts / n) * expert,
        "head": groups["head"] / split,                      # vocab-parallel head in ep+tp
        "embed_row": cfg.dim * 2,
    }
    two = layout == "ep+tp" or (layout == "rules" and splits_heads(cfg, n))
    collectives = layers * (2 if two and n > 1 else 1 if n > 1 else 0)
    if layout == "ep+tp" and n > 1:
        collectives += 1                                     # the head's logits gathered once
    total = sum(read.values())
    stored = groups["routed"] / n + sum(v for k, v in groups.items() if k != "routed") / split   # rules: split=1
    return {"devices": n, "layout": layout, "read_bytes": total, "read": read, "collectives": collectives,
            "weights_per_device": stored, "read_ms": total / bandwidth * 1e3,
            "collective_ms": collectives * latency * 1e3,
            "estimate_ms": total / bandwidth * 1e3 + collectives * latency * 1e3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("flash", "pro"), default="flash")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="HBM read rate, bytes/s (default: 4.0e12)")
    ap.add_argument("--latency", type=float, default=20e-6, help="seconds per small all-reduce (default: 20e-6)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    cfg = getattr(presets, args.preset)()
    groups = weight_groups(cfg)
    print(f"{args.preset}: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in groups.items()))
    rows = []
    print(f"{'devices':>7} {'layout':>6} {'GB/device':>9} {'read GB':>8} {'attn':>6} {'shared':>6} {'routed':>6} "
          f"{'head':>5} {'colls':>5} {'read ms':>7} {'coll ms':>7} {'est ms':>6}")
    for n in args.devices:
        for layout in ("ep", "ep+tp", "rules") if n > 1 else ("ep",):
            r = decode_step(cfg, groups, n, layout, args.bandwidth, args.latency)
            rows.append(r)
            g = {k: v / 1e9 for k, v in r["read"].items()}
            print(f"{n:>7} {layout:>6} {r['weights_per_device'] / 1e9:>9.1f} {r['read_bytes'] / 1e9:>8.2f} "
                  f"{g['attention']:>6.2f} {g['shared']:>6.2f} {g['routed']:>6.2f} {g['head']:>5.2f} "
                  f"{r['collectives']:>5} {r['read_ms']:>7.2f} {r['collective_ms']:>7.2f} {r['estimate_ms']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "groups": groups, "bandwidth": args.bandwidth,
                       "latency": args.latency, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
