"""How the decode state stores attention entries: in the activation dtype (the default) or compact
(`kv_cache_dtype="fp8"`).

Compact storage keeps what the model's own training roundings already produce (docs/model.md 4.3-4.4):
- window ring and compressed KV entries ("kv"): the nope dims as e4m3 with one E8M0 (power-of-two) scale per 64
  values, the rope dims in the activation dtype: {"nope": float8_e4m3fn [..., nope], "scale": uint8 [..., nope/64],
  "rope": [..., rope]};
- indexer keys ("index", after the Hadamard): packed e2m1 pairs with one E8M0 scale per 32 values:
  {"fp4": uint8 [..., d/2], "scale": uint8 [..., d/32]}.
Under `simulate_quant` the values written are already on those grids, so storing and loading them is exact (the
scale is recomputed from the block's own maximum: a rounded block's maximum is at least half the original's, so
the recomputed power of two is the original or half of it, and either represents every value exactly): the logits
equal the activation-dtype caches' bit for bit. Without it, storing rounds each block (RNE, saturating).

Every function takes either layout: a plain array, or the dict above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .fake_quant import FP4_MAX, FP8_MAX, exact_divide, pow2_ceil, round_to_e4m3
from .formats import e8m0_to_float, fp4_codes_to_float, unpack_fp4_codes
from .nvfp4 import e2m1_codes, pack_fp4_codes

KV_CACHE_DTYPES = (None, "fp8")
KV_BLOCK = 64          # e4m3 nope dims: one scale per 64 values (the training rounding's block)
INDEX_BLOCK = 32       # e2m1 indexer keys: one scale per 32 values
_FP8_MIN_AMAX = 1e-4   # as fp8_fake_quant: all-zero blocks get a normal scale


def check_kv_cache_dtype(kv_cache_dtype) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (None: the activation dtype), got "
                         f"{kv_cache_dtype!r}")


def empty(prefix: tuple[int, ...], head_dim: int, rope_dim: int, dtype, kind: str, kv_cache_dtype=None):
    """Zeroed storage for entries of shape prefix + (head_dim,): kind "kv" (nope + rope dims) or "index"."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype is None:
        return jnp.zeros((*prefix, head_dim), dtype)
    if kind == "index":
        return {"fp4": jnp.zeros((*prefix, head_dim // 2), jnp.uint8),
                "scale": jnp.zeros((*prefix, head_dim // INDEX_BLOCK), jnp.uint8)}
    nope = head_dim - rope_dim
    return {"nope": jnp.zeros((*prefix, nope), jnp.float8_e4m3fn),
            "scale": jnp.zeros((*prefix, nope // KV_BLOCK), jnp.uint8),
            "rope": jnp.zeros((*prefix, rope_dim), dtype)}


def entry_bytes(head_dim: int, rope_dim: int, item: int, kind: str, kv_cache_dtype=None) -> float:
    """Bytes one stored entry takes (`item`: the activation dtype's size): what a step reads per entry."""
    if kv_cache_dtype is None:
        return head_dim * item
    if kind == "index":
        return head_dim / 2 + head_dim / INDEX_BLOCK
    nope = head_dim - rope_dim
    return nope + nope / KV_BLOCK + rope_dim * item


def _pow2_scale_bytes(amax: jax.Array, grid_max: float, floor: float) -> tuple[jax.Array, jax.Array]:
    """(E8M0 bytes, float32 scales) of the power-of-two scales 2^ceil(log2(amax / grid_max))."""
    scale = pow2_ceil(exact_divide(jnp.maximum(amax, floor), grid_max))
    byte = (jax.lax.bitcast_convert_type(scale, jnp.uint32) >> 23).astype(jnp.uint8)
    return byte, scale


def encode(entries: jax.Array, like) -> jax.Array | dict:
    """`entries` [..., head_dim] in the layout of `like` (a stored buffer or a slice of one)."""
    if not isinstance(like, dict):
        return entries.astype(like.dtype)
    x = entries.astype(jnp.float32)
    if "fp4" in like:
        blocks = x.reshape(*x.shape[:-1], -1, INDEX_BLOCK)
        byte, scale = _pow2_scale_bytes(jnp.max(jnp.abs(blocks), axis=-1), FP4_MAX, FP4_MAX * 2.0 ** -126)
        codes = e2m1_codes(exact_divide(blocks, scale[..., None])).reshape(x.shape)
        return {"fp4": pack_fp4_codes(codes), "scale": byte}
    nope_dim = like["nope"].shape[-1]
    blocks = x[..., :nope_dim].reshape(*x.shape[:-1], -1, KV_BLOCK)
    byte, scale = _pow2_scale_bytes(jnp.max(jnp.abs(blocks), axis=-1), FP8_MAX, _FP8_MIN_AMAX)
    nope = round_to_e4m3(exact_divide(blocks, scale[..., None])).reshape(*x.shape[:-1], nope_dim)
    return {"nope": nope.astype(jnp.float8_e4m3fn), "scale": byte,
            "rope": entries[..., nope_dim:].astype(like["rope"].dtype)}


def decode(stored, dtype) -> jax.Array:
    """Stored entries -> [..., head_dim] in `dtype`."""
    if not isinstance(stored, dict):
        return stored.astype(dtype)
    if "fp4" in stored:
        values = fp4_codes_to_float(unpack_fp4_codes(stored["fp4"]))
        blocks = values.reshape(*values.shape[:-1], -1, INDEX_BLOCK) * e8m0_to_float(stored["scale"])[..., None]
        return blocks.reshape(values.shape).astype(dtype)
    nope = stored["nope"].astype(jnp.float32)
    blocks = nope.reshape(*nope.shape[:-1], -1, KV_BLOCK) * e8m0_to_float(stored["scale"])[..., None]
    return jnp.concatenate([blocks.reshape(nope.shape).astype(dtype), stored["rope"].astype(dtype)], axis=-1)


def scatter(stored, batch_idx: jax.Array, index: jax.Array, entries: jax.Array):
    """stored[batch_idx, index] = entries (encoded); out-of-range indices are dropped."""
    return put_rows(stored, batch_idx, index, encode(entries, stored))


def put_rows(stored, batch_idx: jax.Array, index: jax.Array, values):
    """stored[batch_idx, index] = values, already stored (as gather_rows returns them); out of range: dropped."""
    return jax.tree.map(lambda buf, new: buf.at[batch_idx, index].set(new, mode="drop"), stored, values)


def leading(stored, stop: int):
    """The first `stop` entries along axis 1 (the entries a call's positions can see)."""
    return jax.tree.map(lambda buf: buf[:, :stop], stored)


def gather_rows(stored, idx: jax.Array):
    """Per batch row b: stored[b][idx[b]] (the indexer's picks), still stored: decode reads only those bytes."""
    return jax.tree.map(lambda buf: jax.vmap(lambda buf_b, idx_b: buf_b[idx_b])(buf, idx), stored)


def n_entries(stored) -> int:
    return jax.tree.leaves(stored)[0].shape[1]
