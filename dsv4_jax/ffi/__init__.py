"""CUDA C++ decode kernels called through XLA FFI (built on first use by dsv4_jax/ffi/build.py, cached by source hash).

    gemv(x [M, K], w [N, K]) -> [M, N]
    grouped_gemv(x [S, M, K], w [E, N, K], experts [S]) -> [S, M, N]     slot s times expert experts[s]
    moe_gemv(x_rows [R, K], w [E, N, K], expert_ids [R]) -> [R, N]       row r times expert expert_ids[r]
    gemv_concat(x [M, K], (w_a [N, K], w_b [N2, K])) -> [M, N + N2]      two FP8 weights of one K in one launch

w: Fp8BlockWeight / Mxfp4Weight / Nvfp4Weight, or an FP4 weight in the GEMV layout (fp4_layout.to_gemv_layout:
fewer decode instructions, same bytes); or a pair (w_a, w_b) of two weights of one format and shape, e.g. a gate and
an up projection: both products in one launch, side by side along N ([..., 2N]; each activation load serves both).
M <= 8 bf16 rows (<= 4 float32 rows, split into bf16 hi + lo), float32 accumulation, one launch each. Kernels:
ffi/gemv_kernel.cuh (schedule), fp4_gemv.cu, fp8_gemv.cu. Oracle: dsv4_jax.ops.matmul / grouped_linear. Status
and measurements: dsv4_jax/ffi/README.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..numerics.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, split_f32

from .build import FfiBuildError, register  # noqa: F401
from .fp4_layout import GemvLayoutFp4, to_gemv_layout  # noqa: F401

MAX_ROWS = 8                     # the mma's 8 columns: bf16 activation rows per launch (float32: 4)
# moe_gemv's default schedule: 4 warps per 16-row tile instead of 8. Routed decode launches 6-48 slots x N/16 tiles
# (768-6144 CTAs of 8 warps = 1.5-12 waves); with 4-warp CTAs the last wave is less ragged. Measured on the H200
# in four runs of benchmarks/bench_ffi.py --experts (MXFP4 and NVFP4, 6 of 256 experts, M = 1 and 8): 2-13% faster
# than 811 in every case (docs/kernels.md).
ROUTED_SCHEDULE = 411
# moe_gemv's default for a pair of weights (the routed gate + up projections in one launch), by format: two runs of
# benchmarks/bench_ffi.py --gate-up-only (6 of 256 experts, M = 1 and 8): MXFP4 811 5-6% faster than 411, NVFP4 411
# 3-5% faster than 811 (docs/kernels.md).
ROUTED_PAIR_SCHEDULE = {Mxfp4Weight: 811, Nvfp4Weight: 411}
# Routed calls whose slots each hold up to MAX_ROWS rows of one expert (ops/matmul_kernels.routed_gemv at 22-256
# decode tokens: 136-400 slots): 411 for a pair too. Measured on an H100 (benchmarks/bench_ffi.py --slotted-only
# 32,64,128,256, MXFP4, docs/bench/h100_2026-12-07_ffi_slotted.json): the gate + up pair 10-13% faster than 811
# at 32, 64 and 128 tokens (2,500 against 2,250 GB/s), down on 411 already the fastest of the ten schedules.
SLOTTED_SCHEDULE = 411
_TARGETS = {Mxfp4Weight: ("fp4_gemv.cu", "dsv4_mxfp4_gemv", "DSV4Mxfp4Gemv"),
            Nvfp4Weight: ("fp4_gemv.cu", "dsv4_nvfp4_gemv", "DSV4Nvfp4Gemv"),
            Fp8BlockWeight: ("fp8_gemv.cu", "dsv4_fp8_gemv", "DSV4Fp8Gemv")}
PAIR_SCHEDULES = (0, 811, 411, 11)   # schedules compiled for a pair of weights (gemv_kernel.cuh, compiled_for)
# The default for few tiles: 16 warps per 16-row tile (warps digit 0) instead of 811's 8. When the work items
# (slots x N / 16) fit in one wave of CTAs, the kernel's time is each warp's chain of dependent steps, not
# bandwidth; 16 warps halve it. Measured on the H200 (benchmarks/bench_ffi.py --shapes wq_a,wkv,shared_w1,
# docs/bench/h200_2026-11-30_ffi_small_shapes*.json): 10-22% less kernel time than 811 on 512-2048 x 4096, M = 1 and
# 8, FP8 / MXFP4 / NVFP4; on 18432 x 7168 the 16-warp schedules are 10-30% slower, so the rule stops at one wave
# and at the K where it was measured.
FEW_TILES_SCHEDULE = 11
FEW_TILES = 128                  # work items up to which it applies (the H200 has 132 SMs)
FEW_TILES_MIN_K = 4096


def _handlers(weight_type) -> tuple[str, dict[str, str]]:
    """(source, {FFI target: handler symbol}) of a weight format: its one-weight and its pair handler (FP8: and its
    concatenation handler, and its one-weight handler with a bf16 output)."""
    source, target, symbol = _TARGETS[weight_type]
    handlers = {target: symbol, target + "_pair": symbol + "Pair"}
    if weight_type is Fp8BlockWeight:
        handlers[target + "_concat"] = symbol + "Concat"
        handlers[target + "_bf16"] = symbol + "Bf16"
    return source, handlers


# Schedules compiled for a bf16 output (gemv_kernel.cuh, compiled_for): the defaults of dense and grouped calls.
BF16_OUTPUT_SCHEDULES = (811, 411, FEW_TILES_SCHEDULE)


def register_all(arch: str | None = None) -> None:
    """Build (if needed), load and register every kernel of dsv4_jax/ffi/ for `arch` (default: this process's GPU; e.g.
    "sm_90a" to compile for an H200 that is not attached); raises FfiBuildError / OSError."""
    for weight_type in _TARGETS:
        register(*_handlers(weight_type), arch)


def max_rows(dtype) -> int:
    """Activation rows one call takes: 8 bf16 rows, 4 float32 rows (each becomes a bf16 hi and lo row)."""
    return MAX_ROWS // 2 if jnp.dtype(dtype) == jnp.float32 else MAX_ROWS


def _split_rows(x: jax.Array) -> jax.Array:
    """[..., M, K] -> bf16 [..., M, K] (bf16 input) or [..., 2M, K] float32 hi rows then lo rows."""
    if x.dtype != jnp.float32:
        return x.astype(jnp.bfloat16)
    hi, lo = split_f32(x)
    return jnp.concatenate([hi, lo], axis=-2)


def _weight_operands(w):
    """Kernel operands of a stacked weight [E, N, K]: bytes, scales (uint8) [, global scale float32 [E]]."""
    if isinstance(w, Fp8BlockWeight):
        return [jax.lax.bitcast_convert_type(w.weight, jnp.uint8), w.scale]
    ops = [w.packed, jax.lax.bitcast_convert_type(w.scale, jnp.uint8)]
    if isinstance(w, Nvfp4Weight):
        ops.append(jnp.broadcast_to(w.global_scale.astype(jnp.float32), w.shape[:1]))
    return ops


def _stored(w):
    """The weight whose arrays the kernel reads (a GemvLayoutFp4 wraps one whose packed bytes are permuted)."""
    return w.weight if isinstance(w, GemvLayoutFp4) else w


def _weights(w) -> tuple:
    """A weight or a pair of weights -> the tuple of weights a call multiplies."""
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _launch(x3: jax.Array, w, experts: jax.Array, cols: int, schedule: int, out_dtype, handler: str = "") -> jax.Array:
    """One launch of a handler ("": one weight, "_pair", "_concat") of w's format: x3 [S, M, K] (float32 rows split
    into bf16 hi + lo rows, their products summed) times the stacked weight(s) w -> [S, M, cols] out_dtype (default
    x3.dtype). Shapes are checked by the callers. One FP8 weight with bf16 rows and a bf16 out_dtype takes the
    handler that rounds its float32 sums to bf16 as it stores them (the same values as a cast of the float32
    output, without a cast kernel after the call)."""
    weights = _weights(w)
    stored = [_stored(v) for v in weights]
    source, handlers = _handlers(type(stored[0]))
    register(source, handlers)
    xs = _split_rows(x3)
    out_dtype = jnp.dtype(out_dtype or x3.dtype)
    if (handler == "" and isinstance(stored[0], Fp8BlockWeight) and x3.dtype == jnp.bfloat16
            and out_dtype == jnp.bfloat16 and schedule in BF16_OUTPUT_SCHEDULES):
        handler, y_dtype = "_bf16", jnp.bfloat16
    else:
        y_dtype = jnp.float32
    call = jax.ffi.ffi_call(_TARGETS[type(stored[0])][1] + handler,
                            jax.ShapeDtypeStruct((*xs.shape[:2], cols), y_dtype))
    attrs = {"schedule": np.int32(schedule)}
    if source == "fp4_gemv.cu":                       # 0: checkpoint nibble order, 1: the GEMV layout
        attrs["layout"] = np.int32(isinstance(weights[0], GemvLayoutFp4))
    operands = [op for v in stored for op in _weight_operands(v)]
    y = call(xs, *operands, experts.astype(jnp.int32), **attrs)
    if x3.dtype == jnp.float32:
        m = x3.shape[1]
        y = y[:, :m] + y[:, m:]
    return y.astype(out_dtype)


def default_schedule(slots: int, n: int, k: int) -> int:
    """The schedule a dense / grouped call with schedule 0 runs: FEW_TILES_SCHEDULE for one wave of work items at
    K >= FEW_TILES_MIN_K, else the kernel's default 811."""
    return FEW_TILES_SCHEDULE if slots * (n // 16) <= FEW_TILES and k >= FEW_TILES_MIN_K else 811


CONCAT_SCHEDULES = (0, 811, 11)  # schedules compiled for concatenated weights (gemv_kernel.cuh, kConcat)


def gemv_concat(x: jax.Array, weights, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """x [M, K] (M <= 8 bf16 / <= 4 float32 rows) @ [W_a; W_b]^T for two FP8-block weights W_a [N, K], W_b [N2, K]
    of one K -> [M, N + N2] (W_a's products first): one launch whose work items are the tiles of both, e.g. the
    attention's wq_a and wkv, which read the same activations (for such small matrices the time is latency, so one
    launch instead of two is what counts). schedule 0: default_schedule of N + N2 rows."""
    what = "ffi.gemv_concat"
    if not isinstance(weights, (tuple, list)) or len(weights) != 2:
        raise ValueError(f"{what}: a pair (w_a, w_b) of weights expected, got {type(weights).__name__}")
    if x.ndim != 2 or not 1 <= x.shape[0] <= max_rows(x.dtype):
        raise ValueError(f"{what}: x must be [M, K] with 1..{max_rows(x.dtype)} {x.dtype} rows, got {x.shape}")
    if not all(isinstance(w, Fp8BlockWeight) for w in weights):
        raise TypeError(f"{what}: FP8-block weights only, got {[type(w).__name__ for w in weights]}")
    n_a, n_b = (_check_weight(w, x.shape[1], what, stacked=False) for w in weights)
    if schedule not in CONCAT_SCHEDULES:
        raise ValueError(f"{what}: concatenated weights run schedules {CONCAT_SCHEDULES}, got {schedule}")
    schedule = schedule or default_schedule(1, n_a + n_b, x.shape[1])
    stacked = tuple(jax.tree.map(lambda a: a[None], w) for w in weights)
    return _launch(x[None], stacked, np.zeros((1,), np.int32), n_a + n_b, schedule, out_dtype, "_concat")[0]


def _check_weight(w, x_k: int, what: str, stacked: bool):
    weights = _weights(w)
    if len(weights) > 2:
        raise ValueError(f"{what}: one weight or a pair of weights, got {len(weights)}")
    if len(weights) == 2:
        a, b = weights
        if (type(a) is not type(b) or type(_stored(a)) is not type(_stored(b)) or tuple(a.shape) != tuple(b.shape)):
            raise ValueError(f"{what}: the two weights of a pair need one format, layout and shape, got "
                             f"{type(a).__name__} {tuple(a.shape)} and {type(b).__name__} {tuple(b.shape)}")
    w = weights[0]
    if type(_stored(w)) not in _TARGETS:
        raise TypeError(f"{what}: unsupported weight {type(w).__name__}")
    if len(w.shape) != (3 if stacked else 2):
        raise ValueError(f"{what}: weight must be {'[E, N, K]' if stacked else '[N, K]'}, got {w.shape}")
    n, k = w.shape[-2:]
    if k != x_k or k % 128 or n % 16:
        raise ValueError(f"{what}: x has {x_k} features, weight {w.shape}: need equal K, K % 128 == 0, N % 16 == 0")
    return n


def grouped_gemv(x3: jax.Array, w_stacked, experts: jax.Array, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """Slot s of x3 [S, M, K] (M <= 8 bf16 / <= 4 float32 rows) times expert experts[s] of w_stacked [E, N, K]
    (any format) -> [S, M, N] out_dtype (default x3.dtype); a pair (w_a, w_b) -> [S, M, 2N], w_a's products in
    columns 0 .. N. One launch; `schedule` picks a compiled tiling (gemv_kernel.cuh; 0 = default_schedule of the
    shape; a pair: PAIR_SCHEDULES)."""
    what = "ffi.grouped_gemv"
    if x3.ndim != 3 or not 1 <= x3.shape[1] <= max_rows(x3.dtype) or experts.shape != x3.shape[:1]:
        raise ValueError(f"{what}: x [S, M, K] with 1..{max_rows(x3.dtype)} {x3.dtype} rows per slot and experts "
                         f"[S] expected, got {x3.shape}, {experts.shape}")
    n = _check_weight(w_stacked, x3.shape[2], what, stacked=True)
    if len(_weights(w_stacked)) == 2 and schedule not in PAIR_SCHEDULES:
        raise ValueError(f"{what}: a pair of weights runs schedules {PAIR_SCHEDULES}, got {schedule}")
    pair = len(_weights(w_stacked)) == 2
    schedule = schedule or default_schedule(x3.shape[0], n, x3.shape[2])
    return _launch(x3, w_stacked, experts, (1 + pair) * n, schedule, out_dtype, "_pair" if pair else "")


def gemv(x: jax.Array, w, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """x [M, K] (M <= 8 bf16 / <= 4 float32 rows) @ dequant(W [N, K])^T, float32 accumulation -> [M, N] out_dtype
    (default x.dtype)."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= max_rows(x.dtype):
        raise ValueError(f"ffi.gemv: x must be [M, K] with 1..{max_rows(x.dtype)} {x.dtype} rows, got {x.shape}")
    _check_weight(w, x.shape[1], "ffi.gemv", stacked=False)                # a pair: [M, 2N] (grouped_gemv)
    w_stacked = jax.tree.map(lambda a: a[None], w)
    return grouped_gemv(x[None], w_stacked, np.zeros((1,), np.int32), out_dtype, schedule=schedule)[0]


def moe_gemv(x_rows: jax.Array, w_stacked, expert_ids: jax.Array, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """Row r of x_rows [R, K] times expert expert_ids[r] of w_stacked [E, N, K] -> [R, N] out_dtype (default
    x_rows.dtype): one slot per row, so no sort or gather on the way (decode: R = tokens x top-k <= 48); a row
    whose expert another row also uses reads it again (often from L2). A pair (w_a, w_b) -> [R, 2N]. schedule 0:
    ROUTED_SCHEDULE (a pair: ROUTED_PAIR_SCHEDULE of its format)."""
    if x_rows.ndim != 2 or expert_ids.shape != x_rows.shape[:1]:
        raise ValueError(f"ffi.moe_gemv: x_rows [R, K] and expert_ids [R] expected, got {x_rows.shape}, "
                         f"{expert_ids.shape}")
    return grouped_gemv(x_rows[:, None], w_stacked, expert_ids, out_dtype,
                        schedule=schedule or routed_schedule(w_stacked))[:, 0]


def routed_schedule(w_stacked, *, slotted: bool = False) -> int:
    """The schedule of routed-expert calls, whose slots each read another expert: ROUTED_SCHEDULE, a pair
    ROUTED_PAIR_SCHEDULE of its format; slots of several rows each (`slotted`): SLOTTED_SCHEDULE."""
    if slotted:
        return SLOTTED_SCHEDULE
    weights = _weights(w_stacked)
    return ROUTED_PAIR_SCHEDULE.get(type(_stored(weights[0])), 0) if len(weights) == 2 else ROUTED_SCHEDULE
