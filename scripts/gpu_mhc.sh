#!/usr/bin/env bash
# The mHC site kernels on the GPU (run on the H200 from the repo root): their gpu-marked tests (and EXTRA_TESTS,
# pytest arguments), then the 4-layer
# Flash-geometry model benchmark at batch 1, 8, 32 (4K context) with them and, in the same call, from the tree at
# BASELINE_DIR (a checkout of the commit before them; skipped when unset), so both sides run on one machine in one
# session. Results: $OUT (or ./out)/pytest_mhc.log, flash4_mhc.{json,log}, flash4_baseline.{json,log}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
PYTHONPATH=. timeout "${TEST_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_pallas_mhc.py \
    ${EXTRA_TESTS:-} 2>&1 \
    | tee "$OUT_DIR/pytest_mhc.log" || status=1
bench() {   # tree, name
    (cd "$1" && PYTHONPATH=. timeout "${BENCH_S:-200}" python3 -m dsv4_jax.bench --preset flash --layers 4 \
        --reference none --batches "${BATCHES:-1,8,32}" --contexts 4096 --prompts "${PROMPTS:-1024}" \
        --out "$OUT_DIR/$2.json") 2>&1 | grep -v "Warning\|warn(" | tee "$OUT_DIR/$2.log" || status=1
}
bench . flash4_mhc
if [ -n "${BASELINE_DIR:-}" ]; then bench "$BASELINE_DIR" flash4_baseline; fi
exit $status
