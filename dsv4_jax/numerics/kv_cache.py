"""How the decode state stores attention entries: in the activation dtype (the default) or compact
(`kv_cache_dtype="fp8"`).

Compact storage keeps what the model's own training roundings already produce (docs/model.md 4.3-4.4):
- window ring and compressed KV entries ("kv", `Fp8KvEntries`): the nope dims as e4m3 with one E8M0 (power-of-two)
  scale per 64 values, the rope dims in the activation dtype: nope float8_e4m3fn [..., nope], scale uint8
  [..., nope/64], rope [..., rope];
- indexer keys ("index", after the Hadamard, `Fp4IndexEntries`): packed e2m1 pairs with one E8M0 scale per 32
  values: fp4 uint8 [..., d/2], scale uint8 [..., d/32].
Under `simulate_quant` the values written are already on those grids, so storing and loading them is exact (the
scale is recomputed from the block's own maximum: a rounded block's maximum is at least half the original's, so
the recomputed power of two is the original or half of it, and either represents every value exactly): the logits
equal the activation-dtype caches' bit for bit. Without it, storing rounds each block (RNE, saturating).

Each layout is a type that writes, reads and gathers its own entries (`EntryStore`): `PlainEntries` (the activation
dtype), `Fp8KvEntries` and `Fp4IndexEntries` (compact); a new kind (e.g. paged) is a new subclass with the same
methods, and nothing else asks which kind it holds. `kernel_operand()` hands a kernel the arrays it reads.
"""

from __future__ import annotations

import flax.struct
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


class EntryStore:
    """Stored attention entries [B, N, ...] of one kind. Every method returns a store of the same kind (or, for
    `decode`, the entries); the arrays are the subclass's dataclass fields, all with the batch and entry axes first."""

    def encode(self, entries: jax.Array):
        """`entries` [..., head_dim] as this kind stores them (a store of matching leading shape)."""
        raise NotImplementedError

    def decode(self, dtype) -> jax.Array:
        """The entries [..., head_dim] in `dtype`."""
        raise NotImplementedError

    def kernel_operand(self):
        """What a kernel reads: the plain array, or a dict of the compact layout's arrays."""
        raise NotImplementedError

    def plain(self, dtype) -> jax.Array | None:
        """The buffer itself when entries are stored plainly in `dtype` (a kernel may write it in place), else None."""
        return None

    @property
    def n_entries(self) -> int:
        return jax.tree.leaves(self)[0].shape[1]

    def scatter(self, batch_idx: jax.Array, index: jax.Array, entries: jax.Array):
        """self[batch_idx, index] = entries (encoded); out-of-range indices are dropped."""
        return self.put_rows(batch_idx, index, self.encode(entries))

    def put_rows(self, batch_idx: jax.Array, index: jax.Array, values):
        """self[batch_idx, index] = values, already stored (as gather_rows returns them); out of range: dropped."""
        return jax.tree.map(lambda buf, new: buf.at[batch_idx, index].set(new, mode="drop"), self, values)

    def leading(self, stop: int):
        """The first `stop` entries along axis 1 (the entries a call's positions can see)."""
        return jax.tree.map(lambda buf: buf[:, :stop], self)

    def gather_rows(self, idx: jax.Array):
        """Per batch row b: self[b][idx[b]] (the indexer's picks), still stored: decode reads only those bytes."""
        return jax.tree.map(lambda buf: jax.vmap(lambda buf_b, idx_b: buf_b[idx_b])(buf, idx), self)


@flax.struct.dataclass
class PlainEntries(EntryStore):
    """Entries in the activation dtype: values [B, N, head_dim]."""
    values: jax.Array

    def encode(self, entries):
        return PlainEntries(entries.astype(self.values.dtype))

    def decode(self, dtype):
        return self.values.astype(dtype)

    def kernel_operand(self):
        return self.values

    def plain(self, dtype):
        return self.values if self.values.dtype == dtype else None


def _pow2_scale_bytes(amax: jax.Array, grid_max: float, floor: float) -> tuple[jax.Array, jax.Array]:
    """(E8M0 bytes, float32 scales) of the power-of-two scales 2^ceil(log2(amax / grid_max))."""
    scale = pow2_ceil(exact_divide(jnp.maximum(amax, floor), grid_max))
    byte = (jax.lax.bitcast_convert_type(scale, jnp.uint32) >> 23).astype(jnp.uint8)
    return byte, scale


@flax.struct.dataclass
class Fp8KvEntries(EntryStore):
    """KV entries compact: nope e4m3 [B, N, nope] with one E8M0 scale per 64 (scale uint8 [B, N, nope/64]) and the
    rope dims in the activation dtype (rope [B, N, rope_dim])."""
    nope: jax.Array
    scale: jax.Array
    rope: jax.Array

    def encode(self, entries):
        x = entries.astype(jnp.float32)
        nope_dim = self.nope.shape[-1]
        blocks = x[..., :nope_dim].reshape(*x.shape[:-1], -1, KV_BLOCK)
        byte, scale = _pow2_scale_bytes(jnp.max(jnp.abs(blocks), axis=-1), FP8_MAX, _FP8_MIN_AMAX)
        nope = round_to_e4m3(exact_divide(blocks, scale[..., None])).reshape(*x.shape[:-1], nope_dim)
        return Fp8KvEntries(nope.astype(jnp.float8_e4m3fn), byte, entries[..., nope_dim:].astype(self.rope.dtype))

    def decode(self, dtype):
        nope = self.nope.astype(jnp.float32)
        blocks = nope.reshape(*nope.shape[:-1], -1, KV_BLOCK) * e8m0_to_float(self.scale)[..., None]
        return jnp.concatenate([blocks.reshape(nope.shape).astype(dtype), self.rope.astype(dtype)], axis=-1)

    def kernel_operand(self):
        return {"nope": self.nope, "scale": self.scale, "rope": self.rope}


@flax.struct.dataclass
class Fp4IndexEntries(EntryStore):
    """Indexer keys compact: packed e2m1 pairs fp4 uint8 [B, N, d/2] with one E8M0 scale per 32 (scale uint8
    [B, N, d/32])."""
    fp4: jax.Array
    scale: jax.Array

    def encode(self, entries):
        x = entries.astype(jnp.float32)
        blocks = x.reshape(*x.shape[:-1], -1, INDEX_BLOCK)
        byte, scale = _pow2_scale_bytes(jnp.max(jnp.abs(blocks), axis=-1), FP4_MAX, FP4_MAX * 2.0 ** -126)
        codes = e2m1_codes(exact_divide(blocks, scale[..., None])).reshape(x.shape)
        return Fp4IndexEntries(pack_fp4_codes(codes), byte)

    def decode(self, dtype):
        values = fp4_codes_to_float(unpack_fp4_codes(self.fp4))
        blocks = values.reshape(*values.shape[:-1], -1, INDEX_BLOCK) * e8m0_to_float(self.scale)[..., None]
        return blocks.reshape(values.shape).astype(dtype)

    def kernel_operand(self):
        return {"fp4": self.fp4, "scale": self.scale}


def empty(prefix: tuple[int, ...], head_dim: int, rope_dim: int, dtype, kind: str, kv_cache_dtype=None) -> EntryStore:
    """Zeroed storage for entries of shape prefix + (head_dim,): kind "kv" (nope + rope dims) or "index"."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype is None:
        return PlainEntries(jnp.zeros((*prefix, head_dim), dtype))
    if kind == "index":
        return Fp4IndexEntries(jnp.zeros((*prefix, head_dim // 2), jnp.uint8),
                               jnp.zeros((*prefix, head_dim // INDEX_BLOCK), jnp.uint8))
    nope = head_dim - rope_dim
    return Fp8KvEntries(jnp.zeros((*prefix, nope), jnp.float8_e4m3fn),
                        jnp.zeros((*prefix, nope // KV_BLOCK), jnp.uint8), jnp.zeros((*prefix, rope_dim), dtype))


def entry_bytes(head_dim: int, rope_dim: int, item: int, kind: str, kv_cache_dtype=None) -> float:
    """Bytes one stored entry takes (`item`: the activation dtype's size): what a step reads per entry."""
    if kv_cache_dtype is None:
        return head_dim * item
    if kind == "index":
        return head_dim / 2 + head_dim / INDEX_BLOCK
    nope = head_dim - rope_dim
    return nope + nope / KV_BLOCK + rope_dim * item
