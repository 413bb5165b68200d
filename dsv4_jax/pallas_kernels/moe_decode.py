"""The MoE's small steps around its expert GEMVs in a decode or verify step, one launch each (Pallas, GPU):

    ids, weights, rows = route_rows(logits, x, k=6, route_scale=1.5, bias=bias)     # or hash_ids=tid2eid[tokens]
    h, h_shared = swiglu_pairs(gate_up, row_weights, shared_gate_up, limit=10.0, dtype=jnp.bfloat16)

`route_rows` finishes the router after its GEMV (XLA's, float32 logits [T, E]): the sqrt-softplus scores, the top-k
of score + bias (or the hash layer's given experts), the routing weights (the picked scores over their sum, times
route_scale) and each token's input copied once per pick, the rows of the routed experts' GEMV ([T * K, D], token t's
picks in rows t K .. t K + K - 1). XLA needed four launches for that (bias add, top-k, the clip of the ids for the
GEMV, the broadcast of x to the rows). Top-k is K passes of a maximum over the E scores, the lowest index among
equal values first, as lax.top_k orders them.

`swiglu_pairs` is the clamped SwiGLU of the routed experts (times each row's routing weight) and of the shared
expert, both rounded to the activation dtype for their down projections: one launch where XLA took one each. Its
inputs are the pair GEMVs' outputs as written, gate products in columns 0 .. F, up products in F .. 2F (a slice
handed to a custom call would be a copy).

Numerics follow ops/moe_ffn.py (`route`, `clamped_swiglu`) operation for operation in float32; the weights' sum runs
k = 0 .. K-1 in order there too. Triton needs power-of-two tensor shapes: E a power of two, D and F split into
power-of-two chunks; the K picks are stored one lane at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .tiles import is_pow2, pow2_divisor, scalar

_F32 = jnp.float32
CHUNK = 1024         # columns per load (x in route_rows, F in swiglu_pairs)


def supported(n_experts: int, k: int, dim: int, inter_dim: int) -> bool:
    """Whether the kernels take this geometry: E a power of two >= k, D and F multiples of 16."""
    return is_pow2(n_experts) and 1 <= k <= n_experts and dim % 16 == 0 and inter_dim % 16 == 0


def _route_kernel(*refs, k: int, route_scale: float, hash_routed: bool, chunk: int):
    logits_ref, pick_ref, x_ref, ids_ref, weights_ref, rows_ref = refs
    logits = logits_ref[0, :]                                          # [E]
    n_experts = logits.shape[0]
    scores = jnp.sqrt(jax.nn.softplus(logits))
    lane = jax.lax.iota(jnp.int32, n_experts)
    picks = []
    if hash_routed:                                                    # pick_ref: this token's K experts
        picks = [scalar(pick_ref, 0, j) for j in range(k)]
    else:                                                              # pick_ref: the selection bias [E]
        biased = scores + pick_ref[...]
        for _ in range(k):
            best = jnp.max(biased)
            pick = jnp.min(jnp.where(biased == best, lane, n_experts))   # the lowest index among equals
            picks.append(pick)
            biased = jnp.where(lane == pick, -jnp.inf, biased)
    picked = [jnp.sum(jnp.where(lane == pick, scores, 0.0)) for pick in picks]
    total = picked[0]
    for w in picked[1:]:
        total = total + w
    for j, (pick, w) in enumerate(zip(picks, picked)):
        ids_ref[0, pl.ds(j, 1)] = jnp.full((1,), pick, jnp.int32)
        weights_ref[0, pl.ds(j, 1)] = jnp.full((1,), w / total * route_scale, _F32)
    for c in range(x_ref.shape[-1] // chunk):
        x = x_ref[0, pl.ds(c * chunk, chunk)]
        for j in range(k):
            rows_ref[j, pl.ds(c * chunk, chunk)] = x


def route_rows(logits: jax.Array, x: jax.Array, *, k: int, route_scale: float, bias: jax.Array | None = None,
               hash_ids: jax.Array | None = None, interpret: bool = False):
    """The router after its GEMV: logits float32 [T, E], x [T, D] -> (expert ids int32 [T, K], routing weights
    float32 [T, K], rows [T * K, D] in x's dtype: x[t] in rows t K .. t K + K - 1). Score-routed with `bias` [E]
    (top-k of sqrt(softplus(logits)) + bias), hash-routed with `hash_ids` [T, K] (the token's experts)."""
    n_tokens, n_experts = logits.shape
    dim = x.shape[-1]
    if (bias is None) == (hash_ids is None):
        raise ValueError("route_rows: give exactly one of bias (score routing) and hash_ids (hash routing)")
    if not supported(n_experts, k, dim, 16) or x.shape[0] != n_tokens:
        raise ValueError(f"route_rows: needs a power-of-two number of experts >= k, D a multiple of 16 and one x row "
                         f"per token; got logits {logits.shape}, x {x.shape}, k {k}")
    hash_routed = hash_ids is not None
    if hash_routed:
        pick_arg, pick_spec = hash_ids.astype(jnp.int32), pl.BlockSpec((1, k), lambda t: (t, 0))
    else:
        pick_arg, pick_spec = bias.astype(_F32), pl.BlockSpec((n_experts,), lambda t: (0,))
    kernel = functools.partial(_route_kernel, k=k, route_scale=float(route_scale), hash_routed=hash_routed,
                               chunk=pow2_divisor(dim, CHUNK))
    return pl.pallas_call(
        kernel, grid=(n_tokens,),
        in_specs=[pl.BlockSpec((1, n_experts), lambda t: (t, 0)), pick_spec, pl.BlockSpec((1, dim), lambda t: (t, 0))],
        out_specs=[pl.BlockSpec((1, k), lambda t: (t, 0)), pl.BlockSpec((1, k), lambda t: (t, 0)),
                   pl.BlockSpec((k, dim), lambda t: (t, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_tokens, k), jnp.int32), jax.ShapeDtypeStruct((n_tokens, k), _F32),
                   jax.ShapeDtypeStruct((n_tokens * k, dim), x.dtype)],
        interpret=interpret, name="moe_route_rows",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(logits.astype(_F32), pick_arg, x)


def _swiglu(gate, up, limit: float):
    """ops/moe_ffn.py clamped_swiglu on float32 chunks."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _swiglu_kernel(gate_ref, up_ref, weight_ref, shared_gate_ref, shared_up_ref, h_ref, shared_h_ref, *,
                   n_routed: int, limit: float):
    row = pl.program_id(0)

    @pl.when(row < n_routed)
    def _():
        weight = scalar(weight_ref)
        h_ref[0, :] = (_swiglu(gate_ref[0, :], up_ref[0, :], limit) * weight).astype(h_ref.dtype)

    @pl.when(row >= n_routed)
    def _():
        shared_h_ref[0, :] = _swiglu(shared_gate_ref[0, :], shared_up_ref[0, :], limit).astype(shared_h_ref.dtype)


def swiglu_pairs(gate_up: jax.Array, row_weights: jax.Array, shared_gate_up: jax.Array, *, limit: float, dtype,
                 interpret: bool = False):
    """gate_up float32 [R, 2F] (the routed rows' gate | up products), row_weights float32 [R] (each row's routing
    weight), shared_gate_up float32 [T, 2F] (the shared expert's) -> (clamped_swiglu(gate, up) * weight [R, F],
    clamped_swiglu(shared gate, up) [T, F]), both in `dtype`. One program per row and column chunk."""
    n_routed, two_f = gate_up.shape
    n_shared = shared_gate_up.shape[0]
    f = two_f // 2
    if two_f % 32 or shared_gate_up.shape[1] != two_f or row_weights.shape != (n_routed,):
        raise ValueError(f"swiglu_pairs: needs [R, 2F] and [T, 2F] with F a multiple of 16 (one hidden width for the "
                         f"routed and the shared expert) and [R] weights; got {gate_up.shape}, "
                         f"{shared_gate_up.shape}, {row_weights.shape}")
    chunk = pow2_divisor(f, CHUNK)
    routed_row = lambda r: jnp.minimum(r, n_routed - 1)            # noqa: E731  (clamped for the other kind's
    shared_row = lambda r: jnp.maximum(r - n_routed, 0)            # noqa: E731   programs, which never touch them)
    gate_spec = lambda row: pl.BlockSpec((1, chunk), lambda r, c: (row(r), c))               # noqa: E731
    up_spec = lambda row: pl.BlockSpec((1, chunk), lambda r, c: (row(r), f // chunk + c))    # noqa: E731
    in_specs = [gate_spec(routed_row), up_spec(routed_row), pl.BlockSpec((1,), lambda r, c: (routed_row(r),)),
                gate_spec(shared_row), up_spec(shared_row)]
    out_specs = [gate_spec(routed_row), gate_spec(shared_row)]
    kernel = functools.partial(_swiglu_kernel, n_routed=n_routed, limit=float(limit))
    return pl.pallas_call(
        kernel, grid=(n_routed + n_shared, f // chunk), in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((n_routed, f), dtype), jax.ShapeDtypeStruct((n_shared, f), dtype)],
        interpret=interpret, name="moe_swiglu_pairs",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
            gate_up.astype(_F32), gate_up.astype(_F32), row_weights.astype(_F32), shared_gate_up.astype(_F32),
            shared_gate_up.astype(_F32))
