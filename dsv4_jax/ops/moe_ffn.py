"""Mixture of experts (docs/model.md 4.6): sqrt-softplus router (or token-id hash routing), routed experts with clamped
SwiGLU, and the shared expert.

The router never sees a quantized weight: its GEMM is float32. The selection bias only picks experts; the
routing weights are the unbiased scores of the picked experts, renormalised and times route_scale.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..numerics import dequantize
from ..pallas_kernels import moe_decode
from ..sharding import DATA, EXPERT, expert_devices, split_along, splits_shared_expert
from . import choice, layer_stats, matmul_kernels
from .matmul import (activation_quantizer, grouped_linear, grouped_linear_joined, grouped_linear_pair, linear,
                     linear_joined, linear_pair)


class MoeParts(NamedTuple):
    """The MoE's output before its sum, for a consumer that adds it up itself (the next mHC site's kernel,
    pallas_kernels/mhc.py, where the sum costs no launch): routed float32 [..., K, D] (each of a token's K experts,
    times its routing weight) and shared float32 [..., D]. `total` is the sum, in the one order both use."""
    routed: jax.Array
    shared: jax.Array

    def total(self) -> jax.Array:
        """sum over k = 0 .. K-1 of routed, then + shared: float32 [..., D]."""
        y = self.routed[..., 0, :]
        for k in range(1, self.routed.shape[-2]):
            y = y + self.routed[..., k, :]
        return y + self.shared


def router_logits(params: dict, x: jax.Array) -> jax.Array:
    """The router's GEMM, float32 [T, E] (never on a quantized weight)."""
    gate = params["weight"].astype(jnp.float32)
    return jnp.einsum("td,ed->te", x.astype(jnp.float32), gate, precision=jax.lax.Precision.HIGHEST)


@jax.named_scope("router")
def route(params: dict, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array, hash_routed: bool):
    """x [T, D], token_ids [T] -> (expert ids [T, K] int32, weights [T, K] float32)."""
    scores = jnp.sqrt(jax.nn.softplus(router_logits(params, x)))
    if hash_routed:
        expert_ids = params["tid2eid"][token_ids].astype(jnp.int32)
    else:
        _, expert_ids = jax.lax.top_k(scores + params["bias"].astype(jnp.float32), cfg.n_activated_experts)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    total = weights[:, 0]              # summed in order, as pallas_kernels/moe_decode.py sums them
    for k in range(1, weights.shape[-1]):
        total = total + weights[:, k]
    weights = weights / total[:, None] * cfg.route_scale
    return expert_ids, weights


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit), in float32."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(gate) * up


def shared_expert(params: dict, cfg: ModelConfig, x: jax.Array, ctx) -> jax.Array:
    gate, up = linear_pair(x, params["w1"]["weight"], params["w3"]["weight"], jnp.float32, ctx=ctx)
    h = clamped_swiglu(gate, up, cfg.swiglu_limit)
    return linear(h.astype(x.dtype), params["w2"]["weight"], jnp.float32, ctx=ctx)


# A prefill chunk's routed experts on pallas_kernels/moe.moe_ffn (gate / up with the SwiGLU, then the down
# projection, on one slot schedule): opt-in (`--kernel-override moe_ffn=kernel`) until a GPU has timed it.
PREFILL_FFN_KERNELS = choice.Kernel("moe_ffn", "moe_ffn_slots", frozenset({"prefill"}), on_gpu_by_default=False)


def _routed_on_prefill_kernels(params: dict, cfg: ModelConfig, x: jax.Array, expert_ids: jax.Array,
                               weights: jax.Array, n_groups: int, ctx) -> jax.Array | None:
    """_grouped_experts on moe_ffn's two kernels where the plan takes them (PREFILL_FFN_KERNELS; the geometry:
    matmul_kernels.routed_ffn_fits), else None. They run without activation quantization only, so ctx.stats has
    no quantization to tap."""
    w1, w3, w2 = (params[p]["weight"] for p in ("w1", "w3", "w2"))
    if expert_ids.size <= matmul_kernels.MAX_SLOTTED_ROWS:           # a decode or verify step: not asked
        return None
    fits = matmul_kernels.routed_ffn_fits(x, w1, w3, w2, expert_ids.size,
                                          activation_quantizer(w1, ctx.act_quant), ctx)
    if not choice.takes_kernel(PREFILL_FFN_KERNELS, ctx, fits):
        return None
    picks = jnp.where(expert_ids < n_groups, expert_ids, -1)            # n_groups: no expert of this device's
    with jax.named_scope("fp4_matmul"):
        return matmul_kernels.routed_ffn(x, w1, w3, w2, picks, weights, cfg.swiglu_limit, ctx)


def _grouped_experts(params: dict, cfg: ModelConfig, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                     n_groups: int, ctx):
    """The routed rows of x [T, D] grouped by expert for one grouped matmul per projection; expert_ids [T, K] in
    [0, n_groups] (n_groups: not one of these experts, sorted past the groups, so its rows give zeros). Returns
    float32 [T, D]."""
    n_tokens, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    w1, w3, w2 = (params[p]["weight"] for p in ("w1", "w3", "w2"))
    y = _routed_on_prefill_kernels(params, cfg, x, expert_ids, weights, n_groups, ctx)
    if y is not None:
        return y
    if all(matmul_kernels.expert_kernel(n_tokens * k, x.dtype, w, ctx) for w in (w1, w2)):
        # Kernels that take each row's own expert: the rows stay in token order (no sort, no scatter; at decode
        # that is five launches fewer per layer) and each token's K outputs are summed in place.
        xs = jnp.broadcast_to(x[:, None, :], (n_tokens, k, x.shape[-1])).reshape(n_tokens * k, -1)
        gate, up = grouped_linear_pair(xs, w1, w3, None, jnp.float32, ctx=ctx, row_groups=flat_ids)
        h = (clamped_swiglu(gate, up, cfg.swiglu_limit) * weights.reshape(-1)[:, None]).astype(x.dtype)
        y = grouped_linear(h, w2, None, jnp.float32, ctx=ctx, row_groups=flat_ids)
        return jnp.sum(y.reshape(n_tokens, k, -1), axis=1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_ids, length=n_groups).astype(jnp.int32)
    xs = x[token_of]
    gate, up = grouped_linear_pair(xs, w1, w3, group_sizes, jnp.float32, ctx=ctx)
    h = clamped_swiglu(gate, up, cfg.swiglu_limit) * weights.reshape(-1)[order][:, None]
    y = grouped_linear(h.astype(x.dtype), w2, group_sizes, jnp.float32, ctx=ctx)
    return jnp.zeros((n_tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)


@jax.named_scope("routed_experts")
def routed_experts(params: dict, cfg: ModelConfig, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, ctx,
                   shared: dict | None = None):
    """Sum over each token's K experts of weight * expert(x), plus the shared expert of `shared` (its params) if
    given; expert_ids in [0, E], where E is no expert (a pick that adds nothing and reads no weight). Returns
    float32 [T, D].

    On a mesh whose "expert" axis splits the experts (sharding.py) each device runs, inside shard_map on its local
    shards (so the kernels see local shapes and no weight is gathered), the rows routed to its own E / n experts,
    and with `shared` its slice of the shared expert's hidden units (sharding.splits_shared_expert); one psum over
    the axis adds the partial outputs."""
    mesh = ctx.mesh
    if mesh is None or mesh.shape[EXPERT] == 1:
        y = _grouped_experts(params, cfg, x, expert_ids, weights, cfg.n_routed_experts, ctx)
        return y if shared is None else y + shared_expert(shared, cfg, x, ctx)
    n_local = cfg.n_routed_experts // mesh.shape[EXPERT]

    def local(params, shared, x, expert_ids, weights):
        with layer_stats.collecting() as taps:       # (ctx.stats: the matmuls' quantization, summed over devices)
            ids = expert_ids - jax.lax.axis_index(EXPERT) * n_local
            ids = jnp.where((ids >= 0) & (ids < n_local), ids, n_local)       # another device's expert
            y = _grouped_experts(params, cfg, x, ids, weights, n_local, ctx)
            if shared is not None:
                y = y + shared_expert(shared, cfg, x, ctx)                    # this device's hidden units
        y = jax.lax.psum(y, EXPERT)
        if not ctx.stats:
            return y
        return y, layer_stats.across_devices(taps, (DATA, EXPERT))      # rows differ along DATA too

    expert_shards = split_along(params, 0)
    shared_shards = None if shared is None else {name: split_along(shared[name], 1 if name == "w2" else 0)
                                                 for name in ("w1", "w3", "w2")}     # w1 / w3 rows, w2 inputs
    rows = P(DATA, None)
    y = jax.shard_map(local, mesh=mesh, in_specs=(expert_shards, shared_shards, rows, rows, rows),
                      out_specs=(rows, P()) if ctx.stats else rows, check_vma=False)(
        params, shared, x, expert_ids, weights)
    if not ctx.stats:
        return y
    layer_stats.record(y[1])
    return y[0]


@jax.named_scope("routed_experts")
def capacity_routed_experts(params: dict, cfg: ModelConfig, x: jax.Array, expert_ids: jax.Array,
                            weights: jax.Array, capacity_factor: float):
    """routed_experts as one batched matmul over fixed-size per-expert slots (GShard-style capacity
    C = ceil(factor * T * K / E); assignments past an expert's capacity, in token order, are dropped), on the
    dequantized weights. For training (run_context.Training.moe_capacity): on the CPU, lax.ragged_dot runs every
    expert over every row (~E times the work); with balanced routing almost nothing is dropped."""
    n_tokens, k = expert_ids.shape
    n_exp = cfg.n_routed_experts
    cap = max(1, math.ceil(capacity_factor * n_tokens * k / n_exp))
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    sizes = jnp.bincount(flat, length=n_exp)
    rank = jnp.arange(flat.shape[0]) - (jnp.cumsum(sizes) - sizes)[sorted_ids]   # place within its expert
    keep = rank < cap
    slot = jnp.where(keep, sorted_ids * cap + rank, n_exp * cap)                 # n_exp * cap: dropped
    token_of = order // k
    xs = jnp.zeros((n_exp * cap, x.shape[-1]), x.dtype).at[slot].set(x[token_of], mode="drop")
    ws = jnp.zeros((n_exp * cap,), jnp.float32).at[slot].set(weights.reshape(-1)[order], mode="drop")
    xs = xs.reshape(n_exp, cap, -1)
    w1, w3, w2 = (dequantize(params[p]["weight"], x.dtype) for p in ("w1", "w3", "w2"))
    gate = jnp.einsum("ecd,eid->eci", xs, w1, preferred_element_type=jnp.float32)
    up = jnp.einsum("ecd,eid->eci", xs, w3, preferred_element_type=jnp.float32)
    h = clamped_swiglu(gate, up, cfg.swiglu_limit) * ws.reshape(n_exp, cap, 1)
    y = jnp.einsum("eci,edi->ecd", h.astype(x.dtype), w2, preferred_element_type=jnp.float32)
    y = y.reshape(n_exp * cap, -1)[jnp.minimum(slot, n_exp * cap - 1)] * keep[:, None]
    return jnp.zeros((n_tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)


MAX_KERNEL_TOKENS = 16     # tokens up to which a decode or verify step takes _ffn_on_kernels
FFN_KERNELS = choice.Kernel("moe_ffn", "moe_decode")


def _takes_ffn_kernels(params: dict, cfg: ModelConfig, x: jax.Array, ctx) -> bool:
    """Whether a call on rows x [T, D] runs on _ffn_on_kernels (ops/choice.py): a decode or verify step of at most
    MAX_KERNEL_TOKENS tokens (beyond, the sorted rows share each expert's read), one device's experts (or an expert
    axis of 1), a geometry pallas_kernels/moe_decode.py takes, and per-row expert kernels for the routed rows (as
    _grouped_experts' unsorted path needs)."""
    rows = x.shape[0] * cfg.n_activated_experts
    experts = params["experts"]
    fits = (x.shape[0] <= MAX_KERNEL_TOKENS
            and (ctx.mesh is None or ctx.mesh.shape[EXPERT] == 1)
            and moe_decode.supported(cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim)
            and cfg.n_shared_experts == 1
            and all(matmul_kernels.expert_kernel(rows, x.dtype, experts[w]["weight"], ctx) for w in ("w1", "w2")))
    return choice.takes_kernel(FFN_KERNELS, ctx, fits)


def _ffn_on_kernels(params: dict, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array, hash_routed: bool,
                    ctx, real: jax.Array | None = None) -> tuple[MoeParts, jax.Array]:
    """The MoE of a decode or verify step, x [T, D]: the router's GEMV, then pallas_kernels/moe_decode.py for the
    top-k, weights and each pick's row of x (one launch), the routed and the shared gate + up GEMVs, both SwiGLUs
    in one launch, and the two down GEMVs. The sum of the parts is left to the consumer (MoeParts). Every expert
    id comes from the router, so the grouped matmuls skip their range clip (groups_in_range). Returns (the parts,
    the expert ids [T, K]).

    `real` [T] (None: all): a token that is not real (a row of the batch that is not generating) takes the first
    real token's input, so it picks that token's experts, which the step reads anyway, instead of its own; its
    outputs are never used. (The kernels write every row, so a row without an expert would leave garbage.) Not on
    a mesh that splits the rows (DATA): there the first real row may be another device's."""
    if real is not None and (ctx.mesh is None or ctx.mesh.shape[DATA] == 1):
        source = jnp.where(real, jnp.arange(x.shape[0]), jnp.argmax(real))
        x, token_ids = x[source], token_ids[source]
    interpret = ctx.kernels.interpret
    gate = params["gate"]
    k = cfg.n_activated_experts
    with jax.named_scope("router"):
        picks = dict(hash_ids=gate["tid2eid"][token_ids]) if hash_routed else dict(bias=gate["bias"])
        expert_ids, weights, rows = moe_decode.route_rows(router_logits(gate, x), x, k=k,
                                                          route_scale=cfg.route_scale, interpret=interpret, **picks)
    experts, shared = params["experts"], params["shared_experts"]
    row_experts = expert_ids.reshape(-1)
    with jax.named_scope("routed_experts"):
        gate_up = grouped_linear_joined(rows, experts["w1"]["weight"], experts["w3"]["weight"], jnp.float32,
                                        ctx=ctx, row_groups=row_experts)
        shared_gate_up = linear_joined(x, shared["w1"]["weight"], shared["w3"]["weight"], jnp.float32, ctx=ctx)
        h, shared_h = moe_decode.swiglu_pairs(gate_up, weights.reshape(-1), shared_gate_up,
                                              limit=cfg.swiglu_limit, dtype=x.dtype, interpret=interpret)
        y = grouped_linear(h, experts["w2"]["weight"], None, jnp.float32, ctx=ctx, row_groups=row_experts,
                           groups_in_range=True)
        shared_y = linear(shared_h, shared["w2"]["weight"], jnp.float32, ctx=ctx)
    return MoeParts(y.reshape(x.shape[0], k, -1), shared_y), expert_ids


def moe(params: dict, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array, hash_routed: bool, ctx,
        real: jax.Array | None = None):
    """x [..., D] (ffn_norm'd), token_ids [...] -> (the output, statistics: {} for inference; under training
    {"expert_load": assignments per expert [E]} in score-routed layers; with ctx.stats also "expert_ids" [T, K] and
    "router_logits" [T, E] of the rows x flattened, for ops/layer_stats.py). The output is [..., D] in x.dtype, or, in a
    decode or verify step on a kernel plan (_ffn_on_kernels), its unsummed MoeParts ([..., K, D] and [..., D]),
    which the next mHC site (ops/mhc_site.py) takes as y.

    `real` [...] bool (None: every token is): the tokens whose output is kept. The others (a chunk's padding, the
    rows of a batch that are not generating) go to no routed expert on the grouped path, so the experts only they
    picked are not read; their output is then the shared expert's alone (it is never used). On the decode kernels'
    path (at most MAX_KERNEL_TOKENS tokens) they take the first real token's experts instead (_ffn_on_kernels)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if _takes_ffn_kernels(params, cfg, x2, ctx):
        parts, expert_ids = _ffn_on_kernels(params, cfg, x2, token_ids.reshape(-1), hash_routed, ctx,
                                            None if real is None else real.reshape(-1))
        return (MoeParts(parts.routed.reshape(*lead, *parts.routed.shape[1:]), parts.shared.reshape(*lead, -1)),
                _routing_stats(params, x2, expert_ids, ctx))
    expert_ids, weights = route(params["gate"], cfg, x2, token_ids.reshape(-1), hash_routed)
    # the experts the grouped matmuls run: cfg.n_routed_experts is none of them (routed_experts gives it zeros)
    run_ids = expert_ids if real is None else jnp.where(real.reshape(-1, 1), expert_ids, cfg.n_routed_experts)
    training = ctx.training
    if training is not None and training.moe_capacity > 0:
        if ctx.mesh is not None and ctx.mesh.shape[EXPERT] > 1:
            raise NotImplementedError("capacity-slot experts (Training.moe_capacity) on an expert-split mesh")
        y = capacity_routed_experts(params["experts"], cfg, x2, expert_ids, weights, training.moe_capacity)
        y = y + shared_expert(params["shared_experts"], cfg, x2, ctx)
    elif splits_shared_expert(cfg, expert_devices(ctx.mesh)):
        # the shared expert's hidden units are split over the devices too: its partial outputs join the MoE psum
        y = routed_experts(params["experts"], cfg, x2, run_ids, weights, ctx, shared=params["shared_experts"])
    else:
        y = routed_experts(params["experts"], cfg, x2, run_ids, weights, ctx)
        y = y + shared_expert(params["shared_experts"], cfg, x2, ctx)
    stats = _routing_stats(params, x2, expert_ids, ctx)
    if training is not None and not hash_routed:
        stats["expert_load"] = jnp.bincount(expert_ids.reshape(-1), length=cfg.n_routed_experts)
    return y.astype(x.dtype).reshape(*lead, x.shape[-1]), stats


def _routing_stats(params: dict, x2: jax.Array, expert_ids: jax.Array, ctx) -> dict:
    """With ctx.stats the routing a layer's statistics read (ops/layer_stats.py); {} otherwise."""
    if not ctx.stats:
        return {}
    x2 = jax.lax.optimization_barrier(x2)              # (recomputed apart from the model's own router)
    return {"expert_ids": expert_ids, "router_logits": router_logits(params["gate"], x2)}
