"""Jitted programs over explicit pytrees: forward, prefill chunk, decode step and the on-device generation loop.

Research code may call these directly; `dsv4_jax.Model` wraps them with validation and host-side chunking.
Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import RunOptions, backbone, head_logits, mtp_block
from .sampling import sample
from .state import DecodeState, init_state


def _run_chunk(params, cfg: ModelConfig, opts: RunOptions, state: DecodeState, tokens, n_valid):
    start = state.positions
    X, layers = backbone(params, cfg, opts, tokens, start, n_valid, state.layers)
    return X, state.replace(layers=layers, positions=start + n_valid)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def forward(params, tokens, *, cfg: ModelConfig, opts: RunOptions):
    """Teacher-forced logits float32 [B, S, V] of tokens [B, S] from position 0."""
    batch, seq = tokens.shape
    state = init_state(cfg, batch, seq, opts.jnp_dtype)
    X, _ = _run_chunk(params, cfg, opts, state, tokens, jnp.full((batch,), seq, jnp.int32))
    return head_logits(params, params, cfg, X)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def forward_mtp(params, tokens, next_tokens, *, cfg: ModelConfig, opts: RunOptions):
    """Teacher-forced MTP logits [B, S, V]: position i sees the main streams of i and next_tokens[:, i]
    (the token at i+1) and predicts the token at i+2."""
    batch, seq = tokens.shape
    state = init_state(cfg, batch, seq, opts.jnp_dtype)
    n_valid = jnp.full((batch,), seq, jnp.int32)
    X, _ = _run_chunk(params, cfg, opts, state, tokens, n_valid)
    logits, _ = mtp_block(params, cfg, opts, X, next_tokens, state.positions, n_valid, state.mtp[0])
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "opts"), donate_argnames=("state",))
def prefill_chunk(params, state: DecodeState, tokens, n_valid, last_logits, *, cfg: ModelConfig,
                  opts: RunOptions):
    """Consume tokens [B, C] (the first n_valid[b] real) at each sequence's current position. Returns
    (logits of each row's last real token in this chunk, or `last_logits` where the row had none; state)."""
    X, state = _run_chunk(params, cfg, opts, state, tokens, n_valid)
    last = jnp.maximum(n_valid - 1, 0)
    X_last = jnp.take_along_axis(X, last[:, None, None, None], axis=1)
    logits = head_logits(params, params, cfg, X_last)[:, 0]
    return jnp.where((n_valid > 0)[:, None], logits, last_logits), state


def _decode(params, state, tokens, active, cfg, opts, max_seq_len):
    X, new_state = _run_chunk(params, cfg, opts, state, tokens[:, None], active.astype(jnp.int32))
    logits = head_logits(params, params, cfg, X)[:, 0]
    # Past the buffers' capacity the caches would be wrong: say so with NaN rather than a plausible token.
    overflow = state.positions >= max_seq_len
    return jnp.where(overflow[:, None], jnp.nan, logits), new_state


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "max_seq_len"), donate_argnames=("state",))
def decode_step(params, state: DecodeState, tokens, *, cfg: ModelConfig, opts: RunOptions, max_seq_len: int):
    """One token per sequence: tokens [B] -> (logits [B, V] float32, state)."""
    return _decode(params, state, tokens, jnp.ones(tokens.shape, bool), cfg, opts, max_seq_len)


@flax.struct.dataclass
class GenerationState:
    decode: DecodeState
    last_token: jax.Array     # [B] int32: token to feed next
    generated: jax.Array      # [B] int32: tokens produced so far per sequence
    done: jax.Array           # [B] bool
    key: jax.Array


@flax.struct.dataclass
class SamplingParams:
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new_tokens: jax.Array   # [B] int32
    stop_tokens: jax.Array      # [n_stop] int32 (padded with -1)


def first_generation_state(state: DecodeState, logits, key, sp: SamplingParams) -> GenerationState:
    """Sample the first new token from the prefill logits."""
    key, sub = jax.random.split(key)
    token = sample(logits, sub, sp.temperature, sp.top_k, sp.top_p)
    done = jnp.any(token[:, None] == sp.stop_tokens[None, :], axis=-1) | (sp.max_new_tokens <= 1)
    return GenerationState(state, token, jnp.ones_like(token), done, key)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "max_seq_len", "chunk"), donate_argnames=("gen",))
def generate_chunk(params, gen: GenerationState, sp: SamplingParams, *, cfg: ModelConfig, opts: RunOptions,
                   max_seq_len: int, chunk: int):
    """Up to `chunk` decode steps in one `lax.while_loop`, stopping early once every sequence is done.
    Returns (tokens [B, chunk] with -1 where nothing was produced, gen)."""
    batch = gen.last_token.shape[0]
    out = jnp.full((batch, chunk), -1, jnp.int32)

    def cond(carry):
        i, gen, _ = carry
        return (i < chunk) & ~jnp.all(gen.done)

    def body(carry):
        i, gen, out = carry
        active = ~gen.done
        logits, decode = _decode(params, gen.decode, gen.last_token, active, cfg, opts, max_seq_len)
        key, sub = jax.random.split(gen.key)
        token = sample(logits, sub, sp.temperature, sp.top_k, sp.top_p)
        token = jnp.where(active, token, -1)
        out = out.at[:, i].set(token)
        generated = gen.generated + active
        stop = jnp.any(token[:, None] == sp.stop_tokens[None, :], axis=-1)
        done = gen.done | stop | (generated >= sp.max_new_tokens)
        last = jnp.where(active, token, gen.last_token)
        return i + 1, GenerationState(decode, last, generated, done, key), out

    _, gen, out = jax.lax.while_loop(cond, body, (jnp.int32(0), gen, out))
    return out, gen
