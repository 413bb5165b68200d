"""The launches and operand bytes of one top-k over [rows, entries] float32, compiled for a compile-only H200 (no GPU):
XLA's lax.top_k beside ops/threshold_top_k at each number of bits its passes settle.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/count_top_k.py --rows 8192 --entries 2048 --k 512

Needs jax's CUDA build (as benchmarks/count_kernels.py). Without a GPU, XLA's top-k compiles to its fallback sort,
not the CUB sort a GPU gets: its row is not what a GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--entries", type=int, default=2048)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--bits", default="1,2,4,8", help="bits per pass of the threshold select, comma-separated")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from count_kernels import h200_device
    from dsv4_jax import hlo_census
    from dsv4_jax.ops.threshold_top_k import threshold_top_k

    device = h200_device()
    scores = jax.ShapeDtypeStruct((args.rows, args.entries), jnp.float32,
                                  sharding=jax.sharding.SingleDeviceSharding(device))
    cases = [("lax.top_k", lambda v: jax.lax.top_k(v, args.k))]
    cases += [(f"threshold, {b} bits a pass", lambda v, b=int(b): threshold_top_k(v, args.k, b))
              for b in args.bits.split(",")]
    rows = []
    print(f"top-k of {args.k} over [{args.rows}, {args.entries}] float32, compiled for {device.device_kind}")
    for name, fn in cases:
        text = jax.jit(fn).lower(scores).compile().as_text()
        counts = hlo_census.census(text)
        row = {"case": name, "launches": counts.launches_per_call, "while_loops": counts.while_loops,
               "operand_bytes": hlo_census.kernel_bytes(text)["total"]}
        rows.append(row)
        print(f"{name:<28} {row['launches']:>6} launches {row['while_loops']:>2} while loops "
              f"{row['operand_bytes'] / 1e9:>7.2f} GB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "entries": args.entries, "k": args.k, "device": device.device_kind,
                       "cases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
