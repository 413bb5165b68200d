"""The DeepSeek-V4 transformer as pure functions over explicit pytrees (params, per-layer caches).

embed -> hc_mult residual streams -> blocks (mHC-wrapped attention, mHC-wrapped MoE) -> hc head -> norm ->
float32 logits; plus the MTP block (spec 4.8). Every function works on a chunk of S tokens at per-sequence
positions start[b] + i, of which the first n_valid[b] are real; the caches carry everything earlier.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers.attention import attention
from .layers.hyper import hc_head, hc_post, hc_pre
from .layers.moe import moe
from .layers.norm import rms_norm
from .layers.rope import rope_inv_freq
from .quant import linear
from .quant.kernel_dispatch import KERNEL_MODES
from .quant.linear import ACT_QUANT_MODES

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Numerics switches (design.md "Numerics modes"); static under jit."""
    dtype: str = "bfloat16"
    simulate_quant: bool = True
    act_quant: str = "none"
    kernels: str = "auto"       # GPU kernels or the pure-jnp reference for quantized matmuls (quant/kernel_dispatch.py)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.act_quant not in ACT_QUANT_MODES:
            raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {self.act_quant!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]


def block(params: dict, cfg: ModelConfig, opts: RunOptions, layer: int, X: jax.Array, token_ids: jax.Array,
          start: jax.Array, n_valid: jax.Array, cache: dict):
    """One transformer block on streams X [B, S, n, D]. Returns (X, cache)."""
    ratio = cfg.compress_ratios[layer]
    u, post, comb = hc_pre(X, params["hc_attn_fn"], params["hc_attn_base"], params["hc_attn_scale"], cfg)
    x = rms_norm(u, params["attn_norm"]["weight"], cfg.norm_eps)
    y, cache = attention(params["attn"], cfg, ratio, x, start, n_valid, cache, rope_inv_freq(cfg, ratio),
                         opts.simulate_quant, act_quant=opts.act_quant, kernels=opts.kernels)
    X = hc_post(y, X, post, comb)
    u, post, comb = hc_pre(X, params["hc_ffn_fn"], params["hc_ffn_base"], params["hc_ffn_scale"], cfg)
    x = rms_norm(u, params["ffn_norm"]["weight"], cfg.norm_eps)
    y = moe(params["ffn"], cfg, x, token_ids, hash_routed=cfg.is_hash_layer(layer), act_quant=opts.act_quant,
            kernels=opts.kernels)
    return hc_post(y, X, post, comb), cache


def embed(params: dict, cfg: ModelConfig, tokens: jax.Array, dtype) -> jax.Array:
    """tokens [B, S] -> hc_mult identical copies of the embedding, X [B, S, n, D]."""
    e = params["embed"]["weight"][tokens].astype(dtype)
    return jnp.broadcast_to(e[:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.dim))


def backbone(params: dict, cfg: ModelConfig, opts: RunOptions, tokens: jax.Array, start: jax.Array,
             n_valid: jax.Array, caches: list):
    """All backbone layers. Returns (final streams X [B, S, n, D] before the hc head, new caches)."""
    X = embed(params, cfg, tokens, opts.jnp_dtype)
    new_caches = []
    for layer in range(cfg.n_layers):
        X, cache = block(params["layers"][layer], cfg, opts, layer, X, tokens, start, n_valid, caches[layer])
        new_caches.append(cache)
    return X, new_caches


def head_logits(params: dict, head_params: dict, cfg: ModelConfig, X: jax.Array, kernels: str = "auto") -> jax.Array:
    """hc head collapse -> final RMSNorm -> float32 logits. `head_params` holds hc_head_* and norm (the main
    model's or the MTP block's); the output matrix is always the shared `head`."""
    h = hc_head(X, head_params["hc_head_fn"], head_params["hc_head_base"], head_params["hc_head_scale"], cfg)
    h = rms_norm(h, head_params["norm"]["weight"], cfg.norm_eps)
    return linear(h.astype(jnp.float32), params["head"]["weight"], jnp.float32, kernels=kernels)


def mtp_streams(params: dict, cfg: ModelConfig, opts: RunOptions, X_main: jax.Array, next_tokens: jax.Array,
                start: jax.Array, n_valid: jax.Array, cache: dict, k: int = 0):
    """MTP block k (spec 4.8) up to its residual streams: at position i it reads the main streams of i and the
    embedding of token i+1 (`next_tokens`). Returns (streams [B, S, n, D], cache)."""
    p = params["mtp"][k]
    dtype = opts.jnp_dtype
    e = rms_norm(params["embed"]["weight"][next_tokens].astype(dtype), p["enorm"]["weight"], cfg.norm_eps)
    h = rms_norm(X_main.astype(dtype), p["hnorm"]["weight"], cfg.norm_eps)
    mode = dict(act_quant=opts.act_quant, kernels=opts.kernels)
    X = linear(h, p["h_proj"]["weight"], **mode) + linear(e, p["e_proj"]["weight"], **mode)[:, :, None, :]
    return block(p, cfg, opts, cfg.n_layers + k, X, next_tokens, start, n_valid, cache)


def mtp_block(params: dict, cfg: ModelConfig, opts: RunOptions, X_main: jax.Array, next_tokens: jax.Array,
              start: jax.Array, n_valid: jax.Array, cache: dict, k: int = 0):
    """MTP block k with its head: logits [B, S, V] float32 predicting token i+2 at position i, and the cache."""
    X, cache = mtp_streams(params, cfg, opts, X_main, next_tokens, start, n_valid, cache, k)
    return head_logits(params, params["mtp"][k], cfg, X, opts.kernels), cache
