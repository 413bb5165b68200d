#!/usr/bin/env bash
# GPU checks in one go (run on the H200 from the repo root): the `gpu`-marked tests, then the kernel benchmarks.
# Results: $OUT (or ./out) /pytest_gpu.log, bench_kernels.json/.log, bench_ffi.json/.log, bench_gate_up.json/.log,
# bench_concat.json/.log, probe_gemv.json/.log, bench_quantize.json/.log, probe_moe_tilings.log (a tiling Triton
# once compiled wrongly).
# Usage: bash benchmarks/gpu_check.sh [extra args for bench_kernels.py, e.g. --quick or --budget-s 240]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT_DIR/pytest_gpu.log" || status=1
python3 benchmarks/bench_kernels.py --out "$OUT_DIR/bench_kernels.json" "$@" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/bench_kernels.log" || status=1
python3 benchmarks/bench_ffi.py --out "$OUT_DIR/bench_ffi.json" --experts 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/bench_ffi.log" || status=1
python3 benchmarks/bench_ffi.py --gate-up-only --out "$OUT_DIR/bench_gate_up.json" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/bench_gate_up.log" || status=1
python3 benchmarks/bench_ffi.py --concat-only --out "$OUT_DIR/bench_concat.json" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/bench_concat.log" || status=1
python3 benchmarks/probe_gemv.py --out "$OUT_DIR/probe_gemv.json" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/probe_gemv.log" || status=1
python3 benchmarks/probe_moe_tilings.py 2>&1 | grep -v "Warning\|warn(\|return rule" \
    | tee "$OUT_DIR/probe_moe_tilings.log" \
    || status=1
if [ -f benchmarks/bench_quantize.py ]; then
    python3 benchmarks/bench_quantize.py --out "$OUT_DIR/bench_quantize.json" 2>&1 | tee "$OUT_DIR/bench_quantize.log" \
        || status=1
fi
exit $status
