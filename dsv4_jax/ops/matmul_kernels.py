"""Which matmuls run on the GPU kernels (`ffi/` CUDA, `pallas_kernels/`) and which on the pure-jnp reference.

The kernel plan (ops/plan.py, resolved once for a device and carried by the run context) names the
backend: None (the reference everywhere), "cuda" (the CUDA decode GEMVs of dsv4_jax/ffi/ where they apply, if they were
built; the Pallas kernels for the rest), "pallas" (the Pallas kernels only) or "interpret" (the Pallas kernels in
interpret mode: runs anywhere, slowly; tests and debugging). `kernels="auto"` plans "cuda" on an NVIDIA GPU and the
reference elsewhere.

A kernel applies where one exists for the call; every other call takes the reference, whatever the mode:

    call                                   kernel                         applies when
    linear / group_linear (wo_a) /         ffi.gemv / grouped_gemv /      "auto" on CUDA; rows (per group) <= 8
      routed experts (decode),             moe_gemv (CUDA, one launch)    bf16 / 4 fp32, N % 16, K % 128; routed
      FP8-block / MXFP4 / NVFP4 weight                                    rows <= 128 (one slot per row),
                                                                          <= 1,536 (rows grouped by expert)
    linear_pair / grouped_linear_pair      the same with a pair of        as above, two weights of one format
      (gate and up projections)            weights (pair_matmul)          and shape
    linear_pair, two FP8-block weights     ffi.gemv_concat (tiles of      as above, one K, N and N2 % 16 == 0
      of one K (attention wq_a and wkv)    both weights, one launch)
    linear, FP8-block weight               gemv.fp8_matmul                rows <= 256 (bf16) / 128 (fp32),
                                                                          N % 64 == 0
    linear, MXFP4 / NVFP4 weight           gemv.mxfp4_matmul / nvfp4_...  rows as above, N % 64 == 0, K % 32 == 0
    linear, FP8-block / MXFP4 weight,      prefill.fp8_block_matmul       rows > 16, N % 64 == 0, K % 128 == 0
      FP8 activations (act_quant fp8,      (FP8 tensor cores)
      or nvfp4 for FP8 weights)
    group_linear (wo_a), FP8 / FP4 weight  the same, vmapped over groups  as above per group; FP8 groups need
                                                                          out % 128 == 0 or 128 % out == 0
    grouped_linear (experts), FP4 weight   moe.moe_matmul                 N % 64 == 0, K % 32 == 0; slots of 16
                                                                          rows (decode) or up to 128 (prefill:
                                                                          about the rows per expert)
    grouped_linear (experts), MXFP4        moe_fp8.moe_fp8_matmul (FP8    opt-in (override matmul=kernel;
      weight, FP8 activations              tensor cores, W4A8)            slower than moe_matmul so far): more
                                                                          than MAX_SLOTTED_ROWS rows, N and K
                                                                          % 128 == 0
    the routed experts of a prefill       moe.moe_ffn (gate / up with    op moe_ffn, opt-in (override
      chunk, FP4, bf16 rows (routed_ffn)   the SwiGLU, then down, one     moe_ffn=kernel; not yet timed): more
                                           slot schedule)                 than MAX_SLOTTED_ROWS picks
    bf16 / fp32 weights, larger batches    XLA dot (reference)            -

Activation quantization (act_quant fp8 / nvfp4) is an op of its own (ops/act_quantize.py): the Pallas quantize
kernels of dsv4_jax/pallas_kernels/quantize.py on every kernel backend, bit-identical to the reference definition,
which XLA:GPU's own run of the jnp reference is not (docs/kernels_quantize.md).

"rows" are the flattened leading dimensions of x: batch x tokens in the chunk, so decode steps, MTP drafts and
verify steps of up to 256 rows (batch 64 with 3 drafts) take the decode kernels, which read each stored weight
once whatever the rows (wider tiles of activation columns from 17 rows, gemv.activation_tiling); more rows
(prefill chunks) take the FP8 tensor-core kernel where activations are FP8 and the reference otherwise (W8A16 /
W4A16 prefill is XLA's bf16 dot on the dequantized weight), and so do 17 or more rows with FP8 activations; the
routed experts take the MoE kernel, with wider slots for prefill chunks (the W4A8 grouped GEMM on FP8 tensor cores,
moe_fp8, is opt-in). The choice is made while tracing, from static shapes only, so it never costs a host sync;
`record_dispatch()` lists the choices of a trace (tests use it to prove the kernels were really taken).

The NVFP4 Pallas kernels assume normal positive e4m3 block scales (what the NVFP4 recipe writes unless a block
is 2^15 below its matrix maximum; the dsv4_jax/ffi/ kernels read any finite scale exactly);
`nvfp4_weights_kernels_approximate(params)` lists the weights that break it (checkpoint loading warns about them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import ffi
from ..numerics.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from ..pallas_kernels import gemv, moe, moe_fp8, prefill
from . import act_quantize, choice
from .plan import REFERENCE, KernelPlan

MAX_DECODE_ROWS = 16          # rows up to which FP8 activations take the decode kernels, not the tensor-core one
MAX_MOE_ROWS = 128            # routed rows (tokens x top-k) up to which the MoE kernel keeps its decode schedule
# Routed rows up to which the ffi/ GEMV takes the routed experts on CUDA (a decode or verify step of up to 256
# tokens): up to MAX_MOE_ROWS one slot per row, beyond that the rows grouped by expert (routed_gemv). More rows
# (prefill chunks: many rows per expert) take the MoE kernel's tensor-core slots.
MAX_SLOTTED_ROWS = 256 * 6


def _plan(ctx) -> KernelPlan:
    """The plan the matmuls follow: the context's, or the reference where its overrides say so for "matmul"."""
    return REFERENCE if ctx.kernels.override("matmul") == "reference" else ctx.kernels


def _record(call: str, weight, path: str, kernel: str | None, ctx) -> None:
    choice.record("matmul", ctx.phase, path, kernel, call=call, weight=weight)


def _ffi_fits(rows: int, dtype, n: int, k: int) -> bool:
    """Shapes the dsv4_jax/ffi/ GEMV takes: <= 8 bf16 rows (4 float32) per slot, N % 16 == 0, K % 128 == 0."""
    return dtype in (jnp.bfloat16, jnp.float32) and rows <= ffi.max_rows(dtype) and n % 16 == 0 and k % 128 == 0


def _ffi_takes(x2: jax.Array, weight, routed: bool, plan: KernelPlan) -> bool:
    """Whether the ffi/ decode GEMV takes rows x2 [R, K] times a quantized weight under `plan` (the kernels built):
    2-D (dense), or stacked FP4 experts [E, N, K] with the routed rows (routed; routed_gemv)."""
    if not plan.ffi:
        return False
    n, k = weight.shape[-2:]
    if routed:
        fits = (x2.shape[0] <= MAX_SLOTTED_ROWS and _ffi_fits(1, x2.dtype, n, k)
                and isinstance(weight, (Mxfp4Weight, Nvfp4Weight)))
    else:
        fits = _ffi_fits(x2.shape[0], x2.dtype, n, k)
    return fits


def nvfp4_weights_kernels_approximate(params) -> list[str]:
    """Paths of the NVFP4 weights in a parameter tree with a block scale the GPU kernels do not read exactly
    (subnormal, zero, negative or NaN e4m3). One device reduction per weight and one host read in all."""
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda a: isinstance(a, Nvfp4Weight))
    nvfp4 = [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves if isinstance(leaf, Nvfp4Weight)]
    if not nvfp4:
        return []
    exact = jax.device_get([gemv.nvfp4_kernel_exact(w) for _, w in nvfp4])
    return [name for (name, _), ok in zip(nvfp4, exact) if not ok]


def _rows_fit(x: jax.Array, rows: int) -> bool:
    """Whether the Pallas decode kernels take `rows` rows of x's dtype in one call (gemv.MAX_ROWS bf16 rows;
    float32 half, as hi + lo parts)."""
    if x.dtype == jnp.float32:
        return rows <= gemv.MAX_ROWS // 2
    return x.dtype == jnp.bfloat16 and rows <= gemv.MAX_ROWS


def _fp4_unroll(w, k: int) -> int | None:
    """Scale blocks per kernel K step: the kernel's default (256 inputs) or the largest power of two below it
    that divides K's blocks; None when no step holds the 16 inputs a tensor-core dot needs."""
    block = w.block
    if k % block:
        return None
    blocks, unroll = k // block, 256 // block
    while unroll > 1 and blocks % unroll:
        unroll //= 2
    return unroll if unroll * block // 2 >= 16 else None


def _dense_kernel(w, n: int, k: int):
    """A function (x [M, K], w, interpret) -> float32 [M, N] for 2-D weights of w's format and shape [n, k], or
    None if no kernel applies."""
    if n % 64:
        return None
    if isinstance(w, Fp8BlockWeight):
        if k % 128:
            return None
        return lambda x, w, interpret: gemv.fp8_matmul(x, w, jnp.float32, interpret=interpret)
    if isinstance(w, (Mxfp4Weight, Nvfp4Weight)):
        unroll = _fp4_unroll(w, k)
        if unroll is None:
            return None
        kernel = gemv.mxfp4_matmul if isinstance(w, Mxfp4Weight) else gemv.nvfp4_matmul
        return lambda x, w, interpret: kernel(x, w, jnp.float32, interpret=interpret, unroll=unroll)
    return None


def _is_quantized_matrix(weight, ndim: int) -> bool:
    return isinstance(weight, (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight)) and len(weight.shape) == ndim


def _opted_in(plan: KernelPlan) -> bool:
    """Whether the plan takes the matmul kernels that are not the default because no GPU run has shown them faster
    (moe_fp8): its override `matmul=kernel`, or the interpret plan (tests)."""
    return plan.interpret or plan.override("matmul") == "kernel"


def dense_matmul(x2: jax.Array, weight, ctx, call: str = "linear"):
    """float32 x2 [M, K] @ dequant(W)^T (global scale included) through a kernel, or None: use the reference."""
    plan = _plan(ctx)
    backend = plan.backend
    if not _is_quantized_matrix(weight, 2):
        return None
    if backend == "cuda" and _ffi_takes(x2, weight, False, plan):
        _record(call, weight, backend, "ffi_gemv", ctx)
        return ffi.gemv(x2, weight, jnp.float32)
    kernel = _dense_kernel(weight, *weight.shape) if backend and _rows_fit(x2, x2.shape[0]) else None
    _record(call, weight, backend if kernel else "reference", "gemv", ctx)
    return kernel(x2, weight, backend == "interpret") if kernel else None


def prefill_matmul(x2: jax.Array, weight, activation_kind: str, ctx):
    """float32 x2 [M, K] (M > 16 rows) @ dequant(W)^T on FP8 tensor cores with x2 quantized by the fp8 activation
    quantizer (`activation_kind` == "fp8"), or None: another path applies."""
    backend = _plan(ctx).backend
    if (backend is None or activation_kind != "fp8" or x2.shape[0] <= MAX_DECODE_ROWS
            or not _is_quantized_matrix(weight, 2) or isinstance(weight, Nvfp4Weight)):
        return None
    n, k = weight.shape
    if n % 64 or k % 128:
        return None
    _record("linear", weight, backend, "prefill_fp8", ctx)
    operand = prefill.fp8_weight_operand if isinstance(weight, Fp8BlockWeight) else prefill.mxfp4_weight_operand
    wq, sw = operand(weight)
    xq, sx = act_quantize.quantize_fp8(x2, ctx)                          # the FP8 quantize kernel
    return prefill.fp8_block_matmul(xq, sx, wq, sw, jnp.float32, interpret=backend == "interpret")


def prefill_expert_matmul(xs: jax.Array, weight, row_experts: jax.Array, real: jax.Array | None,
                          activation_kind: str, ctx):
    """float32 [R, N]: rows xs [R, K] each times its own expert of a stacked MXFP4 weight [E, N, K] on FP8 tensor
    cores (pallas_kernels/moe_fp8.py), xs quantized by the fp8 activation quantizer (`activation_kind` == "fp8");
    rows that are not `real` (None: all are) read no weight and give zeros. None where another path applies: more
    routed rows than a decode or verify step has (MAX_SLOTTED_ROWS; those stream each weight once on the GEMVs),
    N and K multiples of 128, and on a GPU only where the plan opts in (`matmul=kernel`): on an H100 (2026-12-06)
    it took 3.86 ms for an 8K chunk's experts_w1 where the bf16 MoE kernel on the same rows took 2.81 ms, and an 8K
    prompt 131.7 ms against 128.3 (docs/performance.md), so FP8 activations keep that kernel by default. The
    interpret plan takes it."""
    plan = _plan(ctx)
    backend = plan.backend
    if (backend is None or not _opted_in(plan) or activation_kind != "fp8" or xs.shape[0] <= MAX_SLOTTED_ROWS
            or not isinstance(weight, Mxfp4Weight) or weight.packed.ndim != 3
            or weight.shape[1] % 128 or weight.shape[2] % 128):
        return None
    _record("grouped_linear", weight, backend, "moe_fp8", ctx)
    xq, sx = act_quantize.quantize_fp8(xs, ctx)                          # the FP8 quantize kernel
    return moe_fp8.moe_fp8_matmul(xq, sx, weight, row_experts, real, interpret=backend == "interpret")


def routed_ffn_fits(x: jax.Array, w_gate, w_up, w_down, n_picks: int, activation_kind: str, ctx) -> bool:
    """Whether moe.moe_ffn takes the routed experts of tokens x [T, D] with n_picks picks (routed_ffn): the picks of
    a prefill chunk (more than a decode or verify step has, MAX_SLOTTED_ROWS), bfloat16 tokens without activation
    quantization, gate and up one FP4 format and shape, all three weights on the MoE kernel (expert_kernel) and one
    slot width for both kernels."""
    if (activation_kind != "none" or n_picks <= MAX_SLOTTED_ROWS or x.dtype != jnp.bfloat16
            or type(w_gate) is not type(w_up) or w_gate.shape != w_up.shape
            or any(expert_kernel(n_picks, x.dtype, w, ctx) != "pallas" for w in (w_gate, w_down))):
        return False
    return _routed_ffn_tiles(n_picks, x.dtype, w_gate, w_down) is not None


def _routed_ffn_tiles(n_picks: int, dtype, w_gate, w_down) -> tuple[int, dict, dict] | None:
    """(slot width, the gate / up kernel's tiles, the down kernel's tiles), None if the two want other slot widths.
    The slot width: moe_matmul's prefill schedule's (_moe_schedule). 128-column slots (a prefill chunk's): the
    tiling fastest of those timed for an 8,192-token chunk's routed FFN of MXFP4 experts on an H100 (2026-12-07,
    docs/performance.md; gate / up 128 weight rows on 8 warps, the down kernel moe_ffn's own 64 rows on 4 warps:
    8.95 ms, against 20.0 with 64 rows on 8 warps and the down kernel on moe_matmul's tiling). Otherwise (narrower
    slots, NVFP4, a gate not a multiple of 128 rows), not timed: 64 weight rows at moe_matmul's K step (8 warps at
    128 columns, 4 below), the down kernel on moe_matmul's tiling."""
    gate_tiles = _moe_schedule(n_picks, dtype, w_gate, _fp4_unroll(w_gate, w_gate.shape[-1]))
    down_tiles = _moe_schedule(n_picks, dtype, w_down, _fp4_unroll(w_down, w_down.shape[-1]))
    slot_cols = down_tiles.pop("slot_cols")
    if gate_tiles["slot_cols"] != slot_cols:
        return None
    if slot_cols == 128 and isinstance(w_gate, Mxfp4Weight) and w_gate.shape[1] % 128 == 0:
        return slot_cols, dict(block_n=128, num_warps=8), {}       # {}: moe_ffn's own down tiling
    return slot_cols, dict(block_n=64, unroll=gate_tiles["unroll"], num_warps=8 if slot_cols == 128 else 4), down_tiles


def routed_ffn(x: jax.Array, w_gate, w_up, w_down, picks: jax.Array, row_weights: jax.Array, limit: float,
               ctx) -> jax.Array:
    """The routed experts of tokens x [T, D] in two launches of pallas_kernels/moe.moe_ffn, where routed_ffn_fits:
    float32 [T, D], the sum over each token's picks [T, K] (-1: no expert) of row_weights times the expert's down
    projection of SiLU(min(gate, limit)) * clamp(up, -limit, limit) (the hidden values rounded to x.dtype, as the
    layer rounds them). The gate / up kernel writes no float32 projection and its hidden values go to the down
    kernel in the slot layout both read, so no [T x K, N] or [T x K, D] copy of the rows in pick order is made."""
    plan = _plan(ctx)
    slot_cols, up_tiles, down_tiles = _routed_ffn_tiles(picks.size, x.dtype, w_gate, w_down)
    _record("grouped_linear pair", w_gate, plan.backend, "moe_swiglu", ctx)
    _record("grouped_linear", w_down, plan.backend, "moe_slots", ctx)
    return moe.moe_ffn(x, w_gate, w_up, w_down, picks, row_weights, limit, interpret=plan.backend == "interpret",
                       slot_cols=slot_cols, up_tiles=up_tiles, down_tiles=down_tiles)


def _split_groups(w, groups: int):
    """A [G * out, in] weight as G stacked [out, in] weights of its own format, or None if its scale blocks do
    not split along the groups."""
    rows, cols = w.shape
    out = rows // groups
    if isinstance(w, Fp8BlockWeight):
        if out % 128 == 0:
            scale = w.scale.reshape(groups, out // 128, -1)
        elif 128 % out == 0:
            scale = w.scale[(jnp.arange(groups) * out) // 128][:, None, :]
        else:
            return None
        return Fp8BlockWeight(w.weight.reshape(groups, out, cols), scale)
    if isinstance(w, Mxfp4Weight):
        return Mxfp4Weight(w.packed.reshape(groups, out, -1), w.scale.reshape(groups, out, -1))
    if isinstance(w, Nvfp4Weight):
        return Nvfp4Weight(w.packed.reshape(groups, out, -1), w.scale.reshape(groups, out, -1), w.global_scale)
    return None


def group_matmul(x3: jax.Array, weight, ctx, out_dtype=jnp.float32):
    """Block-diagonal x3 [M, G, K] @ W [G * out, K]^T per group -> [M, G, out], or None (reference): in out_dtype
    on the FFI path (an FP8 weight's products rounded to bf16 as they are stored, so a bf16 consumer needs no cast
    kernel), float32 on the Pallas path."""
    plan = _plan(ctx)
    backend = plan.backend
    if not _is_quantized_matrix(weight, 2):
        return None
    stacked = _split_groups(weight, x3.shape[1]) if backend and _rows_fit(x3, x3.shape[0]) else None
    if (backend == "cuda" and stacked is not None and _ffi_fits(x3.shape[0], x3.dtype, *stacked.shape[-2:])
            and plan.ffi):
        _record("group_linear", weight, backend, "ffi_grouped_gemv", ctx)
        groups = np.arange(x3.shape[1], dtype=np.int32)      # slot g = group g's rows (a constant: no iota kernel)
        y = ffi.grouped_gemv(jnp.swapaxes(x3, 0, 1), stacked, groups, out_dtype)
        return jnp.swapaxes(y, 0, 1)                                      # [M, G, out]
    kernel = _dense_kernel(weight, *stacked.shape[-2:]) if stacked is not None else None
    _record("group_linear", weight, backend if kernel else "reference", "gemv", ctx)
    if not kernel:
        return None
    interpret = backend == "interpret"
    weight_axes = jax.tree.map(lambda a: 0 if a.ndim > 0 else None, stacked)     # a global scale is shared
    y = jax.vmap(lambda xg, wg: kernel(xg, wg, interpret), in_axes=(0, weight_axes))(
        jnp.swapaxes(x3, 0, 1), stacked)                                          # [G, M, out]
    return jnp.swapaxes(y, 0, 1)


def expert_kernel(rows: int, dtype, weight, ctx) -> str | None:
    """Which per-row kernel takes `rows` rows of `dtype`, each times its own expert of a stacked weight [E, N, K]:
    "ffi" (dsv4_jax/ffi/ moe_gemv), "pallas" (pallas_kernels/moe.py, also in interpret mode) or None (the reference:
    dequantize, then ragged_dot over rows sorted by expert)."""
    if not _is_quantized_matrix(weight, 3):
        return None
    plan = _plan(ctx)
    rows_shape = jax.ShapeDtypeStruct((rows, weight.shape[-1]), dtype)
    if plan.backend == "cuda" and _ffi_takes(rows_shape, weight, True, plan):
        return "ffi"
    fits = (isinstance(weight, (Mxfp4Weight, Nvfp4Weight)) and weight.shape[1] % 64 == 0
            and dtype in (jnp.bfloat16, jnp.float32))
    if plan.backend is not None and fits and _fp4_unroll(weight, weight.shape[-1]) is not None:
        return "pallas"
    return None


def routed_gemv(xs: jax.Array, weights, row_experts: jax.Array, real: jax.Array | None = None, *,
                grouped_gemv=ffi.grouped_gemv) -> jax.Array:
    """Rows xs [R, K] each times its own expert row_experts[r] of a stacked FP4 weight [E, N, K] (or a pair of them)
    on the ffi/ GEMV -> float32 [R, N] (a pair: [R, 2N]). Rows that are not `real` (padding, a row that is not
    generating, another device's expert; None: all are) go to no expert: no weight is read for them and their
    output rows are left unwritten, for the caller to zero.

    Up to MAX_MOE_ROWS rows: one slot per row (ffi.moe_gemv: no sort; an expert two rows share is read twice,
    mostly from L2). More rows (a decode step of 22 to 256 tokens): the rows are grouped by expert into slots of
    up to ffi.max_rows rows (pallas_kernels/moe.py's moe_schedule), so each expert the step touches is streamed
    once per slot, whatever the rows that chose it, in one launch; the unused slots of the static bound skip.
    `grouped_gemv` is ffi.grouped_gemv (tests pass a reference with its contract)."""
    experts = row_experts if real is None else jnp.where(real, row_experts, -1)
    if xs.shape[0] <= MAX_MOE_ROWS:
        return grouped_gemv(xs[:, None], weights, experts, jnp.float32, schedule=ffi.routed_schedule(weights))[:, 0]
    n_experts = jax.tree.leaves(weights)[0].shape[0]
    capacity = ffi.max_rows(xs.dtype)
    n_slots = moe.slot_bound(xs.shape[0], capacity, n_experts + 1)          # + 1: the rows of no expert (-1)
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe.moe_schedule(experts, capacity, n_slots)
    x3 = jnp.concatenate([xs, jnp.zeros((1, xs.shape[1]), xs.dtype)])[slot_rows]     # [S, capacity, K]
    y3 = grouped_gemv(x3, weights, slot_expert, jnp.float32, schedule=ffi.routed_schedule(weights, slotted=True))
    return y3[slot_of_row, pos_of_row]


def expert_matmul(xs: jax.Array, weight, row_experts: jax.Array, ctx, real: jax.Array | None = None):
    """Rows xs [R, K] each times its own expert of a stacked FP4 weight -> float32 [R, N], or None (reference).
    `real` [R] (None: all): rows whose output the caller zeroes, which the ffi/ path skips (routed_gemv)."""
    kernel = expert_kernel(xs.shape[0], xs.dtype, weight, ctx)
    backend = _plan(ctx).backend
    if kernel == "ffi":
        _record("grouped_linear", weight, backend, _ffi_routed_kernel(xs), ctx)
        return routed_gemv(xs, weight, row_experts, real)
    if _is_quantized_matrix(weight, 3):
        _record("grouped_linear", weight, backend if kernel else "reference", "moe", ctx)
    if kernel is None:
        return None
    unroll = _fp4_unroll(weight, weight.shape[-1])
    return moe.moe_matmul(xs, weight, row_experts, jnp.float32, interpret=backend == "interpret",
                          **_moe_schedule(xs.shape[0], xs.dtype, weight, unroll))


def _ffi_routed_kernel(xs: jax.Array) -> str:
    """The name record_dispatch gives routed_gemv's launch for rows xs: one slot per row, or the rows in slots."""
    return "ffi_moe_gemv" if xs.shape[0] <= MAX_MOE_ROWS else "ffi_moe_gemv_slots"


def pair_matmul(x2: jax.Array, w_a, w_b, ctx, routed: bool):
    """Two weights of one format times the same rows in one launch: a function (xq [R, K], row_experts [R] or None
    [, real [R]: routed_gemv]) -> float32 [R, N + N2] (w_a's products in columns 0 .. N), or None where no such
    kernel applies (the caller then makes two calls). The ffi/ decode GEMVs only. One shape (a gate and an up
    projection): each activation load and B fragment serves both weights; routed: stacked FP4 experts [E, N, K],
    each row times its own expert (as expert_matmul). Two 2-D FP8-block weights of one K and different N (the
    attention's wq_a and wkv): the concatenation kernel, whose items are the tiles of both (ffi.gemv_concat)."""
    plan = _plan(ctx)
    ndim = 3 if routed else 2
    same_shape = tuple(w_a.shape) == tuple(w_b.shape)
    concat = not routed and not same_shape and isinstance(w_a, Fp8BlockWeight) and w_a.shape[1:] == w_b.shape[1:]
    if (type(w_a) is not type(w_b) or not _is_quantized_matrix(w_a, ndim) or not (same_shape or concat)
            or plan.backend != "cuda" or not _ffi_takes(x2, w_a, routed, plan)
            or (concat and not _ffi_takes(x2, w_b, routed, plan))):
        return None
    if concat:
        _record("linear pair", w_a, "cuda", "ffi_gemv_concat", ctx)
        return lambda xq, row_experts: ffi.gemv_concat(xq, (w_a, w_b), jnp.float32)
    if routed:
        _record("grouped_linear pair", w_a, "cuda", _ffi_routed_kernel(x2) + "_pair", ctx)
        return lambda xq, row_experts, real=None: routed_gemv(xq, (w_a, w_b), row_experts, real)
    _record("linear pair", w_a, "cuda", "ffi_gemv_pair", ctx)
    return lambda xq, row_experts: ffi.gemv(xq, (w_a, w_b), jnp.float32)


def _moe_schedule(rows: int, dtype, weight, unroll: int) -> dict:
    """moe_matmul's tiling. Decode (<= MAX_MOE_ROWS rows): the kernel's defaults (16-column slots, split-K,
    `unroll` scale blocks per K step). Prefill: slots about as wide as the rows an expert gets on average (16..128
    columns), each decoded weight tile reused that often, and no split-K (the slots fill the GPU). At 128 columns
    with the full 256-input K step available, the tile sweep on the H200 (`bench_kernels.py --sweep`,
    docs/kernels.md) picked 128-input K steps, with tiles of 128 weight rows on 8 warps for MXFP4 (1.14-1.2x
    over 64 rows, 4 warps, 256 inputs; two runs) and of 64 rows on 4 warps for NVFP4 (1.15x, one run; its
    128-row tile gained nothing). Only measured configurations are chosen: 128-row tiles with 64-input K steps gave
    wrong results on the H200 (Triton lowering; docs/kernels.md)."""
    n_experts, n, _ = weight.shape
    if rows <= MAX_MOE_ROWS:
        return dict(unroll=unroll)
    cols_per_row = 2 if dtype == jnp.float32 else 1
    want = cols_per_row * -(-rows // n_experts)
    cols = 16
    while cols < min(want, 128):
        cols *= 2
    if cols == 128 and unroll * weight.block == 256:
        if isinstance(weight, Mxfp4Weight) and n % 128 == 0:
            return dict(slot_cols=cols, split_k=1, block_n=128, unroll=unroll // 2, num_warps=8)
        return dict(slot_cols=cols, split_k=1, block_n=64, unroll=unroll // 2)
    return dict(slot_cols=cols, split_k=1, block_n=64 if cols >= 64 else None, unroll=unroll)
