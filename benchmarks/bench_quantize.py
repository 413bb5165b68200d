"""Benchmark the Pallas activation-quantization kernels (dsv4_jax/pallas_kernels/quantize.py) on a GPU.

For NVFP4 (amax -> per-row global scale -> e4m3 per-16 scales + packed e2m1) and FP8 (per-128 e4m3 + power-of-two
scales), at decode sizes ([1..16, 4096 / 7168]) and large sizes (>= 64 MiB of bf16 input):
  * bit-exact check against the pure-jnp reference run by XLA on the CPU (the definition) on the same fresh random
    input, before any timing (and, for information, the count of differences from the reference run by XLA:GPU);
  * kernel time: CUPTI (jax.experimental.mosaic.gpu.profiler.measure) = the sum of the GPU kernels of one call
    (both launches for the two-launch NVFP4 path; launch gaps excluded), median / min / max over many calls,
    inputs ready on the device, no host dispatch in the number;
  * the pure-jnp reference path (XLA:GPU fusions) timed the same way, side by side;
  * GB/s over the fewest bytes a call must move (input read once, outputs written once) and the percentage of the
    best of three plain XLA kernels measured in the same run on a large bf16 input: an elementwise x*2 (read +
    write), an elementwise bf16 -> e4m3 convert (read + write), and a row amax reduction (read).
Prints a table (last lines) and writes JSON to --out.

    PYTHONPATH=. python3 benchmarks/bench_quantize.py --out out/bench_quantize.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.pallas_kernels.quantize import (quantize_fp8_kernel, quantize_fp8_reference, quantize_nvfp4_kernel,
                                     quantize_nvfp4_reference)

DECODE = [(1, 4096), (1, 7168), (16, 4096), (16, 7168)]
LARGE = [(8192, 4096), (8192, 7168)]          # 64 MiB and 112 MiB of bf16


def _cupti_us(fn, args, iters):
    """(median, min, max) us of GPU kernel time per call, or None when CUPTI is unavailable."""
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, t = profiler.measure(fn, iterations=iters)(*args)
        t = [1e3 * v for v in t]
        return statistics.median(t), min(t), max(t)
    except Exception as e:   # noqa: BLE001
        print(f"  CUPTI failed ({type(e).__name__}: {str(e)[:200]}); wall-clock only", file=sys.stderr)
        return None


def _wall_us(fn, args, iters):
    """Median wall time of one call (synchronized each time): dispatch included."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _mismatches(out, ref):
    return int(sum(np.count_nonzero(_bits(o) != _bits(r)) for o, r in zip(out, ref)))


def _input(rng, m, k):
    x = rng.standard_normal((m, k), np.float32) * (10.0 ** rng.uniform(-3, 3, (m, 1))).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16)


def _bytes(kind, m, k):
    if kind == "nvfp4":
        return m * k * 2 + m * k // 2 + m * k // 16 + 4 * m
    return m * k * 2 + m * k + 4 * m * k // 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_quantize.json")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script: tiny shapes, interpret")
    args = ap.parse_args()
    global DECODE, LARGE
    big = (8192, 7168)
    if args.interpret:
        DECODE, LARGE, big, args.iters = [(2, 512)], [(64, 1024)], (64, 1024), 2
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform})", flush=True)
    rng = np.random.default_rng(int(time.time()))
    results = {"jax": jax.__version__, "device": dev.device_kind,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "baselines": [], "cases": []}

    # --- plain XLA ceilings, same run -------------------------------------------------------------------------
    xb = _input(rng, *big)
    n = xb.size
    base = [("xla x*2 bf16 (r+w)", jax.jit(lambda x: x * 2), 4 * n),
            ("xla bf16->e4m3 (r+w)", jax.jit(lambda x: x.astype(jnp.float8_e4m3fn)), 3 * n),
            ("xla row amax (r)", jax.jit(lambda x: jnp.max(jnp.abs(x), axis=-1)), 2 * n + 2 * big[0])]
    ceiling = 0.0
    for name, f, nbytes in base:
        t = _cupti_us(f, (xb,), args.iters)
        us = t[0] if t else _wall_us(f, (xb,), args.iters)
        gbs = nbytes / us / 1e3
        ceiling = max(ceiling, gbs)
        results["baselines"].append({"name": name, "shape": list(big), "time_us": us, "bytes": nbytes,
                                     "GB/s": gbs})
        print(f"baseline {name}: {us:.1f} us, {gbs:.0f} GB/s", flush=True)
    results["ceiling_GBs"] = ceiling
    del xb

    nv_variants = {"decode": [("split fast", dict(split=True)), ("fused fast", dict(split=False)),
                              ("fused rn", dict(split=False, division="rn"))],
                   "large": [("fused r1 w8 fast", dict(split=False, block_rows=1, num_warps=8)),
                             ("fused r1 w4 fast", dict(split=False, block_rows=1, num_warps=4)),
                             ("fused r2 w8 fast", dict(split=False, block_rows=2, num_warps=8)),
                             ("fused r1 w8 rn", dict(split=False, block_rows=1, num_warps=8, division="rn")),
                             ("split fast", dict(split=True))]}
    f8_variants = {"decode": [("cb8 w4", dict())],
                   "large": [("cb16 r4 w8", dict(chunk_blocks=16, block_rows=4, num_warps=8)),
                             ("cb8 r8 w4", dict(chunk_blocks=8, block_rows=8, num_warps=4))]}
    if args.quick:
        nv_variants["large"] = nv_variants["large"][:1]
        f8_variants["large"] = f8_variants["large"][:1]

    cpu = jax.devices("cpu")[0]
    for regime, shapes in (("decode", DECODE), ("large", LARGE)):
        for m, k in shapes:
            x = _input(rng, m, k)
            iters = args.iters if regime == "large" else 3 * args.iters
            for kind, ref_fn, kern, variants in (
                    ("nvfp4", quantize_nvfp4_reference, quantize_nvfp4_kernel, nv_variants[regime]),
                    ("fp8", quantize_fp8_reference, quantize_fp8_kernel, f8_variants[regime])):
                nbytes = _bytes(kind, m, k)
                rj = jax.jit(ref_fn)
                ref = jax.block_until_ready(rj(jax.device_put(x, cpu)))          # the definition
                ref_gpu_bad = _mismatches(jax.block_until_ready(rj(x)), ref)
                rt = _cupti_us(rj, (x,), iters)
                ref_us = rt[0] if rt else _wall_us(rj, (x,), iters)
                for vname, opts in variants:
                    if args.interpret:
                        opts = dict(opts, interpret=True)
                    f = jax.jit(functools.partial(kern, **opts))
                    try:
                        bad = _mismatches(jax.block_until_ready(f(x)), ref)
                    except Exception as e:   # noqa: BLE001
                        print(f"{kind} {m}x{k} {vname}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
                        results["cases"].append({"kind": kind, "shape": [m, k], "variant": vname,
                                                 "error": f"{type(e).__name__}: {str(e)[:3000]}"})
                        continue
                    t = _cupti_us(f, (x,), iters)
                    us = t[0] if t else _wall_us(f, (x,), iters)
                    row = {"kind": kind, "regime": regime, "shape": [m, k], "dtype": "bfloat16", "variant": vname,
                           "mismatches_vs_cpu_ref": bad, "xla_gpu_ref_mismatches_vs_cpu_ref": ref_gpu_bad,
                           "time_us": us, "time_us_min": t[1] if t else None, "time_us_max": t[2] if t else None,
                           "timing": "cupti" if t else "wall", "bytes": nbytes, "GB/s": nbytes / us / 1e3,
                           "pct_ceiling": 100 * nbytes / us / 1e3 / ceiling, "ref_us": ref_us,
                           "ref_GB/s": nbytes / ref_us / 1e3, "speedup_vs_ref": ref_us / us}
                    results["cases"].append(row)
                    print(f"{kind:5s} {m:5d}x{k:<5d} {vname:18s} bad={bad} {us:8.2f} us "
                          f"[{row['time_us_min'] or 0:.2f}-{row['time_us_max'] or 0:.2f}] {row['GB/s']:7.0f} GB/s "
                          f"{row['pct_ceiling']:5.1f}%  ref {ref_us:8.2f} us (xla:gpu ref bad={ref_gpu_bad})",
                          flush=True)
            del x

    # where XLA:GPU's run of the NVFP4 reference departs from XLA:CPU's: compare its stages
    from dsv4_jax.numerics import activations as act, nvfp4
    x = _input(rng, 64, 7168)
    stages = {"gsa": lambda x: act.nvfp4_global_scale(x),
              "scale,y": lambda x: nvfp4.scale_blocks(x, act.nvfp4_global_scale(x))}
    diag = {}
    for name, fn in stages.items():
        g, c = jax.jit(fn)(x), jax.jit(fn)(jax.device_put(x, cpu))
        diag[name] = _mismatches(jax.tree.leaves(g), jax.tree.leaves(c))
    sc, y = jax.jit(stages["scale,y"])(jax.device_put(x, cpu))
    diag["e2m1_codes(same y)"] = _mismatches([jax.jit(nvfp4.e2m1_codes)(jax.device_put(y, dev))],
                                             [jax.jit(nvfp4.e2m1_codes)(y)])
    yn = np.asarray(jax.device_put(x, cpu)).astype(np.float32).reshape(64, -1, 16) / (
        np.asarray(sc).astype(np.float32) * np.asarray(act.nvfp4_global_scale(jax.device_put(x, cpu))))[..., None]
    yg = np.asarray(jax.jit(stages["scale,y"])(x)[1])
    diag["y xla:gpu vs numpy"] = int(np.count_nonzero(yg.view(np.uint32) != yn.astype(np.float32).view(np.uint32)))
    diag["y xla:cpu vs numpy"] = int(np.count_nonzero(np.asarray(y).view(np.uint32) != yn.view(np.uint32)))
    results["xla_gpu_reference_diagnosis"] = diag
    print("XLA:GPU vs XLA:CPU reference stages (differing elements):", diag, flush=True)

    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)

    print(f"\nceiling (best plain XLA kernel, same run): {ceiling:.0f} GB/s   ({results['date']}, {dev.device_kind})")
    print(f"{'kind':5s} {'shape':>11s} {'variant':18s} {'exact':5s} {'kernel us':>9s} {'GB/s':>6s} {'%ceil':>6s} "
          f"{'ref us':>8s} {'x ref':>6s}")
    for r in results["cases"]:
        if "error" in r:
            print(f"{r['kind']:5s} {r['shape'][0]:5d}x{r['shape'][1]:<5d} {r['variant']:18s} ERROR")
            continue
        print(f"{r['kind']:5s} {r['shape'][0]:5d}x{r['shape'][1]:<5d} {r['variant']:18s} "
              f"{'yes' if r['mismatches_vs_cpu_ref'] == 0 else 'NO':5s} {r['time_us']:9.2f} {r['GB/s']:6.0f} "
              f"{r['pct_ceiling']:6.1f} {r['ref_us']:8.2f} {r['speedup_vs_ref']:6.2f}")


if __name__ == "__main__":
    main()
