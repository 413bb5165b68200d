"""Hardware counters of the kernels whose limits docs/kernels.md discusses, read by Nsight Compute: each case
is compiled and warmed up first, then run once between cuProfilerStart / cuProfilerStop, so ncu (started with
--profile-from-start off) profiles exactly that case's kernels.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
        python3 benchmarks/ncu_kernels.py [--cases ...] > $OUT/ncu.txt

(Without XLA_PYTHON_CLIENT_PREALLOCATE=false ncu saves and restores JAX's preallocated pool, most of the GPU's
memory, around every replay pass: minutes per kernel. Seen once: a `timeout` that stopped ncu left this script
running and holding the GPU's memory, so the next GPU command failed; end it before going on, without matching
your own shell's command line.)

Cases (--cases, comma-separated; default all):
  nvfp4_quantize   the fused NVFP4 activation quantize (Pallas), bf16 [8192, 4096] (64 MiB): 53-54% of bandwidth
  fp8_quantize     the FP8 activation quantize, same input: 84% (the comparison)
  xla_bf16_gemv    XLA's bf16 dot, lm_head 129280 x 4096, M = 1 (the yardstick of the decode targets)
  mxfp4_gemv       ffi.gemv MXFP4 lm_head M = 1, schedule 811 (checkpoint layout), and M = 8
  mxfp4_gemv_layout  the same in the GEMV layout, M = 1
  probe_loads      the 811 skeleton's loads alone (probe 1: weights + scales), lm_head M = 1
  probe_decode     its decode + MMAs alone (probe 3), lm_head M = 1
  fp8_gemv         ffi.gemv FP8-block 18432 x 7168, M = 1 (1.34-1.6x where lm_head reaches 1.72-1.79x)
  prefill_fp8      linear, act_quant="fp8", on FP8-block 2048 x 4096, M = 4096: quantize, operand, FP8 wgmma kernel
  prefill_mxfp4    the same on MXFP4 2048 x 4096 (operand: e4m3 + per-row scales): 52% of XLA's FP8 rate
  moe_prefill      grouped_linear of 24576 routed rows (4096 tokens x 6) on 256 MXFP4 experts 2048 x 4096
  moe_prefill_fp8  the same with FP8 activations: quantize, slot gathers, the W4A8 kernel (pallas_kernels/moe_fp8.py)
  decode_attention the decode attention kernel of one CSA and one HCA layer at Flash geometry, batch 1, with 1, 4
                   and 16 splits (benchmarks/bench_decode_attention.py's inputs and XLA's path beside it)
Each case prints its name first (stdout, before ncu's report of its kernels).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4_jax import ffi  # noqa: E402
from dsv4_jax.ops import grouped_linear, linear  # noqa: E402
from dsv4_jax.pallas_kernels.quantize import quantize_fp8_kernel, quantize_nvfp4_kernel  # noqa: E402
from benchmarks.bench_kernels import AUTO, make_weight  # noqa: E402
from dsv4_jax.run_context import RunContext  # noqa: E402
from benchmarks.probe_gemv import PROBE_SOURCE, probe_call  # noqa: E402

CASES = ("nvfp4_quantize", "fp8_quantize", "xla_bf16_gemv", "mxfp4_gemv", "mxfp4_gemv_layout", "probe_loads",
         "probe_decode", "fp8_gemv", "prefill_fp8", "prefill_mxfp4", "moe_prefill", "moe_prefill_fp8",
         "decode_attention")
LM_HEAD = (129280, 4096)


def _driver():
    """cuProfilerStart / cuProfilerStop of the CUDA driver JAX uses (ncu --profile-from-start off obeys them)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    return cuda.cuProfilerStart, cuda.cuProfilerStop


def profile(name: str, fn, *args) -> None:
    """fn(*args) jitted, warmed up, then once inside a profiler range."""
    start, stop = _driver()
    jfn = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(jfn(*args))
    print(f"=== case {name}", flush=True)
    start()
    jax.block_until_ready(jfn(*args))
    stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    key = jax.random.key(0)
    x_act = jax.random.normal(key, (8192, 4096), jnp.float32).astype(jnp.bfloat16)
    if "nvfp4_quantize" in cases:
        profile("nvfp4_quantize", quantize_nvfp4_kernel, x_act)
    if "fp8_quantize" in cases:
        profile("fp8_quantize", quantize_fp8_kernel, x_act)
    n, k = LM_HEAD
    x1 = jax.random.normal(jax.random.fold_in(key, 1), (1, k), jnp.float32).astype(jnp.bfloat16)
    x8 = jax.random.normal(jax.random.fold_in(key, 8), (8, k), jnp.float32).astype(jnp.bfloat16)
    if "xla_bf16_gemv" in cases:
        profile("xla_bf16_gemv", lambda x, w: x @ w.T, x1, make_weight(key, "bf16", LM_HEAD))
    w = make_weight(jax.random.fold_in(key, 2), "mxfp4", LM_HEAD)
    if "mxfp4_gemv" in cases:
        profile("mxfp4_gemv M=1", lambda x, w: ffi.gemv(x, w, schedule=811), x1, w)
        profile("mxfp4_gemv M=8", lambda x, w: ffi.gemv(x, w, schedule=811), x8, w)
    if "mxfp4_gemv_layout" in cases:
        profile("mxfp4_gemv_layout M=1", lambda x, w: ffi.gemv(x, w, schedule=811), x1, jax.jit(ffi.to_gemv_layout)(w))
    if "probe_loads" in cases or "probe_decode" in cases:
        ffi.register(PROBE_SOURCE, {"dsv4_probe_gemv": "DSV4ProbeGemv"})
    if "probe_loads" in cases:
        profile("probe_loads M=1", lambda x, w: probe_call(x, w, 1, 811), x1, w)
    if "probe_decode" in cases:
        profile("probe_decode M=1", lambda x, w: probe_call(x, w, 3, 811), x1, w)
    del w
    if "fp8_gemv" in cases:
        x = jax.random.normal(jax.random.fold_in(key, 3), (1, 7168), jnp.float32).astype(jnp.bfloat16)
        profile("fp8_gemv 18432x7168 M=1", lambda x, w: ffi.gemv(x, w), x,
                make_weight(jax.random.fold_in(key, 4), "fp8", (18432, 7168)))
    x_pre = jax.random.normal(jax.random.fold_in(key, 5), (4096, 4096), jnp.float32).astype(jnp.bfloat16)
    for fmt in ("fp8", "mxfp4"):
        if f"prefill_{fmt}" in cases:
            profile(f"prefill_{fmt} 2048x4096 M=4096",
                    lambda x, w: linear(x, w, jnp.float32, ctx=AUTO.replace(act_quant="fp8")), x_pre,
                    make_weight(jax.random.fold_in(key, 6), fmt, (2048, 4096)))
    if "moe_prefill" in cases:
        n_exp, rows = 256, 24576                                  # 4096 tokens x 6 experts, rows sorted by expert
        ids = jax.random.randint(jax.random.fold_in(key, 7), (rows,), 0, n_exp)
        sizes = jnp.bincount(ids, length=n_exp).astype(jnp.int32)
        xs = jax.random.normal(jax.random.fold_in(key, 8), (rows, 4096), jnp.float32).astype(jnp.bfloat16)
        profile("moe_prefill 24576 rows", lambda x, w, s: grouped_linear(x, w, s, jnp.float32, ctx=AUTO), xs,
                make_weight(jax.random.fold_in(key, 9), "mxfp4", (n_exp, 2048, 4096)), sizes)

    if "moe_prefill_fp8" in cases:
        n_exp, rows = 256, 24576
        ids = jax.random.randint(jax.random.fold_in(key, 7), (rows,), 0, n_exp)
        sizes = jnp.bincount(ids, length=n_exp).astype(jnp.int32)
        xs = jax.random.normal(jax.random.fold_in(key, 8), (rows, 4096), jnp.float32).astype(jnp.bfloat16)
        fp8 = RunContext.create(act_quant="fp8", kernel_overrides=["matmul=kernel"])     # W4A8 is opt-in
        profile("moe_prefill_fp8 24576 rows", lambda x, w, s: grouped_linear(x, w, s, jnp.float32, ctx=fp8), xs,
                make_weight(jax.random.fold_in(key, 9), "mxfp4", (n_exp, 2048, 4096)), sizes)

    if "decode_attention" in cases:
        _decode_attention()


def _decode_attention():
    """The decode attention kernel at 1, 4 and 16 splits and XLA's path, for one CSA and one HCA layer."""
    from dsv4_jax.pallas_kernels import decode_attention as da
    from benchmarks.bench_decode_attention import inputs, kernel_path, xla_path

    default_splits = da.MAX_SPLITS
    for ratio in (4, 128):
        x = inputs(ratio)
        args = (x["q"], x["ring"], x["kv"], x["start"], x["sink"], x["compressed"], x["picks"])
        profile(f"decode_attention ratio {ratio} xla", functools.partial(xla_path, ratio=ratio), *args)
        for splits in (1, 4, 16):
            da.MAX_SPLITS = splits
            profile(f"decode_attention ratio {ratio} splits {splits}",
                    functools.partial(kernel_path, ratio=ratio), *args)
        da.MAX_SPLITS = default_splits


if __name__ == "__main__":
    main()
