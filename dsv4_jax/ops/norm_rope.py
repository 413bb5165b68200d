"""RMSNorm (docs/model.md 3.1) and interleaved, partial, trailing RoPE with the two DeepSeek-V4 tables (docs/model.md
3.4), and the per-row norm + RoPE + rounding op of the attention's inputs, whose kernel is pallas_kernels/norm_rope.py.

RMSNorm is computed in float32 and cast back to the input dtype.

Pairs (x[2i], x[2i+1]) of the LAST `rope_head_dim` dims rotate; never Llama's rotate_half pairing.
Window-only layers (ratio 0) use theta = rope_theta without YaRN; compressed layers use compress_rope_theta with
YaRN frequency blending. No mscale: cos/sin have amplitude 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..numerics.fake_quant import fp4_fake_quant, fp8_fake_quant, hadamard, trained_rounding
from ..pallas_kernels import norm_rope as pallas_norm_rope
from . import choice
from .matmul import linear, linear_joined, linear_pair


@jax.named_scope("norm")
def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, ratio: int) -> np.ndarray:
    """Per-pair angular frequencies f'_i (float32 [rope_head_dim/2]) of a layer with compression `ratio`."""
    dim = cfg.rope_head_dim
    theta = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if ratio == 0:
        return freqs.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    freqs = freqs * (1 - ramp) + freqs / cfg.rope_factor * ramp
    return freqs.astype(np.float32)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the trailing 2*len(inv_freq) dims of x at `positions` (broadcastable to x.shape[:-1])."""
    rope_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    pairs = rope.reshape(*rope.shape[:-1], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)


ROWS_KERNEL = choice.Kernel("norm_rope", "norm_rope")


def takes_kernel(cfg: ModelConfig, ctx) -> bool:
    """Whether the attention's per-row norms, RoPE and roundings run on pallas_kernels/norm_rope.py: a decode or
    verify step (prefill chunks keep XLA's fusions) and the widths it takes (the query latent's, and the keys' with
    their FP8 rounding). One answer for all of a layer's rows, so that the query comes ready for the attention
    kernel (ops/attention_core.py) exactly when the keys do."""
    fits = (pallas_norm_rope.supported(cfg.q_lora_rank)
            and pallas_norm_rope.supported(cfg.head_dim, cfg.rope_head_dim, ctx.simulate_quant))
    return choice.takes_kernel(ROWS_KERNEL, ctx, fits)


def _kv_fake_quant(kv: jax.Array, nope_dim: int, ctx) -> jax.Array:
    return jnp.concatenate([trained_rounding(fp8_fake_quant, kv[..., :nope_dim], ctx), kv[..., nope_dim:]], axis=-1)


def latents_and_keys(params: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
                     ctx, ring=None, n_valid: jax.Array | None = None):
    """The query latent [B, S, q_lora_rank] (wq_a, q_norm) and the chunk's keys [B, S, head_dim] (wkv, kv_norm,
    RoPE, the FP8 rounding of the nope dims) of x, both in x's dtype; wq_a and wkv read x in one launch where a
    decode kernel takes the pair. Returns (q_latent, kv, ring_written): with `ring` (the window ring before the
    chunk, for a committed chunk) and one token per sequence in a ring stored plainly in x's dtype, the kernel
    also writes the new key into its ring slot in place and returns that ring (the slot held position t - window,
    which no query of this chunk sees: attention may read the ring after the write); else ring_written is None."""
    dtype = x.dtype
    if not takes_kernel(cfg, ctx):
        q_a, kv_a = linear_pair(x, params["wq_a"]["weight"], params["wkv"]["weight"], ctx=ctx)
        q_latent = rms_norm(q_a, params["q_norm"]["weight"], cfg.norm_eps)
        kv = apply_rope(rms_norm(kv_a, params["kv_norm"]["weight"], cfg.norm_eps), positions, inv_freq)
        if ctx.simulate_quant:
            kv = _kv_fake_quant(kv, cfg.nope_head_dim, ctx)
        return q_latent, kv, None
    # one launch per norm, each reading its columns of the pair's float32 output in place and rounding them to
    # dtype (a slice handed to a kernel would be a copy); the keys are also rotated and fake-quantized there
    q_a_kv_a = linear_joined(x, params["wq_a"]["weight"], params["wkv"]["weight"], jnp.float32, ctx=ctx)
    rank, interpret = cfg.q_lora_rank, ctx.kernels.interpret
    q_latent = pallas_norm_rope.rms_norm_rows(q_a_kv_a, params["q_norm"]["weight"], eps=cfg.norm_eps, in_dtype=dtype,
                                              columns=(0, rank), interpret=interpret)
    key_norm = functools.partial(pallas_norm_rope.rms_norm_rows, q_a_kv_a, params["kv_norm"]["weight"],
                                 eps=cfg.norm_eps, in_dtype=dtype, rope=(positions, inv_freq),
                                 fp8_nope=ctx.simulate_quant, columns=(rank, cfg.head_dim), interpret=interpret)
    buffer = None if ring is None else ring.plain(dtype)
    if buffer is not None and x.shape[1] == 1:
        kv, buffer = key_norm(ring=(buffer, n_valid))
        return q_latent, kv, ring.replace(values=buffer)
    return q_latent, key_norm(), None


def queries(params: dict, cfg: ModelConfig, q_latent: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
            ctx) -> jax.Array:
    """The rotated per-head queries [B, S, n_heads, head_dim] of q_latent (wq_b, per-head RMS norm, RoPE); on the
    kernel, the norm and RoPE in one launch of pallas_kernels/norm_rope.py on wq_b's float32 output."""
    batch, seq, _ = q_latent.shape
    if takes_kernel(cfg, ctx):
        q = linear(q_latent, params["wq_b"]["weight"], jnp.float32, ctx=ctx)
        return pallas_norm_rope.rms_norm_rows(q.reshape(batch, seq, cfg.n_heads, cfg.head_dim), None, eps=cfg.norm_eps,
                                       in_dtype=q_latent.dtype, rope=(positions, inv_freq),
                                       interpret=ctx.kernels.interpret)
    q = linear(q_latent, params["wq_b"]["weight"], ctx=ctx).reshape(batch, seq, cfg.n_heads, cfg.head_dim)
    q32 = q.astype(jnp.float32)
    # rms_norm's arithmetic with its per-head factor kept apart (a barrier), so that XLA scales, rounds and rotates
    # the queries in one pass over them, not a normalising pass and a rotating pass
    factor = jax.lax.optimization_barrier(jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + cfg.norm_eps))
    return apply_rope((q32 * factor).astype(q.dtype), positions[:, :, None], inv_freq)


def indexer_queries(wq_b, cfg: ModelConfig, q_latent: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
                    ctx) -> jax.Array:
    """The indexer's queries [B, S, heads, head_dim] of q_latent: wq_b, RoPE and (simulate_quant) the trained
    Hadamard + FP4 rounding; on the kernel, RoPE and the rounding in one launch on wq_b's float32 output."""
    batch, seq, _ = q_latent.shape
    n_heads, head_dim = cfg.index_n_heads, cfg.index_head_dim
    fits = pallas_norm_rope.supported(head_dim, cfg.rope_head_dim, hadamard_fp4=ctx.simulate_quant)
    if choice.takes_kernel(ROWS_KERNEL, ctx, fits):
        q = linear(q_latent, wq_b, jnp.float32, ctx=ctx).reshape(batch, seq, n_heads, head_dim)
        return pallas_norm_rope.rms_norm_rows(q, None, eps=None, in_dtype=q_latent.dtype, rope=(positions, inv_freq),
                                              hadamard_fp4=ctx.simulate_quant, interpret=ctx.kernels.interpret)
    q = linear(q_latent, wq_b, ctx=ctx).reshape(batch, seq, n_heads, head_dim)
    q = apply_rope(q, positions[:, :, None], inv_freq)
    if ctx.simulate_quant:
        q = trained_rounding(fp4_fake_quant, hadamard(q), ctx)
    return q
