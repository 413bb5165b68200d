#!/usr/bin/env bash
# A change on the GPU against the code before it (run on the H200 from the repo root): the gpu-marked tests of TESTS
# (pytest arguments; default the mHC kernels' tests), then the 4-layer Flash-geometry model benchmark at BATCHES
# (default 1, 8, 32) and 4K context (CONTEXTS) from this tree and, in the same call, from the tree at BASELINE_DIR
# (a checkout of the commit before the change; skipped when unset), so both sides run on one machine in one
# run. NEW_ARGS (benchmark options, e.g. "--kernel-override attention_core=kernel") and NEW_ENV (environment
# assignments) apply to this tree's side only, so an opt-in switch is compared with BASELINE_DIR=. (this tree
# without it). COMMON_ARGS (e.g. "--act-quant fp8") apply to both sides. Results: $OUT (or ./out)/pytest_ab.log,
# flash4_new.{json,log}, flash4_baseline.{json,log}. BENCH_S (default 300) limits each side's benchmark: a process's
# first prefill of a chunk size compiles for ~100 s on an H100 (2026-12-07), so with PROMPTS each side needs ~300 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
# each test named as it starts (-v), a stuck one's stacks dumped after TEST_STACK_S: a log cut by TEST_S says where
PYTHONPATH=. timeout "${TEST_S:-300}" python3 -m pytest -m gpu -v -p no:cacheprovider \
    -o faulthandler_timeout="${TEST_STACK_S:-200}" ${TESTS:-tests/test_pallas_mhc.py} 2>&1 | tee "$OUT_DIR/pytest_ab.log" \
    || status=1
bench() {   # tree, name, environment assignments, benchmark options
    (cd "$1" && env ${3:-} PYTHONPATH=. timeout "${BENCH_S:-300}" python3 -m dsv4_jax.bench --preset flash --layers 4 \
        ${COMMON_ARGS:-} ${4:-} --reference none --batches "${BATCHES:-1,8,32}" --contexts "${CONTEXTS:-4096}" --prompts "${PROMPTS:-1024}" \
        --out "$OUT_DIR/$2.json") 2>&1 | grep -v "Warning\|warn(" | tee "$OUT_DIR/$2.log" || status=1
}
bench . flash4_new "${NEW_ENV:-}" "${NEW_ARGS:-}"
if [ -n "${BASELINE_DIR:-}" ]; then bench "$BASELINE_DIR" flash4_baseline; fi
exit $status
