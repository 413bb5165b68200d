"""Interleaved, partial, trailing RoPE with the two DeepSeek-V4 tables (docs/model.md 3.4).

Pairs (x[2i], x[2i+1]) of the LAST `rope_head_dim` dims rotate; never Llama's rotate_half pairing.
Window-only layers (ratio 0) use theta = rope_theta without YaRN; compressed layers use compress_rope_theta with
YaRN frequency blending. No mscale: cos/sin have amplitude 1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig


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
