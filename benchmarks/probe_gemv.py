"""Which side limits the FP4 decode GEMV: the diagnostic kernels of benchmarks/probe_gemv.cu (the GEMV skeleton with
only its loads, or only its decode + MMAs) timed next to the real MXFP4 kernel and XLA's bf16 dot, in one process.

    python3 benchmarks/probe_gemv.py --out $OUT/probe_gemv.json [--shapes lm_head,w_18432x7168] [--ms 1,8]

Rows (kernel time from the profiler, wall time per call over weight copies L2 cannot hold, as bench_kernels.py):
  xla_bf16_dot                      the bf16 matrix (4x the FP4 bytes)
  mxfp4 / mxfp4_gemv_layout         ffi.gemv, schedule 811, checked against the reference first
  probe 0 loads only                the MXFP4 kernel's weight + activation loads, folded (no decode, no MMA)
  probe 1 loads + scales            probe 0 plus the E8M0 scale-byte loads: all the bytes the kernel reads
  probe 2 wide loads                the same bytes walked as the FP8 kernel walks its bytes (32 B per row per step)
  probe 3 / 4 decode only           the MXFP4 decode + MMAs without weight loads (checkpoint order / GEMV layout)
Probes 0-2 are also timed under the schedules of --probe-schedules. GB/s counts the MXFP4 bytes (packed + scales)
for every FP4 row, so the columns compare at equal work; the probes' outputs are not products (not checked).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_jax import ffi  # noqa: E402
from dsv4_jax.numerics.formats import Mxfp4Weight, weight_bytes  # noqa: E402
from dsv4_jax.ops.matmul import linear  # noqa: E402
from benchmarks.bench_kernels import (MAX_COPIES, REFERENCE, ROTATE_BYTES, make_weight,  # noqa: E402
                                      profiled_kernel_us, recorder, rel_err, time_calls)

SHAPES = {"lm_head": (129280, 4096), "w_18432x7168": (18432, 7168), "wo_b": (4096, 8192), "wq_b": (32768, 1024)}
PROBES = {0: "loads only", 1: "loads + scales", 2: "wide loads", 3: "decode only", 4: "decode only, GEMV layout"}
TARGET = "dsv4_probe_gemv"
PROBE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_gemv.cu")   # includes ffi/fp4_gemv.cu


def probe_call(x: jax.Array, w: Mxfp4Weight, probe: int, schedule: int) -> jax.Array:
    """One diagnostic launch on x [M, K] (probe 2: x [M, K/2]) and the bytes of w -> folded values [M, N]."""
    n = w.shape[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((1, x.shape[0], n), jnp.float32))
    return call(x[None].astype(jnp.bfloat16), w.packed[None], jax.lax.bitcast_convert_type(w.scale, jnp.uint8)[None],
                jnp.zeros((1,), jnp.int32), schedule=np.int32(schedule), probe=np.int32(probe))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "probe_gemv.json"))
    ap.add_argument("--shapes", default="lm_head,w_18432x7168")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--probe-schedules", default="811,812,814,411")
    args = ap.parse_args()
    ffi.register(PROBE_SOURCE, {TARGET: "DSV4ProbeGemv"})
    key = jax.random.key(1)
    results = []
    emit = recorder(args.out, results)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = {fmt: min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / (n * k * (2 if fmt == "bf16" else 0.53)))))
                  for fmt in ("bf16", "mxfp4")}
        bf16 = [make_weight(jax.random.fold_in(key, i), "bf16", (n, k)) for i in range(copies["bf16"])]
        mx = [make_weight(jax.random.fold_in(key, 100 + i), "mxfp4", (n, k)) for i in range(copies["mxfp4"])]
        laid = [jax.jit(ffi.to_gemv_layout)(w) for w in mx]
        fp4_bytes = weight_bytes(mx[0])
        for m in [int(v) for v in args.ms.split(",")]:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            x_half = x[:, : k // 2]
            reps = max(2, int(2000 / (len(bf16) * max(1, n * k // (1 << 24)))))
            rows = [("xla_bf16_dot", None, lambda x, w: x @ w.T, bf16, x, n * k * 2)]
            ref = jax.jit(lambda x, w: linear(x.astype(jnp.float32), w, jnp.float32, ctx=REFERENCE))(x, mx[0])
            for impl, weights in (("mxfp4", mx), ("mxfp4_gemv_layout", laid)):
                err = rel_err(jax.jit(lambda x, w: ffi.gemv(x, w, jnp.float32))(x, weights[0]), ref)
                if err > 1e-4:
                    raise RuntimeError(f"{name} M={m} {impl}: wrong result, rel. err {err:.3g}")
                rows.append((impl, 811, lambda x, w: ffi.gemv(x, w), weights, x, fp4_bytes))
            for probe in PROBES:
                scheds = [int(s) for s in args.probe_schedules.split(",")] if probe <= 2 else [811]
                for s in scheds:
                    rows.append((f"probe {probe} {PROBES[probe]}", s,
                                 lambda x, w, p=probe, s=s: probe_call(x, w, p, s), mx, x_half if probe == 2 else x,
                                 fp4_bytes))
            base_us = None
            for impl, sched, fn, weights, xin, nbytes in rows:
                try:
                    us = time_calls(fn, weights, xin, reps, repeats=3)[0]
                    kus = profiled_kernel_us(fn, xin, weights)
                except Exception as e:  # noqa: BLE001 - report the case, go on with the others
                    emit(dict(name=name, m=m, impl=impl, schedule=sched, error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                base_us = base_us or kus
                emit(dict(name=name, n=n, k=k, m=m, impl=impl, schedule=sched, us=us, kernel_us=kus,
                          gbps=nbytes / (kus or us) / 1e3, speedup_vs_bf16=base_us / kus if kus and base_us else None))
        del bf16, mx, laid
    print("\n| matrix | M | row | schedule | kernel us | wall us | GB/s (kernel) | vs XLA bf16 dot |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | {r['m']} | {r['impl']} | {r['schedule']} | error: {r['error'][:80]} | | | |")
            continue
        ks = f"{r['kernel_us']:.1f}" if r["kernel_us"] else "-"
        sp = f"{r['speedup_vs_bf16']:.2f}x" if r["speedup_vs_bf16"] else "-"
        print(f"| {r['name']} | {r['m']} | {r['impl']} | {r['schedule'] or ''} | {ks} | {r['us']:.1f} | "
              f"{r['gbps']:.0f} | {sp} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
