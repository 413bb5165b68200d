"""Matmuls against stored weights: the dispatcher between GPU kernels and the pure-jnp reference.

Every function takes a weight in any stored format (bf16/fp32 array, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight);
the `act_quant` mode of the run context (dsv4_jax/run_context.py) says how its input is quantized:

    act_quant   FP8 weight                      FP4 weight (MXFP4, NVFP4)            bf16 / fp32 weight
    "none"      x.dtype activations (W8A16)     x.dtype activations (W4A16)          x.dtype activations
    "fp8"       per-128 e4m3, ue8m0 (W8A8)      per-128 e4m3, ue8m0 (the reference's fp8 x fp4 GEMM)
    "nvfp4"     per-128 e4m3, ue8m0 (W8A8)      NVFP4, runtime global scale (W4A4)   never quantized

As in the reference (docs/model.md 3.1) only linears with FP8/FP4 weights quantize their input; bf16 weights (router
gate, compressors, indexer weights_proj, the bf16 head) never do. Under "nvfp4" FP8 weights keep FP8 activations: there
is no W8A4 GEMM anywhere, and it is how NVFP4-expert checkpoints are served (attention / shared experts W8A8).

The reference math: the activation is quantized per row (activations.py) and dequantized to values that are exact
in x.dtype, the weight is dequantized without its global scale (also exact in bf16), one GEMM accumulates in
float32, and the output is multiplied by the NVFP4 activation global scale x the weight's global scale. Because
every operand is exact this equals a tensor-core FP8 / FP4 GEMM with per-block rescaling up to float32 summation
order.

Every function takes the run context `ctx` (dsv4_jax/run_context.py), a required keyword: `ctx.act_quant` is the
mode above and `ctx.kernels` the kernel plan, which picks between that reference and the GPU kernels of ffi/ and
dsv4_jax/pallas_kernels/ (matmul_kernels.py says which calls have a kernel). Activation quantization takes the
Pallas quantize kernels on a kernel backend; they are bit-identical to the jnp definition, so both paths see the
same exact operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..numerics.activations import nvfp4_activation, nvfp4_global_scale
from . import layer_stats
from ..numerics.formats import Fp8BlockWeight, check_weight, dequantize_blocks, is_quantized
from . import act_quantize, choice, matmul_kernels

ACT_QUANT_MODES = ("none", "fp8", "nvfp4")


def _scoped_by_format(matmul):
    """Run `matmul(x, weight, ...)` under a named scope saying the weight's stored format ("fp8_matmul",
    "fp4_matmul", "bf16_matmul"), so profiles and kernel counts (hlo_census) can group the matmuls by kind."""
    @functools.wraps(matmul)
    def scoped(x, weight, *args, **kwargs):
        kind = "fp8" if isinstance(weight, Fp8BlockWeight) else "fp4" if is_quantized(weight) else "bf16"
        with jax.named_scope(f"{kind}_matmul"):
            return matmul(x, weight, *args, **kwargs)
    return scoped


def activation_quantizer(weight, act_quant: str) -> str:
    """Which quantizer an activation meets on its way into `weight` under `act_quant` (table above)."""
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
    if act_quant == "none" or not is_quantized(weight):
        return "none"
    if isinstance(weight, Fp8BlockWeight):
        return "fp8"
    return act_quant


def _nvfp4_activation_global_scale(x: jax.Array, weight, row_groups: jax.Array | None) -> jax.Array:
    """The NVFP4 activation global scale [..., 1]: always the runtime per-row amax / (6 * 448). (A single seam so a
    test can show what the checkpoint's static `input_scale` would do instead; `weight` and `row_groups`, the
    expert of each row in grouped matmuls, exist for that.)"""
    del weight, row_groups
    return nvfp4_global_scale(x)


def _tap_quantization(x: jax.Array, weight, ctx, row_groups=None) -> None:
    """With ctx.stats: tell the layer's statistics (layer_stats.py) what quantizing x for `weight` does to its
    block scales, computed from x beside whichever quantizer runs (nothing is traced without ctx.stats)."""
    if not ctx.stats:
        return
    kind = activation_quantizer(weight, ctx.act_quant)
    x = jax.lax.optimization_barrier(x)                # (the measuring stays out of the model's fusions)
    if kind == "fp8":
        layer_stats.tap_fp8(x)
    elif kind == "nvfp4":
        layer_stats.tap_nvfp4(x, _nvfp4_activation_global_scale(x, weight, row_groups))


def _quantize_input(x: jax.Array, weight, ctx, row_groups=None):
    """(GEMM operand exact in x.dtype, per-row output factor [..., 1] float32 or None); the quantize kernels on a
    kernel backend (bit-identical), the jnp reference otherwise."""
    kind = activation_quantizer(weight, ctx.act_quant)
    _tap_quantization(x, weight, ctx, row_groups)
    if kind == "none":
        return x, None
    if kind == "fp8":
        return act_quantize.fp8_activation(x, ctx), None
    quantized = act_quantize.nvfp4_activation(x, ctx)
    if quantized is not None:
        return quantized
    return nvfp4_activation(x, _nvfp4_activation_global_scale(x, weight, row_groups))


def _rescale(y: jax.Array, row_scale, weight_scale) -> jax.Array:
    """y x (activation global scale x weight global scale), the NVFP4 GEMM epilogue `alpha`."""
    if row_scale is None and weight_scale is None:
        return y
    if row_scale is None:
        return y * weight_scale
    if weight_scale is None:
        return y * row_scale
    return y * (row_scale * weight_scale)


def _check_in_features(x: jax.Array, shape, what: str, ndim: int):
    if len(shape) != ndim:
        raise ValueError(f"{what}: weight must have {ndim} dims, got shape {list(shape)}")
    if x.shape[-1] != shape[-1]:
        raise ValueError(f"{what}: input has {x.shape[-1]} features but the weight {list(shape)} expects {shape[-1]}")


@_scoped_by_format
def linear(x: jax.Array, weight, out_dtype=None, *, ctx) -> jax.Array:
    """y = x @ W^T for W [out, in] in any stored format; fp32 accumulation; returns out_dtype (default x.dtype)."""
    check_weight(weight, "linear weight")
    _check_in_features(x, weight.shape, "linear", 2)
    y = matmul_kernels.prefill_matmul(x.reshape(-1, x.shape[-1]), weight,
                                       activation_quantizer(weight, ctx.act_quant), ctx)
    if y is not None:                      # (the kernel quantizes its input itself)
        _tap_quantization(x, weight, ctx)
        return y.reshape(*x.shape[:-1], weight.shape[0]).astype(out_dtype or x.dtype)
    xq, row_scale = _quantize_input(x, weight, ctx)
    y = matmul_kernels.dense_matmul(xq.reshape(-1, x.shape[-1]), weight, ctx)
    if y is not None:
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return _rescale(y, row_scale, None).astype(out_dtype or x.dtype)
    w, weight_scale = dequantize_blocks(weight, x.dtype)
    y = jnp.einsum("...i,oi->...o", xq, w, preferred_element_type=jnp.float32)
    return _rescale(y, row_scale, weight_scale).astype(out_dtype or x.dtype)


# The LM head's float32 logits (docs/model.md 4.7; the reference upcasts the head to float32) where its rows and the
# stored head are both bf16: a bf16 dot with float32 accumulation forms the same products, exactly, on bf16 tensor
# cores instead of float32 operands. On one H100 the float32 GEMM of a 256-row decode step took 1.24 ms for 0.39 ms
# of bytes (~220 TFLOP/s; docs/performance.md, "Batch 256"). Kernel plans take it (op `head`; `--kernel-override
# head=reference` keeps float32 operands, as the reference plan does); the two differ in float32 rounding only
# (XLA:CPU, for one, sums a bf16 dot in another order).
HEAD_BF16_DOT = choice.Kernel("head", "head_bf16_dot", phases=frozenset({"prefill", "decode", "verify"}))


def head_linear(h: jax.Array, weight, *, ctx) -> jax.Array:
    """float32 logits h [..., D] @ head^T [V, D] for the LM head in any stored format (a converted checkpoint may
    quantize it; its rows are never quantized)."""
    ctx = ctx.without_act_quant()
    both_bf16 = h.dtype == jnp.bfloat16 and not is_quantized(weight) and weight.dtype == jnp.bfloat16
    x = h if choice.takes_kernel(HEAD_BF16_DOT, ctx, both_bf16) else h.astype(jnp.float32)
    return linear(x, weight, jnp.float32, ctx=ctx)


@_scoped_by_format
def linear_pair(x: jax.Array, w_a, w_b, out_dtype=None, *, ctx) -> tuple[jax.Array, jax.Array]:
    """(linear(x, w_a), linear(x, w_b)) for two weights of one input width, e.g. a gate and an up projection, or the
    attention's wq_a and wkv: one kernel launch where the decode kernels of ffi/ take both (decode rows on CUDA; one
    format and shape, or two FP8-block weights of one K), the input quantized once; otherwise two `linear` calls."""
    y = _pair_kernel(x, w_a, w_b, out_dtype, ctx)
    if y is None:
        return linear(x, w_a, out_dtype, ctx=ctx), linear(x, w_b, out_dtype, ctx=ctx)
    n = w_a.shape[0]
    return y[..., :n], y[..., n:]


@_scoped_by_format
def linear_joined(x: jax.Array, w_a, w_b, out_dtype=None, *, ctx) -> jax.Array:
    """linear_pair's two outputs side by side, [..., out_a + out_b], as its kernel writes them: a consumer that is a
    kernel of its own reads its columns in place (a slice handed to a custom call is a copy: one launch more)."""
    y = _pair_kernel(x, w_a, w_b, out_dtype, ctx)
    if y is None:
        return jnp.concatenate([linear(x, w_a, out_dtype, ctx=ctx), linear(x, w_b, out_dtype, ctx=ctx)], axis=-1)
    return y


def _pair_kernel(x: jax.Array, w_a, w_b, out_dtype, ctx) -> jax.Array | None:
    """Both weights' outputs side by side from one kernel launch, or None where no kernel takes the pair."""
    x2 = x.reshape(-1, x.shape[-1])
    for weight in (w_a, w_b):
        check_weight(weight, "linear_pair weight")
        _check_in_features(x, weight.shape, "linear_pair", 2)
    kernel = matmul_kernels.pair_matmul(x2, w_a, w_b, ctx, routed=False)
    if kernel is None:
        return None
    xq, row_scale = _quantize_input(x2, w_a, ctx)
    y = _rescale(kernel(xq, None), row_scale, None).astype(out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], w_a.shape[0] + w_b.shape[0])


def _check_grouped_weight(x: jax.Array, weight, what: str):
    check_weight(weight, f"{what} weight")
    _check_in_features(x, weight.shape, what, 3)


def _row_groups(x: jax.Array, weight, group_sizes, row_groups, what: str,
                in_range: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """(the group of each row of x [m, in], clipped to a valid index; whether the row is real, None: all are). Rows
    sorted by group (`group_sizes`: rows past their sum are not real) or each row's own group (`row_groups`: a group
    >= G, e.g. an expert of another device, is not real; `in_range`: the caller's word that every group is in
    0 .. G-1, so no clip and no zeroing: launches fewer in a decode step)."""
    _check_grouped_weight(x, weight, what)
    n_groups = weight.shape[0]
    if (group_sizes is None) == (row_groups is None):
        raise ValueError(f"{what}: give exactly one of group_sizes (rows sorted by group) and row_groups")
    if in_range:
        if row_groups is None:
            raise ValueError(f"{what}: groups_in_range needs row_groups")
        return row_groups, None
    if row_groups is None:
        groups = jnp.repeat(jnp.arange(n_groups, dtype=jnp.int32), group_sizes, total_repeat_length=x.shape[0])
        real = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    else:
        groups, real = row_groups, row_groups < n_groups
    return jnp.clip(groups, 0, n_groups - 1), real


def _grouped_kernel_output(y: jax.Array, row_scale, real: jax.Array, out_dtype) -> jax.Array:
    """A kernel's grouped-matmul rows, rescaled, with the rows that are not real zeroed (real None: all are)."""
    y = _rescale(y, row_scale, None)
    return (y if real is None else jnp.where(real[:, None], y, 0)).astype(out_dtype)


def _sorted_reference(x: jax.Array, weight, row_groups: jax.Array, out_dtype, ctx) -> jax.Array:
    """grouped_linear of rows in any order on the reference path: sorted by group for ragged_dot, then put back."""
    order = jnp.argsort(row_groups, stable=True)
    sizes = jnp.bincount(row_groups, length=weight.shape[0]).astype(jnp.int32)
    y = grouped_linear(x[order], weight, sizes, out_dtype, ctx=ctx)
    return jnp.zeros_like(y).at[order].set(y)


@_scoped_by_format
def grouped_linear(x: jax.Array, weight, group_sizes: jax.Array | None, out_dtype=None, *, ctx,
                   row_groups: jax.Array | None = None, groups_in_range: bool = False) -> jax.Array:
    """Rows of x [m, in] times W[g]^T of their group g (W [G, out, in], e.g. stacked experts): rows sorted by group
    with `group_sizes` (rows past their sum give zeros), or in any order with each row's group in `row_groups`
    (a group >= G gives zeros; no sort where a per-row kernel takes the call; `groups_in_range`: every group is
    one of W's, _row_groups). Returns [m, out]."""
    groups, real = _row_groups(x, weight, group_sizes, row_groups, "grouped_linear", groups_in_range)
    y = matmul_kernels.prefill_expert_matmul(x, weight, groups, real, activation_quantizer(weight, ctx.act_quant), ctx)
    if y is not None:                      # (the kernel quantizes its input itself)
        _tap_quantization(x, weight, ctx, groups)
        return y.astype(out_dtype or x.dtype)
    if group_sizes is None and matmul_kernels.expert_kernel(x.shape[0], x.dtype, weight, ctx) is None:
        return _sorted_reference(x, weight, row_groups, out_dtype, ctx)
    xq, row_scale = _quantize_input(x, weight, ctx, groups)
    y = matmul_kernels.expert_matmul(xq, weight, groups, ctx, real)
    if y is not None:
        return _grouped_kernel_output(y, row_scale, real, out_dtype or x.dtype)
    w, weight_scale = dequantize_blocks(weight, x.dtype)
    y = jax.lax.ragged_dot(xq, jnp.swapaxes(w, -1, -2), group_sizes, preferred_element_type=jnp.float32)
    if weight_scale is not None:
        weight_scale = weight_scale[groups][:, None]
    return _rescale(y, row_scale, weight_scale).astype(out_dtype or x.dtype)


@_scoped_by_format
def grouped_linear_pair(x: jax.Array, w_a, w_b, group_sizes: jax.Array | None, out_dtype=None, *, ctx,
                        row_groups: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(grouped_linear(x, w_a, ...), grouped_linear(x, w_b, ...)) for two stacked weights of one input width, e.g.
    the routed experts' gate and up projections: one kernel launch where the decode kernels of ffi/ take both (one
    FP4 format and shape, decode rows on CUDA), the input quantized once; otherwise two `grouped_linear` calls."""
    groups, real = _row_groups(x, w_a, group_sizes, row_groups, "grouped_linear_pair")
    _check_grouped_weight(x, w_b, "grouped_linear_pair")
    kernel = matmul_kernels.pair_matmul(x, w_a, w_b, ctx, routed=True)
    if kernel is None:
        return (grouped_linear(x, w_a, group_sizes, out_dtype, ctx=ctx, row_groups=row_groups),
                grouped_linear(x, w_b, group_sizes, out_dtype, ctx=ctx, row_groups=row_groups))
    xq, row_scale = _quantize_input(x, w_a, ctx, groups)
    y = _grouped_kernel_output(kernel(xq, groups, real), row_scale, real, out_dtype or x.dtype)
    n = w_a.shape[1]
    return y[:, :n], y[:, n:]


@_scoped_by_format
def grouped_linear_joined(x: jax.Array, w_a, w_b, out_dtype=None, *, ctx, row_groups: jax.Array) -> jax.Array:
    """grouped_linear_pair's two outputs side by side, [m, out_a + out_b], as its kernel writes them (for a consumer
    that is a kernel of its own: linear_joined), for rows in any order whose groups `row_groups` are all one of
    the weights' (groups_in_range)."""
    groups, _ = _row_groups(x, w_a, None, row_groups, "grouped_linear_joined", in_range=True)
    _check_grouped_weight(x, w_b, "grouped_linear_joined")
    kernel = matmul_kernels.pair_matmul(x, w_a, w_b, ctx, routed=True)
    if kernel is None:
        return jnp.concatenate([grouped_linear(x, w, None, out_dtype, ctx=ctx, row_groups=row_groups,
                                               groups_in_range=True) for w in (w_a, w_b)], axis=-1)
    xq, row_scale = _quantize_input(x, w_a, ctx, groups)
    return _grouped_kernel_output(kernel(xq, groups), row_scale, None, out_dtype or x.dtype)


@_scoped_by_format
def group_linear(x: jax.Array, weight, out_dtype=None, *, ctx) -> jax.Array:
    """Block-diagonal linear (the grouped output projection wo_a): x [..., G, in], W [G * out, in]; group g
    multiplies rows [g * out, (g + 1) * out) of W. Returns [..., G, out]."""
    check_weight(weight, "group_linear weight")
    _check_in_features(x, weight.shape, "group_linear", 2)
    groups, (rows, cols) = x.shape[-2], weight.shape
    if rows % groups:
        raise ValueError(f"group_linear: {rows} weight rows do not split into {groups} groups")
    xq, row_scale = _quantize_input(x, weight, ctx)
    # without an activation scale to apply, the kernel may write out_dtype itself
    y = matmul_kernels.group_matmul(xq.reshape(-1, groups, cols), weight, ctx,
                                     jnp.float32 if row_scale is not None else out_dtype or x.dtype)
    if y is not None:
        y = y.reshape(*x.shape[:-1], rows // groups)
        return _rescale(y, row_scale, None).astype(out_dtype or x.dtype)
    w, weight_scale = dequantize_blocks(weight, x.dtype)
    y = jnp.einsum("...gi,gri->...gr", xq, w.reshape(groups, rows // groups, cols),
                   preferred_element_type=jnp.float32)
    return _rescale(y, row_scale, weight_scale).astype(out_dtype or x.dtype)
