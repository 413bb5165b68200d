"""What one more layer costs: two `python -m dsv4_jax.bench` results of the same geometry at two depths, and from
their difference the cost per layer of each decode case (batch x context) and each prefill (prompt x chunk), with
the time they project for a deeper model.

    python benchmarks/marginal_cost.py flash4.json flash16.json [--project 43] [--out marginal.json]

Per case: ms at each depth, (deep - shallow) / (layers apart) per layer, the floor's own per-layer bytes as time
(the floor of each file is its bytes at its probe's bandwidth), and the projection shallow + (N - shallow layers)
x per layer. A case must appear in both files; the two runs should be on one machine (the device names are
compared and a difference is printed). Options that change the program (numerics, kernel overrides, scan_layers)
are listed when they differ, since then the difference is not only depth.
"""

from __future__ import annotations

import argparse
import json
import sys

# bench JSON "model" fields that change the program besides the depth
PROGRAM_OPTIONS = ("preset", "dtype", "act_quant", "kernels", "kernel_overrides", "kv_cache_dtype", "devices",
                   "scan_layers", "sampling")


def _load(path: str) -> dict:
    with open(path) as f:
        result = json.load(f)
    if "model" not in result or "layers" not in result["model"]:
        raise SystemExit(f"{path}: not a dsv4_jax.bench result (no model.layers)")
    return result


def _matched(shallow: dict, deep: dict, part: str, key) -> list[tuple[dict, dict]]:
    """(shallow case, deep case) of `part` ("decode" or "prefill") for each case `key` finds in both results."""
    deep_cases = {key(c): c for c in deep.get(part) or []}
    return [(c, deep_cases[key(c)]) for c in shallow.get(part) or [] if key(c) in deep_cases]


def marginal_costs(shallow: dict, deep: dict, project: int | None = None) -> dict:
    """Per-layer cost of each decode and prefill case present in both bench results (shallow has fewer layers)."""
    l0, l1 = shallow["model"]["layers"], deep["model"]["layers"]
    if l1 <= l0:
        raise ValueError(f"the second result must have more layers than the first ({l1} <= {l0})")
    apart = l1 - l0
    rows = {"decode": [], "prefill": []}
    for d, other in _matched(shallow, deep, "decode", lambda c: (c["batch"], c["context"])):
        per_layer = (other["ms_per_step"] - d["ms_per_step"]) / apart
        floor_per_layer = (other["floor_ms"] - d["floor_ms"]) / apart
        row = {"batch": d["batch"], "context": d["context"], "ms": [d["ms_per_step"], other["ms_per_step"]],
               "ms_per_layer": per_layer, "floor_ms_per_layer": floor_per_layer,
               "times_floor": per_layer / floor_per_layer if floor_per_layer > 0 else None}
        if project:
            row["projected_ms"] = d["ms_per_step"] + (project - l0) * per_layer
        rows["decode"].append(row)
    for p, other in _matched(shallow, deep, "prefill", lambda c: (c["prompt_tokens"], c["prefill_chunk"])):
        per_layer = (other["ttft_ms"] - p["ttft_ms"]) / apart
        row = {"prompt_tokens": p["prompt_tokens"], "prefill_chunk": p["prefill_chunk"],
               "ttft_ms": [p["ttft_ms"], other["ttft_ms"]], "ms_per_layer": per_layer}
        if project:
            row["projected_ttft_ms"] = p["ttft_ms"] + (project - l0) * per_layer
            row["projected_tokens_per_s"] = p["prompt_tokens"] / row["projected_ttft_ms"] * 1e3
        rows["prefill"].append(row)
    differ = {k: (shallow["model"].get(k), deep["model"].get(k)) for k in PROGRAM_OPTIONS
              if shallow["model"].get(k) != deep["model"].get(k)}
    devices = [r.get("machine", {}).get("device_kind") for r in (shallow, deep)]
    return {"layers": [l0, l1], "project_layers": project, "devices": devices, "program_options_differ": differ,
            **rows}


def table(result: dict) -> str:
    l0, l1 = result["layers"]
    lines = [f"from {l0} to {l1} layers" + (f", projected to {result['project_layers']}"
                                             if result["project_layers"] else "")]
    if result["decode"]:
        lines += ["| batch | context | ms at %d | ms at %d | ms per layer | floor per layer | x floor |%s" % (
            l0, l1, " projected ms |" if result["project_layers"] else ""),
            "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if result["project_layers"] else "")]
        for r in result["decode"]:
            x = f"{r['times_floor']:.1f}" if r["times_floor"] else "-"
            lines.append(f"| {r['batch']} | {r['context']} | {r['ms'][0]:.3f} | {r['ms'][1]:.3f} | "
                         f"{r['ms_per_layer']:.3f} | {r['floor_ms_per_layer']:.3f} | {x} |"
                         + (f" {r['projected_ms']:.2f} |" if result["project_layers"] else ""))
    if result["prefill"]:
        lines += ["| prompt | chunk | TTFT ms at %d | at %d | ms per layer |%s" % (
            l0, l1, " projected TTFT ms | projected tok/s |" if result["project_layers"] else ""),
            "|---:|---:|---:|---:|---:|" + ("---:|---:|" if result["project_layers"] else "")]
        for r in result["prefill"]:
            lines.append(f"| {r['prompt_tokens']} | {r['prefill_chunk']} | {r['ttft_ms'][0]:.1f} | "
                         f"{r['ttft_ms'][1]:.1f} | {r['ms_per_layer']:.2f} |"
                         + (f" {r['projected_ttft_ms']:.1f} | {r['projected_tokens_per_s']:,.0f} |"
                            if result["project_layers"] else ""))
    if not result["decode"] and not result["prefill"]:
        lines.append("no case appears in both results")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shallow", help="bench JSON of the shallower model")
    p.add_argument("deep", help="bench JSON of the deeper model")
    p.add_argument("--project", type=int, default=None, help="project each case to this many layers (e.g. 43)")
    p.add_argument("--out", help="write the result as JSON")
    args = p.parse_args(argv)
    result = marginal_costs(_load(args.shallow), _load(args.deep), args.project)
    if result["devices"][0] != result["devices"][1]:
        print(f"note: different devices {result['devices']}", file=sys.stderr)
    if result["program_options_differ"]:
        print(f"note: the programs differ in more than depth: {result['program_options_differ']}", file=sys.stderr)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
