#!/usr/bin/env bash
# The server on one GPU under load (run on the GPU machine from the repo root; results in $OUT, or ./out):
# `python -m dsv4_jax.serve --random-weights flash:LAYERS` (DeepSeek-V4-Flash's first LAYERS layers, default 4, random
# weights in the stored formats) with MAX_BATCH rows (default 128), then scripts/load_test.py at CLIENTS concurrent
# streams (default 1,1,8,32,64,128) with PROMPT_TOKENS-token prompts (default 1024) and MAX_TOKENS new tokens (default
# 256), SECONDS_EACH per client count (default 40). SERVE_ARGS: more server options (e.g. "--admit-batch 8").
# LONG_TOKENS: client 0 sends prompts of that many tokens instead, counted apart (e.g. LONG_TOKENS=32768
# MAX_SEQ_LEN=34816 SERVE_ARGS="--prefill-step 4096": a long prompt's pause of the other streams, in steps).
# The server starts with --no-warmup unless WARMUP=1: on a fresh H100 its full warm-up (12 prefill programs) did not
# finish within 500 s (2026-12-07), so the first client round (CLIENTS default starts 1,1) meets the compiles instead
# and is left out of the write-up. The server needs fastapi and uvicorn, and the load test httpx; where the GPU
# machine lacks them and cannot reach an index, put their wheels in .serve_wheels (git-ignored) before the call,
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .serve_wheels \
#       fastapi uvicorn httpx
# and pass it along (carry); they are installed into /tmp/serve_deps.
#                                                                     -> serve.log, load_flash<LAYERS>.{json,log}
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
layers="${LAYERS:-4}"
if ! python3 -c "import fastapi, uvicorn, httpx" 2>/dev/null; then
    [ -d .serve_wheels ] || { echo "fastapi / uvicorn / httpx missing and no .serve_wheels to install them from" >&2; exit 1; }
    python3 -m pip install -q --no-index --find-links .serve_wheels --target /tmp/serve_deps fastapi uvicorn httpx \
        || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/serve_deps"
fi
warmup_args="--no-warmup"
[ "${WARMUP:-0}" = 1 ] && warmup_args=""
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -m dsv4_jax.serve --random-weights "flash:$layers" --port 8000 --max-batch "${MAX_BATCH:-128}" \
    --max-seq-len "${MAX_SEQ_LEN:-2048}" --chunk "${CHUNK:-8}" $warmup_args ${SERVE_ARGS:-} > "$OUT_DIR/serve.log" 2>&1 &
server=$!
for _ in $(seq 600); do
    grep -q "ready on" "$OUT_DIR/serve.log" && break
    kill -0 "$server" 2>/dev/null || { echo "the server exited:"; tail -20 "$OUT_DIR/serve.log"; exit 1; }
    sleep 1
done
grep "ready on" "$OUT_DIR/serve.log" || { echo "no readiness line"; kill "$server"; exit 1; }
python3 scripts/load_test.py --url http://127.0.0.1:8000/v1 --clients "${CLIENTS:-1,1,8,32,64,128}" \
    --prompt-tokens "${PROMPT_TOKENS:-1024}" --long-prompt-tokens "${LONG_TOKENS:-0}" \
    --max-tokens "${MAX_TOKENS:-256}" --seconds "${SECONDS_EACH:-40}" \
    --out "$OUT_DIR/load_flash$layers.json" 2>&1 | tee "$OUT_DIR/load_flash$layers.log"
status=$?
kill -INT "$server"; wait "$server"
exit $status
