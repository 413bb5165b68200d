"""Schedule sweep of the FFI CUDA decode GEMVs (ffi/) on the GPU, with XLA's bf16 dot and the Pallas GEMV of the
same matrix side by side in the same process.

    python3 benchmarks/bench_ffi.py --out $OUT/bench_ffi.json [--budget-s 300]
    python3 benchmarks/bench_ffi.py --gate-up-only --out $OUT/bench_gate_up.json    # gate + up: one launch or two
    python3 benchmarks/bench_ffi.py --concat-only --out $OUT/bench_concat.json      # wq_a + wkv: one launch or two
    python3 benchmarks/bench_ffi.py --dense-only 32,64    # dense FP8 at 32 / 64 rows: the Pallas GEMV's variants

Method as benchmarks/bench_kernels.py (its time_calls / profiled_kernel_us): every case is checked against the
reference first; wall time per call in one jitted program over weight copies that L2 cannot hold; kernel time
from the profiler for the bf16 dot and the schedules in PROFILED. A schedule is 10000 x B + 1000 x P + 100 x warps
+ 10 x tiles + unroll: P = 0 direct loads, 1 persistent + L2 prefetch, 2 streamed (contiguous steps per warp,
L2::256B load hint), 3 pipelined (each warp loads its next step's weights before computing the current one);
B = the CTAs per SM the registers are capped for; 4 staged (a producer warp copies whole tiles into shared memory
with bulk async copies, `warps` consumer warps decode from there; B = CTAs per SM); warps digit 0 = 16
(dsv4_jax/ffi/gemv_kernel.cuh).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4_jax import ffi  # noqa: E402
from dsv4_jax.ops.moe_ffn import clamped_swiglu  # noqa: E402
from dsv4_jax.numerics.formats import weight_bytes  # noqa: E402
from dsv4_jax.ops.matmul import linear  # noqa: E402
from dsv4_jax.pallas_kernels import gemv, moe  # noqa: E402
from benchmarks.bench_kernels import (MAX_COPIES, REFERENCE, ROTATE_BYTES, make_weight, nbytes,  # noqa: E402
                                   profiled_kernel_us, recorder, rel_err, routed_expert_ids, time_calls)

SHAPES = [("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("lm_head", 129280, 4096), ("wo_a", 8192, 4096),
          ("w_18432x7168", 18432, 7168), ("wq_a", 1024, 4096), ("wkv", 512, 4096), ("shared_w1", 2048, 4096),
          ("shared_w2", 4096, 2048)]
SCHEDULES = [811, 411, 43811, 2811, 24011, 4011, 4811, 24811, 4411, 50811, 83411, 3411, 2411, 814, 812, 414, 821,
             1811, 11, 12]                                   # staged (P = 4): FP4 only
MOE_SCHEDULES = [811, 411, 24011, 4011, 24811]
ROUTED = ffi.ROUTED_SCHEDULE
GEMV_LAYOUT_FORMATS = ("mxfp4", "nvfp4")              # also timed in the GEMV layout (dsv4_jax/ffi/fp4_layout.py)
GEMV_LAYOUT_SCHEDULES = [811, 24011, 4011, 24811]
# schedules timed by the profiler too (kernel time)
PROFILED = (0, 811, 24011, 4011, 4811, 24811, 4411, 43811, 2811, 83411, 814, 414, 821, 1811, 11, 12)
PALLAS = {"fp8": gemv.fp8_matmul, "mxfp4": gemv.mxfp4_matmul, "nvfp4": gemv.nvfp4_matmul}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "bench_ffi.json"))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--formats", default="mxfp4,nvfp4,fp8")
    ap.add_argument("--schedules", default=",".join(map(str, SCHEDULES)),
                    help="dense sweep (MXFP4 all, the other formats the first four); --experts uses MOE_SCHEDULES")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--layout-schedules", default=",".join(map(str, GEMV_LAYOUT_SCHEDULES)),
                    help="schedules timed on the GEMV layout of the FP4 weights ('' for none)")
    ap.add_argument("--experts", action="store_true", help="also the routed-expert GEMV (6 of 256 experts)")
    ap.add_argument("--gate-up-only", action="store_true",
                    help="only the gate + up projections (routed MXFP4 / NVFP4, shared FP8): one launch or two")
    ap.add_argument("--concat-only", action="store_true",
                    help="only the attention's wq_a + wkv (FP8, one K): two launches or one ffi.gemv_concat")
    ap.add_argument("--slotted-only", default="",
                    help="only the routed experts of decode steps of these batches (e.g. 32,64,128,256) as "
                         "routed_gemv runs them from 22 tokens on: rows grouped by expert into 8-row slots")
    ap.add_argument("--slotted-format", default="mxfp4", choices=("mxfp4", "nvfp4"))
    ap.add_argument("--dense-only", default="",
                    help="only the dense FP8 projections at these row counts (e.g. 32,64; 9-256): the Pallas GEMV "
                         "at its default and the tilings of DENSE_VARIANTS, with and without row_prescale")
    args = ap.parse_args()
    t0 = time.time()
    results = []
    emit = recorder(args.out, results, {"device": jax.devices()[0].device_kind, "argv": sys.argv[1:]})

    faulthandler.dump_traceback_later(args.budget_s + 150, exit=True)       # a stuck case shows where it stuck
    key = jax.random.key(0)
    if args.gate_up_only or args.concat_only:
        (run_gate_up if args.gate_up_only else run_concat)(args, key, emit, t0)
        summary(results)
        return
    if args.slotted_only:
        run_slotted(args, key, emit, t0)
        summary(results)
        return
    if args.dense_only:
        run_dense(args, key, emit, t0)
        summary(results)
        return
    schedules = [int(s) for s in args.schedules.split(",")]
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        bf16_bytes = n * k * 2
        ws = {}
        for fmt in ["bf16"] + args.formats.split(","):
            c = min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / nbytes(jax.eval_shape(lambda: make_weight(key, fmt, (n, k)))))))
            ws[fmt] = [make_weight(jax.random.fold_in(key, i), fmt, (n, k)) for i in range(c)]
        for m in [int(v) for v in args.ms.split(",")]:
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                break
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            reps = max(2, int(2000 / (len(ws["bf16"]) * max(1, n * k // (1 << 24)))))
            base = time_calls(lambda x, w: x @ w.T, ws["bf16"], x, reps)
            base_k = profiled_kernel_us(lambda x, w: x @ w.T, x, ws["bf16"])
            emit(dict(name=name, m=m, n=n, k=k, fmt="bf16", impl="xla_dot", us=base[0], kernel_us=base_k,
                      gbps=bf16_bytes / base[0] / 1e3))
            for fmt in args.formats.split(","):
                wb = weight_bytes(ws[fmt][0]) + m * k * 2
                ref = jax.jit(lambda x, w: linear(x.astype(jnp.float32), w, jnp.float32, ctx=REFERENCE))(x, ws[fmt][0])
                swept = schedules if fmt == "mxfp4" else schedules[:4]         # the full sweep on MXFP4 only
                cases = [("pallas", 0, PALLAS[fmt], ws[fmt])] + [
                    ("ffi", s, functools.partial(ffi.gemv, schedule=s), ws[fmt]) for s in swept]
                if fmt in GEMV_LAYOUT_FORMATS:                  # the same weights in the GEMV layout
                    laid = [jax.jit(ffi.to_gemv_layout)(w) for w in ws[fmt]]
                    cases += [("ffi_gemv_layout", int(s), functools.partial(ffi.gemv, schedule=int(s)), laid)
                              for s in args.layout_schedules.split(",") if s]
                for impl, sched, fn, weights in cases:
                    if impl != "pallas" and n % (16 * max(1, sched // 10 % 10)):
                        continue
                    try:
                        err = rel_err(jax.jit(lambda x, w: fn(x, w, jnp.float32))(x, weights[0]), ref)
                        if err > 1e-4:
                            raise RuntimeError(f"wrong result: rel. err {err:.3g}")
                        t = time_calls(fn, weights, x, reps, repeats=3)
                        kt = profiled_kernel_us(fn, x, weights) if sched in PROFILED else None
                    except Exception as e:  # noqa: BLE001
                        emit(dict(name=name, m=m, fmt=fmt, impl=impl, schedule=sched, error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    emit(dict(name=name, m=m, n=n, k=k, fmt=fmt, impl=impl, schedule=sched, us=t[0], kernel_us=kt,
                              rel_err=err, gbps=wb / t[0] / 1e3, speedup_vs_bf16=base[0] / t[0],
                              kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None))
        del ws
    if args.experts:
        run_experts(args, key, emit, t0)
    summary(results)


def run_experts(args, key, emit, t0):
    """6 of 256 experts per token, M tokens: one routed row per (token, expert). The stacked weight is an
    argument of the timed program (a closure would make it a 1 GB constant that XLA folds for minutes)."""
    n_exp, top_k = 256, 6
    for name, n, k in [("experts_w1", 2048, 4096), ("experts_w2", 4096, 2048)]:
        for fmt in ("mxfp4", "nvfp4"):
            w_all = make_weight(jax.random.fold_in(key, 77), fmt, (n_exp, n, k))
            w_laid = jax.jit(ffi.to_gemv_layout)(w_all) if fmt in GEMV_LAYOUT_FORMATS else None
            for m in [int(v) for v in args.ms.split(",")]:
                if time.time() - t0 > args.budget_s + 100:
                    return
                ids = routed_expert_ids(m, m, n_exp, top_k)
                x = jax.random.normal(jax.random.fold_in(key, 5000 + m), (len(ids), k), jnp.float32).astype(jnp.bfloat16)
                # rotate expert sets so no call re-reads another's experts from L2
                sets = [(w_all, jnp.asarray((ids + 7 * j) % n_exp, jnp.int32)) for j in range(24)]
                sub = jax.tree_util.tree_map(lambda a: a[sets[0][1]], w_all)
                ref = jnp.einsum("rk,rnk->rn", x.astype(jnp.float32), sub.dequantize(jnp.float32))
                del sub
                touched = len(set(ids.tolist()))
                per_expert = weight_bytes(jax.tree_util.tree_map(lambda a: a[0], w_all))
                wb = touched * per_expert + x.size * 2
                # baseline: XLA's bf16 dot of each touched expert with one row (the bf16 grouped equivalent)
                dense = [make_weight(jax.random.fold_in(key, 900 + j), "bf16", (touched, n, k)) for j in range(4)]
                base = time_calls(lambda x, w: jnp.einsum("ek,enk->en", x, w), dense, x[:touched], 20, repeats=3)
                base_k = profiled_kernel_us(lambda x, w: jnp.einsum("ek,enk->en", x, w), x[:touched], dense)
                emit(dict(name=name, m=m, rows=len(ids), n=n, k=k, fmt="bf16", impl="xla_bf16_per_expert_dot",
                          us=base[0], kernel_us=base_k, gbps=touched * n * k * 2 / base[0] / 1e3, experts=touched))
                del dense
                cases = [("pallas_moe", 0, lambda x, wi: moe.moe_matmul(x, *wi), sets)] + [
                    ("ffi_moe", s, lambda x, wi, s=s: ffi.moe_gemv(x, *wi, schedule=s), sets) for s in MOE_SCHEDULES]
                if fmt in GEMV_LAYOUT_FORMATS:
                    laid = [(w_laid, i) for _, i in sets]
                    cases += [("ffi_moe_gemv_layout", s, lambda x, wi, s=s: ffi.moe_gemv(x, *wi, schedule=s), laid)
                              for s in GEMV_LAYOUT_SCHEDULES]
                for impl, sched, fn, weights in cases:
                    try:
                        err = rel_err(jax.jit(fn)(x, weights[0]), ref)
                        if err > 1e-2:                          # bf16 outputs: ~2e-3 from their rounding
                            raise RuntimeError(f"wrong result: rel. err {err:.3g}")
                        t = time_calls(fn, weights, x, 20, repeats=3)
                        kt = profiled_kernel_us(fn, x, weights) if sched in PROFILED else None
                    except Exception as e:  # noqa: BLE001
                        emit(dict(name=name, m=m, fmt=fmt, impl=impl, schedule=sched, error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    emit(dict(name=name, m=m, rows=len(ids), n=n, k=k, fmt=fmt, impl=impl, schedule=sched, us=t[0],
                              kernel_us=kt, rel_err=err, gbps=wb / t[0] / 1e3, experts=touched,
                              speedup_vs_bf16=base[0] / t[0],
                              kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None))
            del w_all, w_laid


def run_gate_up(args, key, emit, t0):
    """The gate and up projections of an expert, then the clamped SwiGLU, as the model runs them at decode:
    two launches (one per weight) or one launch of the pair (ffi weight sets: each activation load serves both),
    against XLA's bf16 dots of the same matrices. Routed: w1 / w3 [256, 2048, 4096] MXFP4 / NVFP4, 6 experts per
    token; shared: w1 / w3 [2048, 4096] FP8. The times include the SwiGLU's elementwise kernel in every case."""
    n_exp, top_k, n, k, limit = 256, 6, 2048, 4096, 10.0
    for fmt in ("mxfp4", "nvfp4", "fp8"):
        routed = fmt != "fp8"
        lead = (n_exp,) if routed else ()
        w1, w3 = (make_weight(jax.random.fold_in(key, 300 + i), fmt, (*lead, n, k)) for i in range(2))
        for m in [int(v) for v in args.ms.split(",")]:
            if time.time() - t0 > args.budget_s:
                return
            if routed:
                ids = routed_expert_ids(m, m, n_exp, top_k)
                # rotate expert sets so no call re-reads another's experts from L2
                sets = [(w1, w3, jnp.asarray((ids + 7 * j) % n_exp, jnp.int32)) for j in range(24)]
                touched, rows = len(set(ids.tolist())), len(ids)
                two = lambda x, wi, s=ROUTED: clamped_swiglu(ffi.moe_gemv(x, wi[0], wi[2], jnp.float32, schedule=s),
                                                             ffi.moe_gemv(x, wi[1], wi[2], jnp.float32, schedule=s),
                                                             limit)
                one = lambda x, wi, s: _swiglu_halves(ffi.moe_gemv(x, (wi[0], wi[1]), wi[2], jnp.float32,
                                                                   schedule=s), limit)
                # bf16 baseline: each touched expert's gate and up as XLA einsums over bf16 copies
                dense = [tuple(make_weight(jax.random.fold_in(key, 900 + 2 * j + i), "bf16", (touched, n, k))
                               for i in range(2)) for j in range(4)]
                base_fn = lambda x, w: clamped_swiglu(_bf16_expert_dots(x, w[0]), _bf16_expert_dots(x, w[1]), limit)
                per_weight = touched * weight_bytes(jax.tree_util.tree_map(lambda a: a[0], w1))
            else:
                copies = 12                                   # 8 MB per copy: 96 MB rotate past L2
                pairs = [(make_weight(jax.random.fold_in(key, 400 + 2 * j), fmt, (n, k)),
                          make_weight(jax.random.fold_in(key, 401 + 2 * j), fmt, (n, k))) for j in range(copies)]
                sets = [(a, b, None) for a, b in pairs]
                touched, rows = 1, m
                two = lambda x, wi: clamped_swiglu(ffi.gemv(x, wi[0], jnp.float32), ffi.gemv(x, wi[1], jnp.float32),
                                                   limit)
                one = lambda x, wi, s: _swiglu_halves(ffi.gemv(x, (wi[0], wi[1]), jnp.float32, schedule=s), limit)
                dense = [tuple(make_weight(jax.random.fold_in(key, 900 + 2 * j + i), "bf16", (n, k)) for i in range(2))
                         for j in range(copies)]
                base_fn = lambda x, w: clamped_swiglu(jnp.dot(x, w[0].T, preferred_element_type=jnp.float32),
                                                      jnp.dot(x, w[1].T, preferred_element_type=jnp.float32), limit)
                per_weight = weight_bytes(w1)
            x = jax.random.normal(jax.random.fold_in(key, 7000 + m), (rows, k), jnp.float32).astype(jnp.bfloat16)
            xb = x[:touched] if routed else x
            base = time_calls(base_fn, dense, xb, 20, repeats=3)
            base_k = profiled_kernel_us(base_fn, xb, dense)
            emit(dict(name="gate_up_" + ("routed" if routed else "shared"), m=m, rows=rows, n=n, k=k, fmt="bf16",
                      impl="xla_bf16_dots", us=base[0], kernel_us=base_k, gbps=2 * touched * n * k * 2 / base[0] / 1e3))
            del dense
            ref = jax.jit(two)(x, sets[0])
            cases = [("two_launches", ROUTED if routed else ffi.default_schedule(1, n, k), two)] + [
                ("pair", s, functools.partial(one, s=s)) for s in ((411, 811) if routed else (811, 411, 11))]
            for impl, sched, fn in cases:
                try:
                    err = rel_err(jax.jit(fn)(x, sets[0]), ref)
                    if err > 1e-5:
                        raise RuntimeError(f"pair differs from two launches: rel. err {err:.3g}")
                    t = time_calls(fn, sets, x, 20, repeats=3)
                    kt = profiled_kernel_us(fn, x, sets)
                except Exception as e:  # noqa: BLE001
                    emit(dict(name="gate_up", m=m, fmt=fmt, impl=impl, schedule=sched,
                              error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                emit(dict(name="gate_up_" + ("routed" if routed else "shared"), m=m, rows=rows, n=n, k=k, fmt=fmt,
                          impl=impl, schedule=sched, us=t[0], kernel_us=kt, rel_err=err,
                          gbps=(2 * per_weight + x.size * 2) / t[0] / 1e3, speedup_vs_bf16=base[0] / t[0],
                          kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None))
        del w1, w3, sets


# Schedules compiled for the slotted routed calls (gemv_kernel.cuh, compiled_for): a pair (gate + up) runs
# PAIR_SCHEDULES, one FP4 weight (down) those below, the staged ones (P = 4) included.
SLOTTED_PAIR_SCHEDULES = (811, 411, 11)
SLOTTED_SINGLE_SCHEDULES = (811, 411, 11, 814, 43811, 83411, 4011, 24011, 4811, 24811)
SLOTTED_GEOMETRY = dict(experts=256, top_k=6, inter=2048, hidden=4096)      # DeepSeek-V4-Flash's routed experts


def run_slotted(args, key, emit, t0):
    """The routed experts of a decode step of B tokens as matmul_kernels.routed_gemv runs them from 22 tokens on:
    B x 6 rows (each token 6 distinct experts of 256, uniform) grouped by expert into slots of up to 8 rows
    (moe.moe_schedule), the rows gathered into [slots, 8, K], one ffi.grouped_gemv launch per projection (gate + up
    as a pair [256, 2 x 2048, 4096], down [256, 4096, 2048]) and each row's output taken back: routed_gemv itself,
    at its default schedule and with its grouped_gemv pinned to each other compiled schedule.
    GB/s: the bytes of the experts the step touches, each read once, over the wall time per call; the expert sets
    rotate between calls so that no call finds another's experts in L2. Each case is checked first against XLA's
    float32 einsum of the first 48 rows with their dequantized experts."""
    from dsv4_jax.ops.matmul_kernels import MAX_MOE_ROWS, routed_gemv
    n_exp, top_k, inter, hidden = (SLOTTED_GEOMETRY[k] for k in ("experts", "top_k", "inter", "hidden"))
    copies, checked = 24, 48
    fmt = args.slotted_format
    w1, w3 = (make_weight(jax.random.fold_in(key, 300 + i), fmt, (n_exp, inter, hidden)) for i in range(2))
    w2 = make_weight(jax.random.fold_in(key, 302), fmt, (n_exp, hidden, inter))
    projections = [("gate_up", (w1, w3), hidden, SLOTTED_PAIR_SCHEDULES),
                   ("down", w2, inter, SLOTTED_SINGLE_SCHEDULES)]

    def pinned(s):       # ffi.grouped_gemv at schedule s, whichever schedule routed_gemv asks for
        return lambda x3, w, experts, out_dtype, *, schedule: ffi.grouped_gemv(x3, w, experts, out_dtype, schedule=s)

    for batch in [int(v) for v in args.slotted_only.split(",")]:
        ids = routed_expert_ids(batch, batch, n_exp, top_k)
        rows, touched = len(ids), len(set(ids.tolist()))
        if rows <= MAX_MOE_ROWS:
            raise SystemExit(f"--slotted-only: batch {batch} has {rows} routed rows; routed_gemv groups rows by "
                             f"expert only beyond {MAX_MOE_ROWS} (from {MAX_MOE_ROWS // top_k + 1} tokens)")
        id_sets = [jnp.asarray((ids + 7 * j) % n_exp, jnp.int32) for j in range(copies)]
        for name, weights, k, swept in projections:
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                return
            x = jax.random.normal(jax.random.fold_in(key, 9000 + batch), (rows, k), jnp.float32).astype(jnp.bfloat16)
            stacked = weights if isinstance(weights, tuple) else (weights,)
            dequantized = [jax.tree_util.tree_map(lambda a: a[id_sets[0][:checked]], w).dequantize(jnp.float32)
                           for w in stacked]
            ref = jnp.concatenate([jnp.einsum("rk,rnk->rn", x[:checked].astype(jnp.float32), d)
                                   for d in dequantized], -1)
            del dequantized
            wb = touched * sum(weight_bytes(jax.tree_util.tree_map(lambda a: a[0], w)) for w in stacked)
            operands = [(weights, i) for i in id_sets]
            cases = [("routed_gemv", ffi.routed_schedule(weights), lambda x, wi: routed_gemv(x, wi[0], wi[1]))] + [
                ("slotted", s, lambda x, wi, s=s: routed_gemv(x, wi[0], wi[1], grouped_gemv=pinned(s)))
                for s in swept]
            for impl, sched, fn in cases:
                try:
                    err = rel_err(jax.jit(fn)(x, operands[0])[:checked], ref)
                    if err > 1e-4:
                        raise RuntimeError(f"wrong result: rel. err {err:.3g}")
                    t = time_calls(fn, operands, x, 20, repeats=3)
                    kt = profiled_kernel_us(fn, x, operands)
                except Exception as e:  # noqa: BLE001
                    emit(dict(name=f"slotted_{name}", m=batch, fmt=fmt, impl=impl, schedule=sched,
                              error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                emit(dict(name=f"slotted_{name}", m=batch, rows=rows, experts=touched, n=ref.shape[-1], k=k,
                          fmt=fmt, impl=impl, schedule=sched, us=t[0], kernel_us=kt, rel_err=err,
                          gbps=wb / t[0] / 1e3, kernel_gbps=wb / kt / 1e3 if kt else None))


DENSE_SHAPES = ("wq_b", "wo_b", "wo_a", "shared_w1", "shared_w2", "wq_a", "wkv")
# Pallas FP8 GEMV variants (label, fp8_matmul keywords) beside its default tiling and the one before it: _k1, no
# split of K (whose float32 partials at 64 rows and K = 1024 are half the weight's bytes, but a small N then leaves
# SMs idle); 256-row tiles; the rows' f16 prescale made once before the launch (gemv.f16_rows, a launch of its own
# per distinct activation: 226 launches against 198 in a 4-layer Flash decode step at batch 64, compiled for an H200
# with it for every FP8 matmul of 32-64 rows). On one H100 (2026-12-07) only wq_b gained from the prescale (with _k1).
DENSE_VARIANTS = [("pallas_bn128_w8_k1", dict(block_n=128, num_warps=8, split_k=1)),
                  ("pallas_bn128_w8_row_prescale", dict(block_n=128, num_warps=8, row_prescale=True)),
                  ("pallas_bn128_w8_row_prescale_k1", dict(block_n=128, num_warps=8, row_prescale=True, split_k=1)),
                  ("pallas_bn256_w8_row_prescale_k1", dict(block_n=256, num_warps=8, row_prescale=True, split_k=1)),
                  ("pallas_bn256_w4_row_prescale", dict(block_n=256, num_warps=4, row_prescale=True))]


def before_tiling(x, w):
    """gemv.fp8_matmul on the tiling that was its default at every row count until 2026-12-07: _default_block_n's
    weight rows per tile, 4 warps."""
    cols = gemv.activation_tiling(x.shape[0])[0]
    return gemv.fp8_matmul(x, w, jnp.float32, block_n=gemv._default_block_n(w.weight.shape[0], cols), num_warps=4)


def run_dense(args, key, emit, t0):
    """The model's dense FP8 projections at the rows of a serving decode step: the Pallas GEMV (gemv.fp8_matmul,
    the default at 9-256 rows) at its default tiling and at DENSE_VARIANTS. GB/s: the weight's bytes (read once)
    over the wall time per call, the copies rotating past L2; kernel time: every kernel of the call (the prescale
    fusion and split-K sum included); each case checked against the float32 reference first (a variant a shape
    refuses is recorded with its error)."""
    ms = [int(v) for v in args.dense_only.split(",")]
    if any(not ffi.MAX_ROWS < m <= gemv.MAX_ROWS for m in ms):
        raise SystemExit(f"--dense-only: rows must be {ffi.MAX_ROWS + 1}..{gemv.MAX_ROWS}, got {ms}")

    cases = [("pallas", lambda x, w: gemv.fp8_matmul(x, w, jnp.float32)),
             ("pallas_before", before_tiling)]                # the default at 32-64 rows until 2026-12-07
    cases += [(label, functools.partial(gemv.fp8_matmul, out_dtype=jnp.float32, **kw)) for label, kw in DENSE_VARIANTS]
    for name, n, k in [s for s in SHAPES if s[0] in DENSE_SHAPES]:
        c = min(MAX_COPIES, max(2, math.ceil(ROTATE_BYTES / nbytes(jax.eval_shape(lambda: make_weight(key, "fp8",
                                                                                                         (n, k)))))))
        ws = [make_weight(jax.random.fold_in(key, i), "fp8", (n, k)) for i in range(c)]
        wb = weight_bytes(ws[0])
        for m in ms:
            if time.time() - t0 > args.budget_s:
                print("budget reached", flush=True)
                return
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = jax.jit(lambda x, w: linear(x.astype(jnp.float32), w, jnp.float32, ctx=REFERENCE))(x, ws[0])
            reps = max(2, int(2000 / (len(ws) * max(1, n * k // (1 << 24)))))
            for impl, fn in cases:
                try:
                    err = rel_err(jax.jit(fn)(x, ws[0]), ref)
                    if err > 1e-4:
                        raise RuntimeError(f"wrong result: rel. err {err:.3g}")
                    t = time_calls(fn, ws, x, reps, repeats=3)
                    kt = profiled_kernel_us(fn, x, ws)
                except Exception as e:  # noqa: BLE001
                    emit(dict(name=name, m=m, fmt="fp8", impl=impl, error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                emit(dict(name=name, m=m, n=n, k=k, fmt="fp8", impl=impl, us=t[0], kernel_us=kt, rel_err=err,
                          gbps=wb / t[0] / 1e3, kernel_gbps=wb / kt / 1e3 if kt else None))
        del ws


def run_concat(args, key, emit, t0):
    """The attention's wq_a [1024, 4096] and wkv [512, 4096] (FP8-block; both read the same activations) as the
    model runs them at decode: two ffi.gemv launches or one ffi.gemv_concat, against XLA's two bf16 dots."""
    k, shapes, copies = 4096, (1024, 512), 16             # 6 MB of FP8 per copy: 96 MB rotate past L2
    fp8 = [tuple(make_weight(jax.random.fold_in(key, 500 + 2 * j + i), "fp8", (n, k)) for i, n in enumerate(shapes))
           for j in range(copies)]
    bf16 = [tuple(make_weight(jax.random.fold_in(key, 600 + 2 * j + i), "bf16", (n, k)) for i, n in enumerate(shapes))
            for j in range(copies // 2)]
    base_fn = lambda x, w: (x @ w[0].T)[..., :1].astype(jnp.float32) + (x @ w[1].T)[..., :1].astype(jnp.float32)
    two = lambda x, w: jnp.concatenate([ffi.gemv(x, w[0], jnp.float32), ffi.gemv(x, w[1], jnp.float32)], -1)
    one = lambda x, w: ffi.gemv_concat(x, w, jnp.float32)
    fp8_bytes = sum(weight_bytes(w) for w in fp8[0])
    for m in [int(v) for v in args.ms.split(",")]:
        if time.time() - t0 > args.budget_s:
            return
        x = jax.random.normal(jax.random.fold_in(key, 8000 + m), (m, k), jnp.float32).astype(jnp.bfloat16)
        base = time_calls(base_fn, bf16, x, 50, repeats=3)
        base_k = profiled_kernel_us(base_fn, x, bf16)
        emit(dict(name="wq_a+wkv", m=m, n=sum(shapes), k=k, fmt="bf16", impl="xla_bf16_dots", us=base[0],
                  kernel_us=base_k, gbps=sum(shapes) * k * 2 / base[0] / 1e3))
        ref = jax.jit(two)(x, fp8[0])
        # each launch's own output feeds the result (a slice of a concatenation could let XLA drop one launch)
        cases = [("two_launches", [ffi.default_schedule(1, n, k) for n in shapes],
                  lambda x, w: ffi.gemv(x, w[0], jnp.float32)[..., :1] + ffi.gemv(x, w[1], jnp.float32)[..., :1]),
                 ("concat", ffi.default_schedule(1, sum(shapes), k), lambda x, w: one(x, w)[..., :1])]
        for impl, sched, fn in cases:
            try:
                err = rel_err(jax.jit(one)(x, fp8[0]), ref) if impl == "concat" else 0.0
                if err > 1e-6:
                    raise RuntimeError(f"concat differs from two launches: rel. err {err:.3g}")
                t = time_calls(fn, fp8, x, 50, repeats=3)
                kt = profiled_kernel_us(fn, x, fp8)
            except Exception as e:  # noqa: BLE001
                emit(dict(name="wq_a+wkv", m=m, fmt="fp8", impl=impl, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            emit(dict(name="wq_a+wkv", m=m, n=sum(shapes), k=k, fmt="fp8", impl=impl, schedule=str(sched), us=t[0],
                      kernel_us=kt, rel_err=err, gbps=(fp8_bytes + m * k * 2) / t[0] / 1e3,
                      speedup_vs_bf16=base[0] / t[0], kernel_speedup_vs_bf16=base_k / kt if kt and base_k else None))


def _bf16_expert_dots(x, w):
    return jnp.einsum("ek,enk->en", x, w, preferred_element_type=jnp.float32)


def _swiglu_halves(y, limit):
    half = y.shape[-1] // 2
    return clamped_swiglu(y[..., :half], y[..., half:], limit)


def summary(results):
    print("\n| case | M | fmt | impl | schedule | us | kernel us | GB/s | x bf16 (wall) | x bf16 (kernel) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in results:
        if "us" in r:
            print(f"| {r['name']} | {r['m']} | {r['fmt']} | {r['impl']} | {r.get('schedule', '')} | {r['us']:.1f} | "
                  f"{r.get('kernel_us') or nan:.1f} | {r['gbps']:.0f} | {r.get('speedup_vs_bf16') or nan:.2f} | "
                  f"{r.get('kernel_speedup_vs_bf16') or nan:.2f} |")


if __name__ == "__main__":
    main()
