"""The device side of continuous batching: one static decode batch of `max_batch` rows ("slots").

A request is prefilled alone (a batch-1 state, `Model.prefill`) and `admit` writes that state into a free row of the
shared one with `dynamic_update_slice`, samples the request's first token and sets the row's own sampling
parameters, stop tokens and random key. `decode_chunk` then runs up to `chunk` decode steps of the whole batch in
one `lax.while_loop`; rows that are done (or free) stay frozen. Nothing here depends on how many rows there are or
which row a request has: every shape is static, so requests join and leave without recompiling.

Random numbers: a request's key is threefry's key of its 64-bit seed, folded with the choice index (OpenAI `n`),
and its i-th generated token is drawn with that key folded with i. A seeded request therefore samples the same
tokens in any row and beside any other requests (up to the floating-point differences of a different batch).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from .. import engine, speculative
from ..config import ModelConfig
from ..layer_scan import StackedLayers
from ..run_context import RunContext
from ..sampling import sample
from ..state import DecodeState

MAX_TOP_LOGPROBS = 20       # OpenAI's limit for top_logprobs


@flax.struct.dataclass
class RowSampling:
    """Per-row sampling: [B] each, stop_tokens [B, S] padded with -1, key [B, 2] uint32 (threefry key data)."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new_tokens: jax.Array
    stop_tokens: jax.Array
    key: jax.Array


@flax.struct.dataclass
class Slots:
    decode: DecodeState
    last_token: jax.Array     # [B] int32: the token each row feeds next
    generated: jax.Array      # [B] int32: tokens the row's request has produced
    done: jax.Array           # [B] bool: a free row, or a request that ended on the device
    sampling: RowSampling


def init_slots(decode: DecodeState, max_stop_tokens: int) -> Slots:
    """Every row free (done), around a fresh decode state."""
    batch = decode.positions.shape[0]
    sampling = RowSampling(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                           top_p=jnp.ones((batch,), jnp.float32), max_new_tokens=jnp.ones((batch,), jnp.int32),
                           stop_tokens=jnp.full((batch, max_stop_tokens), -1, jnp.int32),
                           key=jnp.zeros((batch, 2), jnp.uint32))
    return Slots(decode=decode, last_token=jnp.zeros((batch,), jnp.int32), generated=jnp.zeros((batch,), jnp.int32),
                 done=jnp.ones((batch,), bool), sampling=sampling)


def _put(big: jax.Array, small: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    start = [jnp.int32(0)] * big.ndim
    start[axis] = slot
    return jax.lax.dynamic_update_slice(big, small.astype(big.dtype), start)


def _put_tree(big, small, slot, axis: int = 0):
    return jax.tree.map(lambda b, s: _put(b, s, slot, axis), big, small)


def put_state_row(state: DecodeState, row: DecodeState, slot: jax.Array) -> DecodeState:
    """`state` with row `slot` replaced by the batch-1 state `row` (every buffer: caches, rings, compressor
    pending tokens, MTP streams, position). A scanned model's stacked layers hold the batch on axis 1."""
    if isinstance(state.layers, StackedLayers):
        layers = state.layers.replace(before=_put_tree(state.layers.before, row.layers.before, slot),
                                      phases=_put_tree(state.layers.phases, row.layers.phases, slot, axis=1),
                                      after=_put_tree(state.layers.after, row.layers.after, slot))
    else:
        layers = _put_tree(state.layers, row.layers, slot)
    return state.replace(layers=layers, mtp=_put_tree(state.mtp, row.mtp, slot),
                         mtp_hidden=_put_tree(state.mtp_hidden, row.mtp_hidden, slot),
                         positions=_put_tree(state.positions, row.positions, slot))


def sample_rows(logits: jax.Array, key: jax.Array, step: jax.Array, sampling: RowSampling) -> jax.Array:
    """Token ids [B]: row b drawn from logits[b] with its own parameters and key folded with step[b]."""
    def one(row_logits, key_data, row_step, temperature, top_k, top_p):
        row_key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), row_step)
        return sample(row_logits[None], row_key, temperature, top_k, top_p)[0]
    return jax.vmap(one)(logits, key, step, sampling.temperature, sampling.top_k, sampling.top_p)


def token_logprobs(logits: jax.Array, token: jax.Array, n_top: int):
    """(log-probability [B] of `token` under the model's distribution (the logits before temperature and
    filters), top ids [B, n_top], their log-probabilities [B, n_top])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(token, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, n_top) if n_top else (logprobs[:, :0], jnp.zeros(
        (logits.shape[0], 0), jnp.int32))
    return chosen, top_ids.astype(jnp.int32), top_lp


def _is_stop(token: jax.Array, stop_tokens: jax.Array) -> jax.Array:
    return (token >= 0) & jnp.any(token[:, None] == stop_tokens, axis=-1)     # -1 pads stop_tokens


@functools.partial(jax.jit, static_argnames=("n_top",), donate_argnames=("slots",))
def admit(slots: Slots, row_state: DecodeState, logits: jax.Array, slot: jax.Array, seed: jax.Array,
          choice: jax.Array, row: RowSampling, *, n_top: int):
    """Write a prefilled request into row `slot`: its state (batch 1), its sampling `row` (each field [1], key
    ignored), and its key made from `seed` (uint32 [2]: high and low words) and `choice`. Samples the first token
    from the prefill `logits` [1, V]. Returns (slots, (token [1], logprob [1], top ids [1, n], top logprobs [1, n]))."""
    key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), choice)
    row = row.replace(key=jax.random.key_data(key)[None])
    token = sample_rows(logits, row.key, jnp.zeros((1,), jnp.int32), row)
    done = _is_stop(token, row.stop_tokens) | (row.max_new_tokens <= 1)
    sampling = jax.tree.map(lambda b, s: _put(b, s, slot, 0), slots.sampling, row)
    slots = Slots(decode=put_state_row(slots.decode, row_state, slot),
                  last_token=_put(slots.last_token, token, slot, 0),
                  generated=_put(slots.generated, jnp.ones((1,), jnp.int32), slot, 0),
                  done=_put(slots.done, done, slot, 0), sampling=sampling)
    return slots, (token, *token_logprobs(logits, token, n_top))


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "max_seq_len", "chunk", "n_top", "track_mtp"),
                   donate_argnames=("slots",))
def decode_chunk(params, slots: Slots, halt: jax.Array, *, cfg: ModelConfig, ctx: RunContext, max_seq_len: int,
                 chunk: int, n_top: int, track_mtp: bool = False):
    """Up to `chunk` decode steps of every row that is not done, in one `lax.while_loop` that ends early once all
    are; `halt` [B] bool first marks rows done (freed or stopped on the host). Returns (slots, (tokens [B, chunk]
    with -1 where a row produced nothing, their logprobs [B, chunk], top ids [B, chunk, n_top], top logprobs))."""
    batch = slots.last_token.shape[0]
    slots = slots.replace(done=slots.done | halt)
    outputs = (jnp.full((batch, chunk), -1, jnp.int32), jnp.zeros((batch, chunk), jnp.float32),
               jnp.zeros((batch, chunk, n_top), jnp.int32), jnp.zeros((batch, chunk, n_top), jnp.float32))

    def cond(carry):
        i, slots, _ = carry
        return (i < chunk) & ~jnp.all(slots.done)

    def body(carry):
        i, slots, outputs = carry
        active = ~slots.done
        logits, decode = engine._decode(params, slots.decode, slots.last_token, active, cfg, ctx, max_seq_len,
                                        track_mtp)
        token = jnp.where(active, sample_rows(logits, slots.sampling.key, slots.generated, slots.sampling), -1)
        step_out = (token, *token_logprobs(logits, token, n_top))
        outputs = tuple(o.at[:, i].set(s) for o, s in zip(outputs, step_out))
        generated = slots.generated + active
        done = slots.done | _is_stop(token, slots.sampling.stop_tokens) | (generated >= slots.sampling.max_new_tokens)
        slots = slots.replace(decode=decode, last_token=jnp.where(active, token, slots.last_token),
                              generated=generated, done=done)
        return i + 1, slots, outputs

    _, slots, outputs = jax.lax.while_loop(cond, body, (jnp.int32(0), slots, outputs))
    return slots, outputs


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "max_seq_len", "chunk", "k"), donate_argnames=("slots",))
def speculative_chunk(params, slots: Slots, halt: jax.Array, *, cfg: ModelConfig, ctx: RunContext,
                      max_seq_len: int, chunk: int, k: int):
    """`decode_chunk` with speculative decoding (dsv4_jax.speculative): up to `chunk` steps, each drafting k
    tokens with the MTP block and verifying them in one pass, every row with its own parameters and key (folded
    with its generated count). The rows' MTP windows must have been tracked since their prefill. Returns (slots,
    (tokens [B, chunk * (k+1)] in order with -1 holes, verify steps [B], accepted drafts [B]))."""
    slots = slots.replace(done=slots.done | halt)
    gen = engine.GenerationState(slots.decode, slots.last_token, slots.generated, slots.done,
                                 key=jnp.zeros((2,), jnp.uint32))
    keys = jax.random.wrap_key_data(slots.sampling.key, impl="threefry2x32")
    out, spec = speculative.run_steps(params, cfg, ctx, speculative.start(gen, k), slots.sampling, max_seq_len, chunk,
                                      k, row_keys=keys)
    gen = spec.gen
    slots = slots.replace(decode=gen.decode, last_token=gen.last_token, generated=gen.generated, done=gen.done)
    return slots, (out, spec.steps, jnp.sum(spec.accepted, axis=1))
