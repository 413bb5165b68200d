"""The device side of continuous batching: one static decode batch of `max_batch` rows ("slots").

Requests are prefilled alone or a few together (a state of their own, `Model.prefill_prompts`) and `admit` writes
one row of that state into a free row of the shared one (an engine.GenerationState) with `dynamic_update_slice`,
samples the request's first token and sets the row's own sampling parameters, stop tokens and random key. The
shared loop, `generation.generate_chunk`, then runs up to `chunk` steps of the whole batch in one
`lax.while_loop`; rows that are done (or free) stay frozen. Nothing here depends on how many rows there are or
which row a request has: every shape is static, so requests join and leave without recompiling.

Random numbers: a request's key is threefry's key of its 64-bit seed, folded with the choice index (OpenAI `n`),
and its i-th generated token is drawn with that key folded with i. A seeded request therefore samples the same
tokens in any row and beside any other requests (up to the floating-point differences of a different batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..engine import GenerationState
from ..generation import first_tokens
from ..sampling import Sampling, row_key
from ..state import DecodeState, copy_row

MAX_TOP_LOGPROBS = 20       # OpenAI's limit for top_logprobs


def init_slots(decode: DecodeState, max_stop_tokens: int) -> GenerationState:
    """Every row free (done), around a fresh decode state."""
    batch = decode.positions.shape[0]
    sampling = Sampling(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                        top_p=jnp.ones((batch,), jnp.float32), max_new_tokens=jnp.ones((batch,), jnp.int32),
                        stop_tokens=jnp.full((batch, max_stop_tokens), -1, jnp.int32),
                        key=jnp.zeros((batch, 2), jnp.uint32))
    return GenerationState(decode=decode, last_token=jnp.zeros((batch,), jnp.int32),
                           generated=jnp.zeros((batch,), jnp.int32), done=jnp.ones((batch,), bool), sampling=sampling)


def _put(big: jax.Array, small: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    start = [jnp.int32(0)] * big.ndim
    start[axis] = slot
    return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), start)


def _put_tree(big, small, slot, axis: int = 0):
    return jax.tree.map(lambda b, s: _put(b, s, slot, axis), big, small)


@functools.partial(jax.jit, static_argnames=("n_top",), donate_argnames=("slots",))
def admit(slots: GenerationState, prefilled: DecodeState, logits: jax.Array, row: jax.Array, slot: jax.Array,
          seed: jax.Array, choice: jax.Array, sampling: Sampling, *, n_top: int):
    """Write row `row` of a prefilled batch (the state `prefilled` and its logits [B, V]; a request prefilled
    alone is B = 1, row 0) into row `slot` of the shared batch: its state, its `sampling` (each field [1], key
    ignored), and its key made from `seed` (uint32 [2]: high and low words) and `choice` (sampling.row_key).
    Samples the first token from the row's prefill logits. Returns (slots, (token [1], logprob [1], top ids
    [1, n], top logprobs [1, n]))."""
    sampling = sampling.replace(key=row_key(seed, choice)[None])
    token, done, logprobs = first_tokens(jax.lax.dynamic_slice_in_dim(logits, row, 1), sampling, n_top)
    slots = GenerationState(decode=copy_row(slots.decode, prefilled, row, slot),
                            last_token=_put(slots.last_token, token, slot, 0),
                            generated=_put(slots.generated, jnp.ones((1,), jnp.int32), slot, 0),
                            done=_put(slots.done, done, slot, 0), sampling=_put_tree(slots.sampling, sampling, slot))
    return slots, (token, *logprobs)
