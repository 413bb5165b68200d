"""The dense FP8 projections of a wide serving step (129-256 rows), alone, on each path that could run them, at
Flash's shapes:

    python benchmarks/bench_dense_rows.py --rows 128,256 --out dense_rows.json

Paths, bf16 activations (the default numerics) unless said:
    gemv         pallas_kernels/gemv.fp8_matmul at its default tiling: what the model takes at these rows
    gemv[BxWxS]  the same with block_n B, W warps and S pipeline stages (--gemv-tilings)
    xla_dequant  the reference's formula (dequantize, then XLA's dot) as XLA compiles it; `bf16_weight_in_memory`
                 says whether the compiled program writes the dequantized [N, K] weight out (else XLA fused the
                 dequantize into its GEMM's operand: the stored FP8 bytes are what it reads)
    xla_bf16     XLA's dot on a bf16 copy of the weight (twice the bytes): the same GEMM's yardstick
    fp8_act      act_quant="fp8" (the official numerics) as the model takes it: the FP8 quantize kernel and the
                 FP8 tensor-core GEMM (pallas_kernels/prefill.fp8_block_matmul)
Each is timed over enough weight copies that none stays in L2 (bench_kernels.time_calls: one jitted program, the
copies in turn), median of 5 runs; outputs are checked against xla_dequant first (relative error; fp8_act against
the fp8 reference). The table: microseconds per call, the weight's stored bytes per second and TFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROTATE_BYTES = 160 << 20          # weight copies per case: at least this many bytes (an H100's L2 is 50 MB)
SHAPES = ("wq_a", "wkv", "wq_b", "wo_b", "shared_w1", "shared_w2")


def bf16_weight_in_memory(fn, x, w, n: int, k: int) -> bool:
    """Whether the compiled program of fn(x, w) has a top-level instruction writing a bf16 [n, k] array."""
    import jax
    text = jax.jit(fn).lower(x, w).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return re.search(rf"= bf16\[{n},{k}\]", entry) is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gemv-tilings", default="", help="comma-separated block_n x warps x stages of gemv.fp8_matmul "
                                                          "to time beside its default, e.g. 128x8x4,256x8x3")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "dense_rows.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: one small shape, interpret mode")
    args = ap.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp

    import bench_kernels as bk
    from dsv4_jax.numerics import dequantize
    from dsv4_jax.numerics.formats import weight_bytes
    from dsv4_jax.ops.matmul import linear
    from dsv4_jax.pallas_kernels import gemv
    from dsv4_jax.run_context import RunContext

    shapes = {name: (n, k) for name, n, k in bk.DENSE}
    names = args.shapes.split(",")
    unknown = [s for s in names if s not in shapes]
    if unknown:
        ap.error(f"unknown --shapes {unknown}; expected some of {list(shapes)}")
    kernels = "auto"
    fp8_matmul = gemv.fp8_matmul
    if args.smoke:
        shapes, names, kernels = {"tiny": (128, 256)}, ["tiny"], "interpret"
        fp8_matmul = functools.partial(gemv.fp8_matmul, interpret=True)
    reference = RunContext.create(kernels="reference")
    fp8_reference = RunContext.create(act_quant="fp8", kernels="reference")
    fp8_model = RunContext.create(act_quant="fp8", kernels=kernels)
    # name -> (fn(x, w), the reference context its output is checked against, whether it takes the bf16 copies)
    paths = {
        "gemv": (lambda x, w: fp8_matmul(x, w, jnp.float32), reference, False),
        "xla_dequant": (lambda x, w: linear(x, w, jnp.float32, ctx=reference), reference, False),
        "xla_bf16": (lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32), reference, True),
        "fp8_act": (lambda x, w: linear(x, w, jnp.float32, ctx=fp8_model), fp8_reference, False),
    }
    for tiling in filter(None, args.gemv_tilings.split(",")):
        block_n, warps, stages = (int(v) for v in tiling.split("x"))
        paths[f"gemv[{tiling}]"] = (lambda x, w, b=block_n, nw=warps, ns=stages: fp8_matmul(
            x, w, jnp.float32, block_n=b, num_warps=nw, num_stages=ns), reference, False)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv),
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    results = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    key = jax.random.key(0)
    print(f"{'shape':10} {'rows':>4} {'path':>16} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8}  check")
    for name in names:
        n, k = shapes[name]
        w = bk.make_weight(jax.random.fold_in(key, 1), "fp8", (n, k))
        copies = 2 if args.smoke else min(bk.MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / weight_bytes(w))))
        ws = [w] + [bk.make_weight(jax.random.fold_in(key, 2 + i), "fp8", (n, k)) for i in range(copies - 1)]
        wbs = [jax.jit(lambda c: dequantize(c, jnp.bfloat16))(c) for c in ws[:2]]           # bf16 copies
        for rows in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, 100 + rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
            reps = 2 if args.smoke else max(2, int(3e4 / copies / max(1.0, n * k / 2 ** 22)))
            flops = 2 * rows * n * k
            wants = {c: jax.jit(lambda x, w, c=c: linear(x, w, jnp.float32, ctx=c))(x, w)
                     for c in (reference, fp8_reference)}
            for path, (fn, ref_ctx, on_bf16) in paths.items():
                weights = wbs if on_bf16 else ws
                try:
                    got = jax.jit(fn)(x, weights[0])
                except Exception as err:  # noqa: BLE001 - a tiling the kernel refuses: say so, go on
                    print(f"{name:10} {rows:4d} {path:>16} refused: {str(err).splitlines()[0][:120]}", flush=True)
                    continue
                want = wants[ref_ctx]
                check = f"rel err {float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))):.1e}"
                if path == "xla_dequant":
                    in_memory = bf16_weight_in_memory(fn, x, w, n, k)
                    check += ", bf16 weight in memory" if in_memory else ", dequantize fused"
                t = bk.time_calls(fn, weights, x, reps)
                row = dict(shape=name, n=n, k=k, rows=rows, path=path, us=t[0], min_us=t[1], max_us=t[2],
                           weight_bytes=bk.nbytes(weights[0]), check=check, tflops=flops / t[0] / 1e6)
                row["gb_per_s"] = row["weight_bytes"] / t[0] / 1e3
                if path == "xla_dequant":
                    row["bf16_weight_in_memory"] = in_memory
                results.append(row)
                print(f"{name:10} {rows:4d} {path:>16} {t[0]:9.2f} {row['gb_per_s']:7.0f} {row['tflops']:8.1f}  "
                      f"{check}", flush=True)
                with open(args.out, "w") as f:
                    json.dump({**meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
