"""The chunk a call feeds the model: S new tokens per sequence at positions start[b] + i, of which the first
n_valid[b] are real (the rest are padding whose results are never kept). Forward passes, prefill chunks, decode steps
(S = 1) and speculative verify chunks are all chunks; every layer takes one."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Chunk:
    tokens: jax.Array     # [B, S] int32: the token ids (hash-routed MoE layers route by them)
    start: jax.Array      # [B] int32: the position of each row's first token (the tokens the row consumed before)
    n_valid: jax.Array    # [B] int32: the real tokens of each row

    @property
    def positions(self) -> jax.Array:
        """[B, S] int32: the position of every token of the chunk."""
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def real(self) -> jax.Array:
        """[B, S] bool: whether each token of the chunk is real (not padding, not an inactive row's)."""
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.n_valid[:, None]
