"""Hardware counters of the kernels whose limits docs/performance.md discusses, read by Nsight Compute: each case
is compiled and warmed up first, then run once between cuProfilerStart / cuProfilerStop, so ncu (started with
--profile-from-start off) profiles exactly that case's kernels.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
        python3 scripts/ncu_kernels.py [--cases ...] > $OUT/ncu.txt

Cases (--cases, comma-separated; default all):
  nvfp4_quantize   the fused NVFP4 activation quantize (Pallas), bf16 [8192, 4096] (64 MiB): 53-54% of bandwidth
  fp8_quantize     the FP8 activation quantize, same input: 84% (the comparison)
  xla_bf16_gemv    XLA's bf16 dot, lm_head 129280 x 4096, M = 1 (the yardstick of the decode targets)
  mxfp4_gemv       ffi.gemv MXFP4 lm_head M = 1, schedule 811 (checkpoint layout), and M = 8
  mxfp4_gemv_layout  the same in the GEMV layout, M = 1
  probe_loads      the 811 skeleton's loads alone (probe 1: weights + scales), lm_head M = 1
  probe_decode     its decode + MMAs alone (probe 3), lm_head M = 1
Each case prints its name first (stdout, before ncu's report of its kernels).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ffi  # noqa: E402
from pallas_kernels.quantize import quantize_fp8_kernel, quantize_nvfp4_kernel  # noqa: E402
from scripts.bench_kernels import make_weight  # noqa: E402
from scripts.probe_gemv import probe_call  # noqa: E402

CASES = ("nvfp4_quantize", "fp8_quantize", "xla_bf16_gemv", "mxfp4_gemv", "mxfp4_gemv_layout", "probe_loads",
         "probe_decode")
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
        ffi.register("probe_gemv.cu", {"dsv4_probe_gemv": "DSV4ProbeGemv"})
    if "probe_loads" in cases:
        profile("probe_loads M=1", lambda x, w: probe_call(x, w, 1, 811), x1, w)
    if "probe_decode" in cases:
        profile("probe_decode M=1", lambda x, w: probe_call(x, w, 3, 811), x1, w)


if __name__ == "__main__":
    main()
