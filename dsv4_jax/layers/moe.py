"""Mixture of experts (spec 4.6): sqrt-softplus router (or token-id hash routing), routed experts with clamped
SwiGLU, and the shared expert.

The router never sees a quantized weight: its GEMM is float32. The selection bias only picks experts; the
routing weights are the unbiased scores of the picked experts, renormalised and times route_scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..quant import grouped_linear, grouped_linear_pair, linear, linear_pair


def route(params: dict, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array, hash_routed: bool):
    """x [T, D], token_ids [T] -> (expert ids [T, K] int32, weights [T, K] float32)."""
    gate = params["weight"].astype(jnp.float32)
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), gate, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if hash_routed:
        expert_ids = params["tid2eid"][token_ids].astype(jnp.int32)
    else:
        _, expert_ids = jax.lax.top_k(scores + params["bias"].astype(jnp.float32), cfg.n_activated_experts)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * cfg.route_scale
    return expert_ids, weights


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit), in float32."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(gate) * up


def shared_expert(params: dict, cfg: ModelConfig, x: jax.Array, act_quant: str = "none",
                  kernels: str = "auto") -> jax.Array:
    mode = dict(act_quant=act_quant, kernels=kernels)
    gate, up = linear_pair(x, params["w1"]["weight"], params["w3"]["weight"], jnp.float32, **mode)
    h = clamped_swiglu(gate, up, cfg.swiglu_limit)
    return linear(h.astype(x.dtype), params["w2"]["weight"], jnp.float32, **mode)


def routed_experts(params: dict, cfg: ModelConfig, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                   act_quant: str = "none", kernels: str = "auto"):
    """Sum over each token's K experts of weight * expert(x); tokens are grouped by expert for one grouped matmul
    per projection. Returns float32 [T, D]."""
    n_tokens, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_ids, length=cfg.n_routed_experts).astype(jnp.int32)
    xs = x[token_of]
    mode = dict(act_quant=act_quant, kernels=kernels)
    gate, up = grouped_linear_pair(xs, params["w1"]["weight"], params["w3"]["weight"], group_sizes, jnp.float32,
                                   **mode)
    h = clamped_swiglu(gate, up, cfg.swiglu_limit) * weights.reshape(-1)[order][:, None]
    y = grouped_linear(h.astype(x.dtype), params["w2"]["weight"], group_sizes, jnp.float32, **mode)
    return jnp.zeros((n_tokens, x.shape[-1]), jnp.float32).at[token_of].add(y)


def moe(params: dict, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array, hash_routed: bool,
        act_quant: str = "none", kernels: str = "auto") -> jax.Array:
    """x [..., D] (ffn_norm'd), token_ids [...] -> [..., D] in x.dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    expert_ids, weights = route(params["gate"], cfg, x2, token_ids.reshape(-1), hash_routed)
    y = routed_experts(params["experts"], cfg, x2, expert_ids, weights, act_quant, kernels)
    y = y + shared_expert(params["shared_experts"], cfg, x2, act_quant, kernels)
    return y.astype(x.dtype).reshape(*lead, x.shape[-1])
