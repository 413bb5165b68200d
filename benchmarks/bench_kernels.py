"""Matmul benchmark on the GPU: our Pallas kernels vs XLA's bf16 dot, XLA's FP8 dot, XLA's naive
dequantize+dot and jax.lax.ragged_dot, on DeepSeek-V4-Flash decode (M = 1..64) and prefill (M = 4096) shapes.

    python3 benchmarks/bench_kernels.py --out $OUT/bench_kernels.json [--quick] [--budget-s 300] [--prefill-only]

Method: every case is checked against dsv4_jax.numerics's reference on fresh random inputs
before it is timed; time = one jitted program that calls the op on C different weight copies (C * bytes >= 256 MB,
at most 48 copies; the 50 MB L2 cannot hold them) R times in a fori_loop, divided by C * R: in-program time per call, host
dispatch excluded, launch gaps and the small epilogue fusion included. Median / min / max over 5 such programs.
GB/s counts the bytes the call must read (stored weight bytes + activations); "% bf16 BW" compares with the
XLA bf16 dot of the same logical matrix in the same run. Results stream to the JSON as they come.
kernel_us (where present) is the profiler's view: the median over calls of the summed GPU kernel durations of
one jitted call (jax.profiler trace, weights rotated), i.e. without launch gaps.

Prefill (M = 4096, and M = 64 where decode kernels stop): XLA bf16 dot, XLA's own FP8 dot (e4m3 x e4m3 ->
float32, per-tensor: the FP8 tensor-core rate XLA reaches on this machine, the yardstick), the naive
dequantize + bf16 dot our reference takes for bf16 activations, our block-scaled FP8 kernel alone
(pallas_prefill_fp8) and end to end as the model calls it (linear with act_quant="fp8": activation quantize +
weight operand + kernel).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_jax.numerics.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, weight_bytes  # noqa: E402
from dsv4_jax.ops.matmul import grouped_linear, linear  # noqa: E402
from dsv4_jax.numerics.activations import quantize_fp8  # noqa: E402
from dsv4_jax.ops import act_quantize  # noqa: E402
from dsv4_jax.run_context import RunContext  # noqa: E402
from dsv4_jax.source_digest import source_digest  # noqa: E402
from dsv4_jax.pallas_kernels import gemv, moe, moe_fp8, prefill  # noqa: E402

REFERENCE = RunContext.create(kernels="reference")            # the pure-jnp baselines
REFERENCE_FP8 = RunContext.create(act_quant="fp8", kernels="reference")
AUTO = RunContext.create()                                    # what the model takes on this machine

DENSE = [("wq_a", 1024, 4096), ("wo_b", 4096, 8192), ("lm_head", 129280, 4096), ("wkv", 512, 4096),
         ("wq_b", 32768, 1024), ("wo_a", 8192, 4096), ("shared_w1", 2048, 4096), ("shared_w2", 4096, 2048)]
EXPERTS = [("experts_w1", 2048, 4096), ("experts_w2", 4096, 2048)]
N_EXPERTS, TOP_K = 256, 6
ROTATE_BYTES = 160 << 20
MAX_CHECKED_MOE_ROWS = 24576     # routed rows up to which the MoE cases are checked against the reference
MAX_COPIES = 48


def routed_expert_ids(seed: int, tokens: int, n_experts: int, top_k: int = TOP_K) -> np.ndarray:
    """Expert ids [tokens * top_k] of a routed batch: each token's top_k distinct experts, drawn uniformly (seeded)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)


def make_weight(key, fmt, shape):
    k1, k2, k3 = jax.random.split(key, 3)
    *lead, n, k = shape
    if fmt == "bf16":
        return (jax.random.normal(k1, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    if fmt == "fp8":
        w = jnp.clip(jax.random.normal(k1, shape, jnp.float32) * 64, -448, 448).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(k2, (*lead, math.ceil(n / 128), k // 128), 112, 122).astype(jnp.uint8)
        return Fp8BlockWeight(w, s)
    packed = jax.random.bits(k1, (*lead, n, k // 2), jnp.uint8)
    if fmt == "mxfp4":
        return Mxfp4Weight(packed, jax.random.randint(k2, (*lead, n, k // 32), 115, 125).astype(jnp.uint8))
    scale = jax.random.uniform(k2, (*lead, n, k // 16), jnp.float32, 0.02, 400).astype(jnp.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, jax.random.uniform(k3, tuple(lead), jnp.float32, 1e-4, 1e-3))


def nbytes(tree):
    return weight_bytes(tree) if not isinstance(tree, jax.Array) else tree.size * tree.dtype.itemsize


def time_calls(fn, weights, x, reps, repeats=5):
    """Median/min/max microseconds per call of fn(x, w) over the weight copies, in one jitted program."""
    jfn = jax.jit(fn)                                             # traced once, called per copy

    def program(x, *ws):
        def body(_, acc):
            for w in ws:
                acc = acc + jfn(x + acc.astype(x.dtype) * 0, w)[..., :1].astype(jnp.float32).sum()
            return acc
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    run = jax.jit(program)
    jax.block_until_ready(run(x, *weights))                      # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(x, *weights))
        times.append((time.perf_counter() - t) * 1e6 / (reps * len(weights)))
    return statistics.median(times), min(times), max(times)


_PROFILE_THREADS_SHOWN: list = []


def profiled_kernel_us(fn, x, weights, calls=12):
    """Median over calls of the summed GPU kernel time of jitted fn(x, w) (w rotating over `weights`), from a
    jax.profiler perfetto trace; None if the trace has no GPU kernel events."""
    import glob
    import gzip
    import tempfile
    jfn = jax.jit(fn)
    for w in weights[:2]:
        jax.block_until_ready(jfn(x, w))
    log_dir = tempfile.mkdtemp(prefix="bench_prof_")
    try:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for i in range(calls):
                jax.block_until_ready(jfn(x, weights[i % len(weights)]))
        files = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True))   # xprof's view
        with gzip.open(files[-1]) as f:
            trace = json.load(f)
    except Exception as err:  # noqa: BLE001 - the profiler is optional; the wall-clock numbers stand alone
        print(f"profiler unavailable: {type(err).__name__}: {err}", flush=True)
        return None
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name" and "gpu" in str(e["args"].get("name")).lower()}
    threads = {(e["pid"], e["tid"]): str(e["args"].get("name")) for e in meta if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    kernels = [e for e in spans if "stream" in threads.get((e["pid"], e["tid"]), "").lower()]
    modules = sorted((e for e in spans if "module" in threads.get((e["pid"], e["tid"]), "").lower()),
                     key=lambda e: e["ts"])
    if not _PROFILE_THREADS_SHOWN:                 # once: which GPU lines the trace has (for whoever reads the log)
        _PROFILE_THREADS_SHOWN.append(True)
        print("profiler GPU lines:", sorted({threads.get((e["pid"], e["tid"]), "?") for e in spans}), flush=True)
    if not kernels:
        return None
    if len(modules) >= calls:                    # per-call sums: kernels inside each module execution
        per_call = [sum(k["dur"] for k in kernels if m["ts"] <= k["ts"] <= m["ts"] + m["dur"]) for m in modules]
        per_call = [t for t in per_call if t > 0]
        if per_call:
            return statistics.median(per_call)
    return sum(k["dur"] for k in kernels) / calls


def recorder(path: str, results: list, meta: dict | None = None):
    """emit(rec): rec (with the run's meta fields added) appended to results and the whole list rewritten to the JSON
    file at path, so a run stopped by its time limit keeps every case it finished; rec printed as one JSON line.
    Every record names the code that ran (source_sha256: dsv4_jax.source_digest)."""
    meta = dict(meta or {}, source_sha256=source_digest()["sha256"])

    def emit(rec):
        rec.update(meta)
        results.append(rec)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps({k: v for k, v in rec.items() if k not in meta}), flush=True)

    return emit


def rel_err(y, ref):
    y, ref = jnp.asarray(y, jnp.float32), jnp.asarray(ref, jnp.float32)
    e = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    return e if math.isfinite(e) else float("inf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "bench_kernels.json"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and M values")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this")
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--skip-experts", action="store_true", help="dense decode shapes only (no routed experts)")
    ap.add_argument("--shapes", default="", help="dense decode shapes, comma-separated, in the order to run them "
                    "(the budget may stop before the last); default: all (--quick: its own three, --smoke: 'tiny')")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: tiny shapes, interpret mode")
    ap.add_argument("--prefill-ms", default="64,4096", help="rows for the prefill section ('' to skip)")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--moe-prefill-rows", default="3072,24576",
                    help="routed rows (tokens x 6) for the MoE prefill section ('' to skip)")
    ap.add_argument("--moe-fp8-tiles", default="64x64x4a,128x64x4a,128x128x8a,64x128x4b,128x128x8b",
                    help="W4A8 routed-expert kernel tiles to time: rows per slot x weight rows x warps, then the "
                         "wgmma operand the weight is (a or b)")
    ap.add_argument("--prefill-shapes", default=",".join(PREFILL), help="matrices of the prefill section")
    ap.add_argument("--sweep", action="store_true",
                    help="also time tile configurations: the prefill kernel on " + ", ".join(SWEEP) + " at 4096 rows "
                    "and the MoE kernel at every --moe-prefill-rows count")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler's kernel times")
    ap.add_argument("--moe-ffn-rows", default="",
                    help="routed rows (tokens x 6) of a prefill chunk whose whole routed FFN is timed as the model "
                         "runs it, on the default path and on moe_ffn at each --moe-ffn-tiles (e.g. 49152: 8K tokens)")
    ap.add_argument("--moe-ffn-tiles", default="64x8,64x4,32x4,128x8",
                    help="moe_ffn's gate / up kernel tilings, weight rows x warps (the default: 64x8)")
    args = ap.parse_args()
    global DENSE, EXPERTS, N_EXPERTS, ROTATE_BYTES
    if args.smoke:
        import functools
        DENSE, EXPERTS, N_EXPERTS, ROTATE_BYTES, args.ms = [("tiny", 128, 512)], [("tiny_e", 64, 256)], 8, 1, "1,4"
        args.prefill_ms, args.no_profile = "32", True
        global KERNELS
        KERNELS = "interpret"
        for mod, name in ((gemv, "fp8_matmul"), (gemv, "mxfp4_matmul"), (gemv, "nvfp4_matmul"), (moe, "moe_matmul"),
                          (prefill, "fp8_block_matmul")):
            setattr(mod, name, functools.partial(getattr(mod, name), interpret=True))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=" ".join(sys.argv))
    results = []
    emit = recorder(args.out, results, meta)

    ms = [int(m) for m in args.ms.split(",")]
    by_name = {d[0]: d for d in DENSE}
    names = args.shapes.split(",") if args.shapes else list(by_name)
    unknown = [s for s in names if s not in by_name]
    if unknown:
        ap.error(f"unknown --shapes {unknown}; expected some of {list(by_name)}")
    dense = [by_name[s] for s in names] if not args.quick else [DENSE[0], DENSE[3], DENSE[7]]
    key = jax.random.key(0)
    kernels = {"fp8": gemv.fp8_matmul, "mxfp4": gemv.mxfp4_matmul, "nvfp4": gemv.nvfp4_matmul}

    global PROFILE
    PROFILE = not args.no_profile
    if args.moe_ffn_rows:
        run_moe_ffn(args, key, [int(r) for r in args.moe_ffn_rows.split(",")], emit)
    if args.moe_prefill_rows:
        run_moe_prefill(args, key, [int(r) for r in args.moe_prefill_rows.split(",")], emit)
    if args.prefill_ms:
        run_prefill(args, key, [int(m) for m in args.prefill_ms.split(",")], t_start, emit)
    if args.prefill_only:
        return finish(results)
    if not args.skip_experts:
        run_experts(args, key, ms, t_start, emit)
    for name, n, k in dense:
        bf16_bytes = n * k * 2
        copies = {fmt: min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / nbytes(jax.eval_shape(lambda: make_weight(key, fmt, (n, k)))))))
                  for fmt in ("bf16", "fp8", "mxfp4", "nvfp4")}
        ws = {fmt: [make_weight(jax.random.fold_in(key, i), fmt, (n, k)) for i in range(c)] for fmt, c in copies.items()}
        for m in ms:
            if time.time() - t_start > args.budget_s:
                print("budget reached; stopping", flush=True)
                return finish(results)
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.float32).astype(jnp.bfloat16)
            reps = max(2, int(2000 / (len(ws["bf16"]) * max(1, n * k // (1 << 24)))))
            base = time_calls(lambda x, w: x @ w.T, ws["bf16"], x, reps)
            base_k = profiled_kernel_us(lambda x, w: x @ w.T, x, ws["bf16"]) if PROFILE else None
            flops = 2 * m * n * k
            emit(dict(name=name, shape=[m, n, k], fmt="bf16", impl="xla_dot", time_us=base[0], min_us=base[1],
                      max_us=base[2], kernel_us=base_k, bytes=bf16_bytes, gbps=bf16_bytes / base[0] / 1e3,
                      tflops=flops / base[0] / 1e6))
            for fmt, fn in kernels.items():
                w0 = ws[fmt][0]
                wb = weight_bytes(w0) + m * k * 2
                if m <= gemv.MP:
                    err = rel_err(jax.jit(lambda x, w: fn(x, w, jnp.float32))(x, w0),
                                  jax.jit(lambda x, w: linear(x.astype(jnp.float32), w, jnp.float32, ctx=AUTO))(x, w0))
                    t = time_calls(fn, ws[fmt], x, reps) if err < 1e-3 else (float("nan"),) * 3
                    kt = profiled_kernel_us(fn, x, ws[fmt]) if PROFILE and err < 1e-3 else None
                    emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl="pallas", time_us=t[0], min_us=t[1],
                              max_us=t[2], kernel_us=kt, bytes=wb, gbps=wb / t[0] / 1e3, rel_err=err,
                              kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None,
                              pct_bf16_bw=100 * (wb / t[0]) / (bf16_bytes / base[0]), speedup_vs_bf16=base[0] / t[0],
                              tflops=flops / t[0] / 1e6, floor_us=wb / (bf16_bytes / base[0])))
                if m <= 8 and not args.smoke:
                    run_ffi_gemv(name, n, k, m, x, ws[fmt], base, base_k, bf16_bytes, emit)
                if m in (4, 64) or (m == ms[0] and fmt == "mxfp4"):
                    t = time_calls(lambda x, w: linear(x, w, ctx=AUTO), ws[fmt][:2], x, max(2, reps // 4), repeats=3)
                    emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl="xla_naive_dequant", time_us=t[0],
                              min_us=t[1], max_us=t[2], bytes=wb, gbps=wb / t[0] / 1e3,
                              speedup_vs_bf16=base[0] / t[0]))
        del ws

    finish(results)


PROFILE = True


def run_ffi_gemv(name, n, k, m, x, weights, base, base_k, bf16_bytes, emit):
    """The CUDA decode GEMV of dsv4_jax/ffi/ (default schedule), checked against the reference first; errors are
    reported."""
    fmt = {"Fp8BlockWeight": "fp8", "Mxfp4Weight": "mxfp4", "Nvfp4Weight": "nvfp4"}[type(weights[0]).__name__]
    try:
        from dsv4_jax import ffi
        w0 = weights[0]
        err = rel_err(jax.jit(lambda x, w: ffi.gemv(x, w, jnp.float32))(x, w0),
                      jax.jit(lambda x, w: linear(x.astype(jnp.float32), w, jnp.float32, ctx=REFERENCE))(x, w0))
        if err > 1e-3:
            raise RuntimeError(f"wrong result: rel. err {err:.3g}")
        reps = max(2, int(2000 / (len(weights) * max(1, n * k // (1 << 24)))))
        t = time_calls(ffi.gemv, weights, x, reps)
        kt = profiled_kernel_us(ffi.gemv, x, weights) if PROFILE else None
    except Exception as e:  # noqa: BLE001 - report and go on
        emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl="ffi_cuda", error=f"{type(e).__name__}: {e}"[:400]))
        return
    wb = weight_bytes(weights[0]) + m * k * 2
    emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl="ffi_cuda", time_us=t[0], min_us=t[1], max_us=t[2],
              kernel_us=kt, bytes=wb, gbps=wb / t[0] / 1e3, rel_err=err,
              pct_bf16_bw=100 * (wb / t[0]) / (bf16_bytes / base[0]), speedup_vs_bf16=base[0] / t[0],
              kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None))
def run_ffi_moe(name, n, k, fmt, x, ref, w_sets, reps, wb, touched, emit):
    """The routed-expert CUDA GEMV of dsv4_jax/ffi/ (one slot per row), checked against the reference (`ref`: float32
    products with w_sets[0]'s experts) first."""
    rows = x.shape[0]
    try:
        from dsv4_jax import ffi
        err = rel_err(jax.jit(lambda x, wi: ffi.moe_gemv(x, *wi, jnp.float32))(x, w_sets[0]), ref)
        if err > 1e-3:
            raise RuntimeError(f"wrong result: rel. err {err:.3g}")
        t = time_calls(lambda x, wi: ffi.moe_gemv(x, *wi), w_sets, x, reps)
        kt = profiled_kernel_us(lambda x, wi: ffi.moe_gemv(x, *wi), x, w_sets) if PROFILE else None
    except Exception as e:  # noqa: BLE001 - report and go on
        emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="ffi_moe", error=f"{type(e).__name__}: {e}"[:400]))
        return
    emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="ffi_moe", time_us=t[0], min_us=t[1], max_us=t[2],
              kernel_us=kt, bytes=wb, gbps=wb / t[0] / 1e3, rel_err=err, experts=touched))


KERNELS = "pallas"          # "interpret" under --smoke
PREFILL = ["wo_b", "wq_b", "shared_w1", "experts_w1", "wq_a", "wo_a"]     # experts_w1: one MXFP4 expert, dense
SWEEP = ("wo_b", "experts_w1")    # shapes on which --sweep compares tile configurations of the prefill kernel
# (block_m, block_n, num_warps, num_stages) of the FP8-block (wo_b) / MXFP4-operand (experts_w1) prefill kernel
PREFILL_CONFIGS = ((128, 128, 8, 4), (64, 128, 4, 4), (64, 64, 4, 3), (64, 128, 8, 3), (64, 128, 4, 2),
                   (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3))
# (block_n, K inputs per step, num_warps, num_stages, slot_cols) of the MoE kernel with prefill-wide slots: the
# former default first, then what ops/matmul_kernels now picks at 128 columns for MXFP4 and for NVFP4
MOE_CONFIGS = ((64, 256, 4, 3, 128), (128, 128, 8, 3, 128), (64, 128, 4, 3, 128), (128, 256, 8, 3, 128),
               (128, 128, 8, 2, 128), (128, 64, 8, 3, 128), (128, 64, 8, 4, 128), (128, 128, 8, 4, 128),
               (256, 128, 16, 3, 128), (128, 128, 4, 3, 128), (64, 256, 4, 3, 64))
MOE_SWEEP_NVFP4 = 4         # the first configurations, also on NVFP4 experts


def run_prefill(args, key, ms, t_start, emit):
    """Many rows: tensor-core rates (TFLOP/s) of XLA's bf16 and FP8 dots, the naive path and our FP8 kernel."""
    shapes = {name: (n, k) for name, n, k in DENSE + EXPERTS}
    names = args.prefill_shapes.split(",") if not args.smoke else list(shapes)
    unknown = [s for s in names if s not in shapes]
    if unknown:
        raise SystemExit(f"unknown --prefill-shapes {unknown}; expected some of {list(shapes)}")
    for name in names:
        n, k = shapes[name]
        fmt = "mxfp4" if name.startswith("experts") else "fp8"
        w = make_weight(jax.random.fold_in(key, 31), fmt, (n, k))
        wb = make_weight(jax.random.fold_in(key, 32), "bf16", (n, k))
        operand = prefill.mxfp4_weight_operand if fmt == "mxfp4" else prefill.fp8_weight_operand
        wq, sw = jax.jit(operand)(w)
        w8_plain = wq                                                        # per-tensor FP8 for XLA's FP8 dot
        for m in ms:
            if time.time() - t_start > args.budget_s:
                print("budget reached; stopping prefill", flush=True)
                return
            x = jax.random.normal(jax.random.fold_in(key, 2000 + m), (m, k), jnp.float32).astype(jnp.bfloat16)
            xq, sx = jax.jit(quantize_fp8)(x)
            flops = 2 * m * n * k
            reps = 2 if args.smoke else min(500, max(2, int(2e13 / flops)))

            def run(impl, fn, xin, weights, **extra):
                try:
                    t = time_calls(fn, weights, xin, reps, repeats=3)
                    kt = profiled_kernel_us(fn, xin, weights) if PROFILE else None
                except Exception as err:  # noqa: BLE001 - report and go on with the other cases
                    emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl=impl, error=f"{type(err).__name__}: {err}"[:400]))
                    return None
                rec = dict(name=name, shape=[m, n, k], fmt=fmt if impl != "xla_dot" else "bf16", impl=impl,
                           time_us=t[0], min_us=t[1], max_us=t[2], kernel_us=kt, tflops=flops / t[0] / 1e6,
                           kernel_tflops=flops / kt / 1e6 if kt else None, gbps=float("nan"), **extra)
                if impl.startswith("pallas") and base and fp8:
                    rec.update(pct_of_xla_fp8=100 * fp8["time_us"] / rec["time_us"],
                               kernel_pct_of_xla_fp8=(100 * fp8["kernel_us"] / kt if kt and fp8["kernel_us"] else None),
                               speedup_vs_bf16=base["time_us"] / rec["time_us"])
                emit(rec)
                return rec

            base = fp8 = None
            base = run("xla_dot", lambda x, w: x @ w.T, x, [wb, wb])
            fp8 = run("xla_fp8_dot", lambda x, w: jax.lax.dot_general(
                x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                xq, [w8_plain, w8_plain])
            try:
                ref = jax.jit(lambda x, w: linear(x, w, jnp.float32, ctx=REFERENCE_FP8))(x, w)
                err = rel_err(jax.jit(lambda x, wq=wq: prefill.fp8_block_matmul(xq, sx, wq, sw, jnp.float32))(x),
                              ref)      # wq bound now: the loop body ends with `del wq`
            except Exception as e:  # noqa: BLE001
                err, msg = float("inf"), f"{type(e).__name__}: {e}"[:400]
            else:
                msg = None
            if err > 1e-3:
                emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl="pallas_prefill_fp8", rel_err=err, error=msg))
                continue
            configs = [dict()]
            if args.sweep and m >= 4096 and name in SWEEP:
                configs += [dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                            for bm, bn, nw, ns in PREFILL_CONFIGS]
            for cfg in configs:
                label = "pallas_prefill_fp8" + ("" if not cfg else "[" + ",".join(f"{v}" for v in cfg.values()) + "]")
                cfg_err = err if not cfg else rel_err(jax.jit(
                    lambda x, cfg=cfg, wq=wq: prefill.fp8_block_matmul(xq, sx, wq, sw, jnp.float32, **cfg))(x), ref)
                if cfg_err > 1e-3:
                    emit(dict(name=name, shape=[m, n, k], fmt=fmt, impl=label, rel_err=cfg_err, config=cfg))
                    continue
                run(label, lambda x, w, cfg=cfg: prefill.fp8_block_matmul(x, sx, w, sw, **cfg), xq, [wq, wq],
                    rel_err=cfg_err, config=cfg)
            run("linear_fp8_end_to_end", lambda x, w: linear(x, w, ctx=RunContext.create(act_quant="fp8", kernels=KERNELS)), x, [w, w])
            run("xla_naive_dequant", lambda x, w: linear(x, w, ctx=REFERENCE), x, [w, w])
        del w, wb, wq, w8_plain


def run_moe_prefill(args, key, row_counts, emit):
    """Routed experts of a prefill chunk (experts_w1 shape, 256 experts, 6 per token): our MoE kernel with wide
    slots (grouped_linear as the model calls it) vs the reference (dequantize all experts + ragged_dot) and
    ragged_dot on bf16 experts."""
    name, n, k = EXPERTS[0]
    n_exp = N_EXPERTS
    w4 = make_weight(jax.random.fold_in(key, 41), "mxfp4", (n_exp, n, k))
    wb = make_weight(jax.random.fold_in(key, 42), "bf16", (n_exp, k, n))
    for rows in row_counts:
        if args.smoke:
            rows = min(rows, 160)
        ids = np.sort(routed_expert_ids(rows, rows // TOP_K, n_exp))
        sizes = jnp.asarray(np.bincount(ids, minlength=n_exp), jnp.int32)
        x = jax.random.normal(jax.random.fold_in(key, 7000 + rows), (len(ids), k), jnp.float32).astype(jnp.bfloat16)
        flops = 2 * len(ids) * n * k
        cases = [("pallas_moe_prefill", lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=RunContext.create(kernels=KERNELS)), w4),
                 ("xla_dequant_ragged_dot", lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=REFERENCE),
                  w4),
                 ("ragged_dot_bf16", lambda x, w: jax.lax.ragged_dot(x, w, sizes), wb)]
        checked = rows <= MAX_CHECKED_MOE_ROWS          # (XLA's ragged_dot reference needs ~96 GB at 49,152 rows)
        if not checked:
            cases = [c for c in cases if c[0] != "xla_dequant_ragged_dot"]
        ref = jax.jit(cases[1][1])(x, w4).astype(jnp.float32) if checked else None
        # FP8 activations, both as the model calls them: the default (the activation quantized to exact bf16 values,
        # then the bf16 MoE kernel) and the opt-in W4A8 kernel (matmul=kernel); then the W4A8 kernel in each tile
        # shape (the Pallas FP8 quantize, the slot gathers and the kernel). Checked against the reference's W4A8 math.
        ids_j = jnp.asarray(ids, jnp.int32)
        fp8_ctx = RunContext.create(act_quant="fp8", kernels=KERNELS)
        fp8_w4a8_ctx = RunContext.create(act_quant="fp8", kernels=KERNELS, kernel_overrides=["matmul=kernel"])
        if not args.smoke:
            cases += [("pallas_moe_prefill_fp8act",
                       lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=fp8_ctx), w4),
                      ("pallas_moe_fp8_model", lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=fp8_w4a8_ctx),
                       w4)]
        for tile in ([] if args.smoke else [t for t in args.moe_fp8_tiles.split(",") if t]):
            bm, bn, warps = map(int, tile.rstrip("ab").split("x"))
            operand = tile[-1] if tile[-1] in "ab" else "a"
            def w4a8(x, w, bm=bm, bn=bn, warps=warps, operand=operand):
                xq, sx = act_quantize.quantize_fp8(x, fp8_ctx)
                return moe_fp8.moe_fp8_matmul(xq, sx, w, ids_j, block_m=bm, block_n=bn, num_warps=warps,
                                              weight_operand=operand)
            cases.append((f"pallas_moe_fp8_{bm}x{bn}x{warps}{operand}", w4a8, w4))
        ref_fp8 = (jax.jit(lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=REFERENCE_FP8))(x, w4)
                   if checked and len(cases) > 3 else None)
        for impl, fn, w in cases:
            try:
                err = None if not checked else (rel_err(jax.jit(fn)(x, w), ref) if impl == "pallas_moe_prefill"
                       else rel_err(jax.jit(fn)(x, w), ref_fp8) if "fp8" in impl else None)
                t = time_calls(fn, [w], x, 2 if args.smoke else 5, repeats=3)
                kt = profiled_kernel_us(fn, x, [w], calls=4) if PROFILE else None
            except Exception as e:  # noqa: BLE001
                emit(dict(name=name, shape=[len(ids), n, k], fmt="mxfp4", impl=impl, error=f"{type(e).__name__}: {e}"[:400]))
                continue
            emit(dict(name=name, shape=[len(ids), n, k], fmt="bf16" if impl == "ragged_dot_bf16" else "mxfp4",
                      impl=impl, time_us=t[0], min_us=t[1], max_us=t[2], kernel_us=kt, rel_err=err,
                      tflops=flops / t[0] / 1e6, gbps=float("nan"), experts=n_exp))
        if args.sweep and checked:
            run_moe_sweep(args, key, name, n, k, x, jnp.asarray(ids, jnp.int32), w4, ref, flops, emit)
    del w4, wb


def checked_timing(fn, x, w, want, smoke: bool, what: str = "wrong result"):
    """(relative error of fn(x, w) against want, time_calls' (median, min, max) us, the profiler's kernel us or
    None) for the MoE cases; an error above 1e-3 raises before anything is timed."""
    err = rel_err(jax.jit(fn)(x, w), want)
    if err > 1e-3:
        raise RuntimeError(f"{what}: rel. err {err:.3g}")
    t = time_calls(fn, [w], x, 2 if smoke else 5, repeats=3)
    return err, t, profiled_kernel_us(fn, x, [w], calls=4) if PROFILE else None


def run_moe_ffn(args, key, row_counts, emit):
    """A prefill chunk's whole routed FFN (gate and up projections, clamped SwiGLU, routing weights, down
    projection, each token's sum) as the model runs it (moe_ffn._grouped_experts), 256 MXFP4 experts of Flash's
    shapes (EXPERTS): the default path (the MoE kernel per projection, the SwiGLU and the gathers between) and
    moe.moe_ffn's two kernels (the override moe_ffn=kernel), then moe_ffn with its gate / up kernel at each
    --moe-ffn-tiles tiling; each checked against the default path first."""
    from dsv4_jax import presets
    from dsv4_jax.ops import moe_ffn as ffn_ops
    (_, inter, dim), n_exp = EXPERTS[0], N_EXPERTS
    if args.smoke:                          # moe_ffn's smallest geometry: the down projection's K a multiple of 256
        inter, dim = 256, 256
    cfg = presets.named("flash", 1)
    params = {name: {"weight": make_weight(jax.random.fold_in(key, 60 + i), "mxfp4", shape)}
              for i, (name, shape) in enumerate((("w1", (n_exp, inter, dim)), ("w3", (n_exp, inter, dim)),
                                                 ("w2", (n_exp, dim, inter))))}
    default_ctx = RunContext.create(kernels=KERNELS)
    ffn_ctx = RunContext.create(kernels=KERNELS, kernel_overrides=["moe_ffn=kernel"])
    for rows in row_counts:
        tokens = (min(rows, 192) if args.smoke else rows) // TOP_K
        ids = jnp.asarray(routed_expert_ids(rows, tokens, n_exp).reshape(tokens, TOP_K), jnp.int32)
        weights = jax.random.uniform(jax.random.fold_in(key, 61), (tokens, TOP_K), jnp.float32, 0.05, 0.5)
        x = jax.random.normal(jax.random.fold_in(key, 62 + rows), (tokens, dim), jnp.float32).astype(jnp.bfloat16)
        flops = 2 * tokens * TOP_K * 3 * inter * dim

        def model_path(ctx):
            return lambda x, p: ffn_ops._grouped_experts(p, cfg, x, ids, weights, n_exp, ctx)

        def tiled(bn, warps):
            up_tiles = dict(block_n=bn, num_warps=warps)
            return lambda x, p: moe.moe_ffn(x, p["w1"]["weight"], p["w3"]["weight"], p["w2"]["weight"], ids, weights,
                                            cfg.swiglu_limit, interpret=KERNELS == "interpret", up_tiles=up_tiles)

        cases = [("routed_ffn_default", model_path(default_ctx)), ("routed_ffn_moe_ffn", model_path(ffn_ctx))]
        for tile in [t for t in args.moe_ffn_tiles.split(",") if t]:
            bn, warps = map(int, tile.split("x"))
            cases.append((f"moe_ffn_{bn}x{warps}", tiled(bn, warps)))
        ref = jax.jit(cases[0][1])(x, params)
        for impl, fn in cases:
            try:
                err, t, kt = checked_timing(fn, x, params, ref, args.smoke, "differs from the default path")
            except Exception as e:  # noqa: BLE001 - report and go on with the other cases
                emit(dict(name="routed_ffn", shape=[tokens * TOP_K, inter, dim], fmt="mxfp4", impl=impl,
                          error=f"{type(e).__name__}: {e}"[:400]))
                continue
            emit(dict(name="routed_ffn", shape=[tokens * TOP_K, inter, dim], fmt="mxfp4", impl=impl, time_us=t[0], min_us=t[1],
                      max_us=t[2], kernel_us=kt, rel_err=err, tflops=flops / t[0] / 1e6, gbps=float("nan")))
    del params


def run_moe_sweep(args, key, name, n, k, x, ids, w4, ref, flops, emit):
    """The MoE kernel alone (slot schedule and gathers included, as moe_matmul runs them) in MOE_CONFIGS' tile
    configurations on MXFP4 experts (and the first MOE_SWEEP_NVFP4 on NVFP4), each checked against the
    reference first."""
    sizes = jnp.bincount(ids, length=w4.shape[0]).astype(jnp.int32)
    w_nv = make_weight(jax.random.fold_in(key, 43), "nvfp4", w4.shape)
    ref_nv = jax.jit(lambda x, w: grouped_linear(x, w, sizes, jnp.float32, ctx=REFERENCE))(x, w_nv)
    configs = [("mxfp4", c) for c in MOE_CONFIGS] + [("nvfp4", c) for c in MOE_CONFIGS[:MOE_SWEEP_NVFP4]]
    for fmt, (bn, k_step, warps, stages, cols) in configs[:2] if args.smoke else configs:
        w, want = (w4, ref) if fmt == "mxfp4" else (w_nv, ref_nv)
        cfg = dict(block_n=bn, unroll=k_step // w.block, num_warps=warps, num_stages=stages, slot_cols=cols, split_k=1)
        impl = "pallas_moe_kernel[" + ",".join(str(v) for v in (bn, k_step, warps, stages, cols)) + "]"
        fn = lambda x, w, cfg=cfg: moe.moe_matmul(x, w, ids, jnp.float32, **cfg)  # noqa: E731
        try:
            err, t, kt = checked_timing(fn, x, w, want, args.smoke)
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            emit(dict(name=name, shape=[len(ids), n, k], fmt=fmt, impl=impl, config=cfg,
                      error=f"{type(e).__name__}: {e}"[:400]))
            continue
        emit(dict(name=name, shape=[len(ids), n, k], fmt=fmt, impl=impl, config=cfg, time_us=t[0], min_us=t[1],
                  max_us=t[2], kernel_us=kt, rel_err=err, tflops=flops / t[0] / 1e6, gbps=float("nan")))
    del w_nv


def run_experts(args, key, ms, t_start, emit):
    for name, n, k in (EXPERTS if not args.quick else EXPERTS[:1]):
        for fmt in ("mxfp4", "nvfp4", "bf16"):
            # bf16 experts stored [E, K, N] so ragged_dot needs no transpose inside the timed program
            w_all = make_weight(jax.random.fold_in(key, 77), fmt, (N_EXPERTS, k, n) if fmt == "bf16" else (N_EXPERTS, n, k))
            for m in [mm for mm in ms if mm <= 8] or [1]:
                if time.time() - t_start > args.budget_s / 2:
                    return
                ids = jnp.asarray(routed_expert_ids(m, m, N_EXPERTS), jnp.int32)
                rows = ids.shape[0]
                x = jax.random.normal(jax.random.fold_in(key, 5000 + m), (rows, k), jnp.float32).astype(jnp.bfloat16)
                touched = len(set(np.asarray(ids).tolist()))
                per_expert = weight_bytes(jax.tree_util.tree_map(lambda a: a[0], w_all)) if fmt != "bf16" else n * k * 2
                wb = touched * per_expert + rows * k * 2
                # rotate: distinct expert sets per call so no call re-reads another's experts from L2
                sets = min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / wb)))
                id_sets = [jnp.asarray((np.asarray(ids) + 7 * j) % N_EXPERTS, jnp.int32) for j in range(sets)]
                reps = max(2, int(400 / sets))
                # the stacked weight is an argument (a closure would make it a constant XLA folds for minutes)
                w_sets = [(w_all, i) for i in id_sets]
                if fmt == "bf16":
                    def ragged(x, wi):
                        w, i = wi
                        o = jnp.argsort(i)
                        return jax.lax.ragged_dot(x[o], w, jnp.bincount(i, length=N_EXPERTS).astype(jnp.int32))
                    t = time_calls(ragged, w_sets, x, reps)
                    emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="ragged_dot", time_us=t[0], min_us=t[1],
                              max_us=t[2], bytes=wb, gbps=wb / t[0] / 1e3, experts=touched))
                    t = time_calls(lambda x, wi: jnp.einsum("rk,rkn->rn", x, wi[0][wi[1]]), w_sets, x, reps)
                    emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="xla_gather_einsum", time_us=t[0],
                              min_us=t[1], max_us=t[2], bytes=wb, gbps=wb / t[0] / 1e3, experts=touched))
                    dense_bf16 = [make_weight(jax.random.fold_in(key, 900 + j), "bf16", (touched, n, k))
                                  for j in range(max(2, math.ceil(ROTATE_BYTES / (touched * n * k * 2))))]
                    xe = x[:touched]
                    t = time_calls(lambda x, w: jnp.einsum("ek,enk->en", x, w), dense_bf16, xe, reps)
                    emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="xla_bf16_per_expert_dot", time_us=t[0],
                              min_us=t[1], max_us=t[2], bytes=touched * n * k * 2, experts=touched,
                              gbps=touched * n * k * 2 / t[0] / 1e3))
                    continue
                sub = jax.tree_util.tree_map(lambda a: a[ids], w_all)
                ref = jnp.einsum("rk,rnk->rn", x.astype(jnp.float32), sub.dequantize(jnp.float32))
                del sub
                err = rel_err(jax.jit(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32))(x, w_all, ids), ref)
                t = time_calls(lambda x, wi: moe.moe_matmul(x, *wi), w_sets, x, reps) if err < 1e-3 \
                    else (float("nan"),) * 3
                emit(dict(name=name, shape=[rows, n, k], fmt=fmt, impl="pallas_moe", time_us=t[0], min_us=t[1],
                          max_us=t[2], bytes=wb, gbps=wb / t[0] / 1e3, rel_err=err, experts=touched))
                if not args.smoke:
                    run_ffi_moe(name, n, k, fmt, x, ref, w_sets, reps, wb, touched, emit)
            del w_all


def finish(results):
    """Short table: per shape and M, time and speedup of each implementation vs the bf16 baseline."""
    print("\n| case | M | impl | fmt | us | kernel us | GB/s | TFLOP/s | x bf16 | % bf16 BW | % XLA FP8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in results:
        print(f"| {r['name']} | {r['shape'][0]} | {r['impl']} | {r['fmt']} | {r.get('time_us', nan):.1f} | "
              f"{r.get('kernel_us') or nan:.1f} | {r.get('gbps', nan):.0f} | {r.get('tflops', nan):.1f} | "
              f"{r.get('speedup_vs_bf16', nan):.2f} | {r.get('pct_bf16_bw', nan):.0f} | "
              f"{r.get('pct_of_xla_fp8', nan):.0f} |")


if __name__ == "__main__":
    main()
