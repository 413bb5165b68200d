"""CUDA C++ decode kernels called through XLA FFI (built on first use by ffi/build.py, cached by source hash).

    gemv(x [M, K], w) -> [M, N]                 w: Fp8BlockWeight / Mxfp4Weight / Nvfp4Weight [N, K]
    moe_gemv(x_rows [R, K], w [E, N, K], expert_ids [R]) -> [R, N]     w: Mxfp4Weight / Nvfp4Weight

M <= 8 bf16 rows (<= 4 float32 rows, split into bf16 hi + lo), float32 accumulation, one launch each (plus a
few small XLA ops for the routed-expert schedule). Kernels: ffi/gemv_kernel.cuh (schedule), fp4_gemv.cu,
fp8_gemv.cu. Oracle: dsv4_jax.quant.linear / grouped_linear. Status and measurements: ffi/README.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.quant.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight

from .build import FfiBuildError, register  # noqa: F401

MAX_ROWS = 8                     # the mma's 8 columns: bf16 activation rows per launch (float32: 4)
_TARGETS = {Mxfp4Weight: ("fp4_gemv.cu", "dsv4_mxfp4_gemv", "DSV4Mxfp4Gemv"),
            Nvfp4Weight: ("fp4_gemv.cu", "dsv4_nvfp4_gemv", "DSV4Nvfp4Gemv"),
            Fp8BlockWeight: ("fp8_gemv.cu", "dsv4_fp8_gemv", "DSV4Fp8Gemv")}


def max_rows(dtype) -> int:
    """Activation rows one call takes: 8 bf16 rows, 4 float32 rows (each becomes a bf16 hi and lo row)."""
    return MAX_ROWS // 2 if jnp.dtype(dtype) == jnp.float32 else MAX_ROWS


def supports(x_shape, x_dtype, w) -> bool:
    """Whether gemv(x, w) applies: rows, format and N % 16, K % 128."""
    rows, k = x_shape
    n = w.shape[-2]
    return (type(w) in _TARGETS and len(w.shape) == 2 and 1 <= rows <= max_rows(x_dtype) and n % 16 == 0
            and k % 128 == 0 and k == w.shape[-1])


def _split_rows(x: jax.Array) -> jax.Array:
    """[..., M, K] -> bf16 [..., M, K] (bf16 input) or [..., 2M, K] float32 hi rows then lo rows."""
    if x.dtype != jnp.float32:
        return x.astype(jnp.bfloat16)
    from pallas_kernels.gemv import split_f32     # the same hi/lo split the Pallas kernels use
    hi, lo = split_f32(x)
    return jnp.concatenate([hi, lo], axis=-2)


def _weight_operands(w, stacked: bool):
    """Kernel operands of a weight: (bytes, scales[, global scale]) with a leading expert axis."""
    lead = (lambda a: a) if stacked else (lambda a: a[None])
    if isinstance(w, Fp8BlockWeight):
        return [lead(jax.lax.bitcast_convert_type(w.weight, jnp.uint8)), lead(w.scale)]
    ops = [lead(w.packed), lead(jax.lax.bitcast_convert_type(w.scale, jnp.uint8))]
    if isinstance(w, Nvfp4Weight):
        ops.append(lead(w.global_scale.astype(jnp.float32)))
    return ops


def _call(x3: jax.Array, w, experts: jax.Array, n: int, schedule: int, stacked: bool) -> jax.Array:
    source, target, symbol = _TARGETS[type(w)]
    register(source, {target: symbol})
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x3.shape[:2], n), jnp.float32))
    return call(x3, *_weight_operands(w, stacked), experts, schedule=np.int32(schedule))


def _check_weight(w, x_k: int, what: str, stacked: bool):
    if type(w) not in _TARGETS or (stacked and isinstance(w, Fp8BlockWeight)):
        raise TypeError(f"{what}: unsupported weight {type(w).__name__}")
    if len(w.shape) != (3 if stacked else 2):
        raise ValueError(f"{what}: weight must be {'[E, N, K]' if stacked else '[N, K]'}, got {w.shape}")
    n, k = w.shape[-2:]
    if k != x_k or k % 128 or n % 16:
        raise ValueError(f"{what}: x has {x_k} features, weight {w.shape}: need equal K, K % 128 == 0, N % 16 == 0")
    return n


def gemv(x: jax.Array, w, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """x [M, K] (M <= 8 bf16 / <= 4 float32 rows) @ dequant(W [N, K])^T, float32 accumulation -> [M, N] out_dtype
    (default x.dtype). `schedule` picks a compiled tiling (gemv_kernel.cuh; 0 = default)."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= max_rows(x.dtype):
        raise ValueError(f"ffi.gemv: x must be [M, K] with 1..{max_rows(x.dtype)} {x.dtype} rows, got {x.shape}")
    n = _check_weight(w, x.shape[1], "ffi.gemv", stacked=False)
    m = x.shape[0]
    y = _call(_split_rows(x)[None], w, jnp.zeros((1,), jnp.int32), n, schedule, stacked=False)[0]
    if x.dtype == jnp.float32:
        y = y[:m] + y[m:]
    return y.astype(out_dtype or x.dtype)


def moe_gemv(x_rows: jax.Array, w_stacked, expert_ids: jax.Array, out_dtype=None, *, schedule: int = 0) -> jax.Array:
    """Row r of x_rows [R, K] times expert expert_ids[r] of w_stacked (Mxfp4Weight / Nvfp4Weight [E, N, K]) ->
    [R, N] out_dtype (default x_rows.dtype). Rows sharing an expert are gathered into slots of up to 8 bf16
    (4 float32) rows so each touched expert is streamed once per slot (pallas_kernels.moe's schedule)."""
    from pallas_kernels.moe import moe_schedule, slot_bound
    if x_rows.ndim != 2 or expert_ids.shape != x_rows.shape[:1]:
        raise ValueError(f"ffi.moe_gemv: x_rows [R, K] and expert_ids [R] expected, got {x_rows.shape}, "
                         f"{expert_ids.shape}")
    n = _check_weight(w_stacked, x_rows.shape[1], "ffi.moe_gemv", stacked=True)
    r, k = x_rows.shape
    capacity = max_rows(x_rows.dtype)
    n_slots = slot_bound(r, capacity, w_stacked.shape[0])
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe_schedule(expert_ids, capacity, n_slots)
    x_slots = jnp.concatenate([x_rows, jnp.zeros((1, k), x_rows.dtype)])[slot_rows]     # [S, capacity, K]
    y_slots = _call(_split_rows(x_slots), w_stacked, slot_expert, n, schedule, stacked=True)   # [S, 8, N]
    y = y_slots[slot_of_row, pos_of_row]
    if x_rows.dtype == jnp.float32:
        y = y + y_slots[slot_of_row, pos_of_row + capacity]
    return y.astype(out_dtype or x_rows.dtype)
