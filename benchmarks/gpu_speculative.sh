#!/usr/bin/env bash
# Speculative decoding on the GPU (run on the H200 from the repo root): the cost of a speculative step (k MTP drafts,
# a (k+1)-token verify, the commit) against a plain decode step on Flash geometry (4 layers, random weights: few
# drafts accepted, so the ratio is the acceptance a step needs to break even), then the packaged default model's
# acceptance and ms per token against plain decoding. Results: $OUT (or ./out)/flash4_speculative.{json,log},
# default_speculative.{json,log}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
timeout "${BENCH_S:-330}" python3 -m dsv4_jax.bench --preset flash --layers 4 --reference none --batches 1 \
    --contexts 4096 --prompts none --speculative-tokens 1,2,3 --out "$OUT_DIR/flash4_speculative.json" 2>&1 \
    | grep -v "Warning\|warn(" | tee "$OUT_DIR/flash4_speculative.log" || status=1
timeout "${DEFAULT_S:-200}" python3 benchmarks/speculative_speed.py --ks "${KS:-2}" --max-new-tokens 128 --repeats 1 \
    --out "$OUT_DIR/default_speculative.json" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$OUT_DIR/default_speculative.log" || status=1
exit $status
