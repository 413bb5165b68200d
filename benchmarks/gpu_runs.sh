#!/usr/bin/env bash
# The one-H200 runs of docs/performance.md, in parts that each fit one device call of 10 minutes (run on the
# H200 from the repo root; results in $OUT, or ./out):
#   suite1   the gpu-marked tests of test_ffi.py, test_fp4_layout.py, test_gemv_slots.py, test_head_linear.py
#                                                                     -> pytest_gpu_part1.log
#   suite2   those of test_kernel_dispatch.py, test_pallas_mhc.py, test_pallas_sinkhorn.py, test_pallas_decode_attention.py,
#            test_layer_stats.py                                              -> pytest_gpu_part2.log
#   suite3   those of test_pallas_quantize.py and test_pallas_gemv.py         -> pytest_gpu_part3.log
#            (all but test_pallas_gemv.py took more than 540 s in one part, 2026-12-03)
#   suite4   those of test_pallas_indexer.py, test_pallas_norm_rope.py, test_pallas_compressor.py,
#            test_pallas_moe_decode.py                                         -> pytest_gpu_part4.log
#   depth    Flash geometry, LAYERS (default 32) layers under scan_layers=True (SCAN=0: unrolled), BATCHES
#            (default 1, 8) at 4K context and PROMPTS (default none), as deep as one H200 holds
#                                                        -> flash<LAYERS>_scan.{json,log} (SCAN=0: _unrolled)
#            (benchmarks/marginal_cost.py turns it and a 4-layer run of the same cases into a cost per layer; a
#            scanned prefill copies each layer's expert weights per chunk, docs/performance.md "Depth")
#   matrix   Flash geometry, 4 layers: decode at BATCHES (default 1, 8, 32, 64, 128, 256) x CONTEXTS (default 4K),
#            prefill PROMPTS (default 8K and 32K), numerics ACT_QUANT (default none), more benchmark options in
#            BENCH_ARGS (e.g. "--temperature 0.6 --top-p 0.95": sampled rows; NAME=sampled names the files)
#                                                                     -> flash4_<NAME, default act_quant>.{json,log}
#   profile  Flash geometry, 4 layers: where a decode step's kernel time goes at PROFILE_BATCHES (default 1, 32,
#            64), and a prefill chunk's (8,192 tokens), by op family (command buffers off, so every kernel carries
#            its HLO op; traces under /tmp)                                  -> flash4_profile.{json,log}
#   prefill8k Flash geometry, 4 layers: an 8,192-token prompt in one 8,192-token chunk, a process per variant
#            (VARIANTS, default the first four): xla (the default), indexer_xla (indexer_scores=reference: XLA's
#            indexer path), fp8 (act_quant fp8), fp8_w4a8 (fp8 and matmul=kernel: the W4A8 kernel); also mhc_xla
#            (mhc_site=reference: the Sinkhorn on XLA's path), attention (attention_core=kernel: the attention
#            core's prefill kernel), topk_xla (indexer_top_k=reference: XLA's top-k for the indexer's picks
#            instead of the threshold select, the default since 2026-12-07)
#                                                                          -> flash4_prefill8k_<variant>.{json,log}
#   kernels  one layer's kernels alone, Flash geometry: the attention core of an 8,192-token prefill chunk (XLA's
#            path against the kernel's prefill schedules, benchmarks/bench_decode_attention.py --prefill) and the
#            routed experts of decode steps of 32-256 tokens in 8-row slots (every compiled ffi/ schedule,
#            benchmarks/bench_ffi.py --slotted-only)       -> prefill_attention.{json,log}, ffi_slotted.{json,log}
#   dense    the dense FP8 projections alone at ROWS (default 32 and 64): the Pallas GEMV (the default) at its
#            default tiling and the variants of bench_ffi.DENSE_VARIANTS (wider weight tiles, the rows' f16 prescale
#            before the launch; benchmarks/bench_ffi.py --dense-only)
#                                                                          -> ffi_dense.{json,log}
#   moeffn   an 8,192-token chunk's routed FFN alone (49,152 routed rows, 256 MXFP4 experts): the default path, the
#            opt-in moe_ffn kernels, and moe_ffn's gate / up kernel at each of MOE_FFN_TILES (weight rows x warps;
#            benchmarks/bench_kernels.py --moe-ffn-rows)                   -> moe_ffn.{json,log}
#   chunks   Flash geometry, 4 layers: PROMPTS (default 8K and 32K) in chunks of each of CHUNKS (default 2048,
#            4096, 8192), a process per chunk size, for the default chunk (docs/performance.md, "Prefill")
#                                                                          -> flash4_chunk<N>.{json,log}
# Usage: bash benchmarks/gpu_runs.sh suite3 depth   (parts run in the order given)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv | tee -a "$OUT_DIR/gpu.txt"
GPU_TEST_FILES_1="tests/test_ffi.py tests/test_fp4_layout.py tests/test_gemv_slots.py tests/test_head_linear.py"
GPU_TEST_FILES_2="tests/test_kernel_dispatch.py tests/test_pallas_mhc.py tests/test_pallas_sinkhorn.py tests/test_pallas_decode_attention.py tests/test_layer_stats.py"
GPU_TEST_FILES_3="tests/test_pallas_quantize.py tests/test_pallas_gemv.py"
GPU_TEST_FILES_4="tests/test_pallas_indexer.py tests/test_pallas_norm_rope.py tests/test_pallas_compressor.py \
tests/test_pallas_moe_decode.py"
quiet() { grep -v "Warning\|warn(\|return rule"; }
# gpu_tests FILES: their gpu-marked tests, each named as it starts (-v) so a log cut by the time limit shows which
# test it stopped in, and its threads' stacks dumped once it has run TEST_STACK_S seconds (default 200)
gpu_tests() {
    timeout "${SUITE_S:-540}" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=15 -rfE \
        -o faulthandler_timeout="${TEST_STACK_S:-200}" "$@"
}
# prefill NAME SECONDS PROMPTS CHUNK [bench options]: a 4-layer Flash prefill run -> flash4_NAME.{json,log}
prefill() {
    local name=$1 seconds=$2 prompts=$3 chunk=$4
    shift 4
    timeout "$seconds" python3 -m dsv4_jax.bench --preset flash --layers 4 --batches 1 --contexts 4096 \
        --prompts "$prompts" --prefill-chunk "$chunk" --prefill-calls 2 --steps 2 --calls 1 --reference none "$@" \
        --out "$OUT_DIR/flash4_$name.json" 2>&1 | quiet | tee "$OUT_DIR/flash4_$name.log" || status=1
}
for part in "$@"; do
    case "$part" in
        suite1) gpu_tests $GPU_TEST_FILES_1 2>&1 | tee "$OUT_DIR/pytest_gpu_part1.log" || status=1 ;;
        suite2) gpu_tests $GPU_TEST_FILES_2 2>&1 | tee "$OUT_DIR/pytest_gpu_part2.log" || status=1 ;;
        suite3) gpu_tests $GPU_TEST_FILES_3 2>&1 | tee "$OUT_DIR/pytest_gpu_part3.log" || status=1 ;;
        suite4) gpu_tests $GPU_TEST_FILES_4 2>&1 | tee "$OUT_DIR/pytest_gpu_part4.log" || status=1 ;;
        depth)  layers="${LAYERS:-32}"
                if [ "${SCAN:-1}" = 0 ]; then scan=""; name="flash${layers}_unrolled"
                else scan="--scan-layers"; name="flash${layers}_scan"; fi
                # The weights take most of the GPU: let XLA's allocator have 95% of it, as for any model this deep.
                XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${BENCH_S:-420}" python3 -m dsv4_jax.bench \
                    --preset flash --layers "$layers" $scan --batches "${BATCHES:-1,8}" --contexts 4096 \
                    --prompts "${PROMPTS:-none}" \
                    --reference none --calls 5 --out "$OUT_DIR/$name.json" 2>&1 | quiet \
                    | tee "$OUT_DIR/$name.log" || status=1 ;;
        matrix) aq="${ACT_QUANT:-none}"; name="${NAME:-$aq}"
                timeout "${BENCH_S:-420}" python3 -m dsv4_jax.bench --preset flash --layers 4 \
                    --batches "${BATCHES:-1,8,32,64,128,256}" --contexts "${CONTEXTS:-4096}" \
                    --prompts "${PROMPTS:-8192,32768}" --act-quant "$aq" --calls 2 --reference none ${BENCH_ARGS:-} \
                    --out "$OUT_DIR/flash4_$name.json" 2>&1 | quiet | tee "$OUT_DIR/flash4_$name.log" || status=1 ;;
        profile) XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "${BENCH_S:-300}" python3 -m dsv4_jax.bench \
                    --preset flash --layers 4 --batches 1 --contexts 4096 --prompts none --reference none --calls 1 \
                    --profile /tmp/trace_decode --profile-batches "${PROFILE_BATCHES:-1,32,64}" \
                    --profile-prefill /tmp/trace_prefill \
                    --prefill-chunk "${PROFILE_CHUNK:-8192}" --out "$OUT_DIR/flash4_profile.json" 2>&1 | quiet \
                    | tee "$OUT_DIR/flash4_profile.log" || status=1 ;;
        prefill8k)
                declare -A variants=([xla]=none: [indexer_xla]=none:indexer_scores=reference [fp8]=fp8:
                                     [fp8_w4a8]=fp8:matmul=kernel [mhc_xla]=none:mhc_site=reference
                                     [attention]=none:attention_core=kernel [topk_xla]=none:indexer_top_k=reference)
                for name in ${VARIANTS:-xla indexer_xla fp8 fp8_w4a8}; do
                    [ -n "${variants[$name]:-}" ] || { echo "unknown prefill8k variant: $name" >&2; exit 2; }
                    IFS=: read -r aq override <<< "${variants[$name]}"
                    prefill "prefill8k_$name" "${BENCH_S:-150}" 8192 8192 --act-quant "$aq" \
                        ${override:+--kernel-override "$override"}
                done ;;
        kernels) timeout "${KERNEL_S:-240}" python3 benchmarks/bench_decode_attention.py --prefill 8192 --warps 8,16 \
                     --out "$OUT_DIR/prefill_attention.json" 2>&1 | quiet | tee "$OUT_DIR/prefill_attention.log" || status=1
                 timeout "${KERNEL_S:-240}" python3 benchmarks/bench_ffi.py --slotted-only 32,64,128,256 \
                     --budget-s $(( ${KERNEL_S:-240} - 60 )) --out "$OUT_DIR/ffi_slotted.json" 2>&1 | quiet \
                     | tee "$OUT_DIR/ffi_slotted.log" || status=1 ;;
        dense)  timeout "${KERNEL_S:-300}" python3 benchmarks/bench_ffi.py --dense-only "${ROWS:-32,64}" \
                    --budget-s $(( ${KERNEL_S:-300} - 60 )) --out "$OUT_DIR/ffi_dense.json" 2>&1 | quiet \
                    | tee "$OUT_DIR/ffi_dense.log" || status=1 ;;
        moeffn) timeout "${KERNEL_S:-300}" python3 benchmarks/bench_kernels.py --prefill-only --prefill-ms "" \
                    --moe-prefill-rows "" --moe-ffn-rows 49152 --moe-ffn-tiles "${MOE_FFN_TILES:-64x8,64x4,32x4,128x8}" \
                    --out "$OUT_DIR/moe_ffn.json" 2>&1 | quiet | tee "$OUT_DIR/moe_ffn.log" || status=1 ;;
        chunks) for chunk in ${CHUNKS:-2048 4096 8192}; do
                    prefill "chunk$chunk" "${BENCH_S:-180}" "${PROMPTS:-8192,32768}" "$chunk"
                done ;;
        *) echo "unknown part: $part (expected suite1-4, depth, matrix, profile, prefill8k, kernels, dense, moeffn or chunks)" >&2
           exit 2 ;;
    esac
done
exit $status
