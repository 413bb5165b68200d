"""The one generation loop: `Model.generate`, the server's shared batch and speculative decoding all run it.

    gen, first = start(state, logits, sampling)                    # after a prefill: each row's first token
    gen, out = generate_chunk(params, gen, halt, cfg=cfg, ctx=ctx, max_seq_len=..., chunk=16)   # repeatedly

A `GenerationState` (engine.py) holds the rows: decode state, the token each feeds next, its count, whether it is
done, and its `sampling.Sampling` row (parameters, stop tokens and key: a row's i-th token is drawn with its key
folded with i, so it samples the same tokens in any batch). `generate_chunk` runs up to `chunk` steps of every row
that is not done in one `lax.while_loop` that ends early once all are: plain decode steps, or with
`speculative_tokens` k > 0 speculative steps (speculative.py: k drafts verified in one chunk). `halt` [B] first
marks rows done (stopped or freed on the host). Nothing reads a device value on the host; the caller reads a
chunk's tokens while the device runs the next.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import engine, speculative
from .config import ModelConfig
from .ops import layer_stats
from .run_context import RunContext
from .sampling import Sampling, is_stop, sample_rows, token_logprobs
from .state import DecodeState


class ChunkOut(NamedTuple):
    """What a chunk produced, per row: tokens [B, chunk * (k+1)] in order with -1 where the row produced nothing;
    with `logprobs` (plain steps) each token's log-probability [B, chunk] and the n_top best [B, chunk, n_top] ids and
    log-probabilities (zero-width otherwise); steps [B] (steps the row took part in) and accepted [B, k] (steps in
    which draft j was accepted; k = 0 without speculation); with ctx.stats the layers' statistics over the chunk's
    steps (an ops/layer_stats.py summary; None otherwise)."""
    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    steps: jax.Array
    accepted: jax.Array
    stats: object = None


def first_tokens(logits: jax.Array, sampling: Sampling, n_top: int = 0):
    """The first token of each row from its prefill logits [B, V] (drawn with its key folded with 0): (token [B],
    done [B], (logprob [B], top ids [B, n_top], top log-probabilities [B, n_top]))."""
    token = sample_rows(logits, jnp.zeros(logits.shape[:1], jnp.int32), sampling)
    done = is_stop(token, sampling) | (sampling.max_new_tokens <= 1)
    return token, done, token_logprobs(logits, token, n_top)


@functools.partial(jax.jit, donate_argnames=("state",))
def start(state: DecodeState, logits: jax.Array, sampling: Sampling):
    """The generation state after a prefill of every row (`state`, its last logits [B, V]); returns (it, each row's
    first token [B])."""
    token, done, _ = first_tokens(logits, sampling)
    return engine.GenerationState(state, token, jnp.ones_like(token), done, sampling), token


def _plain_step(params, cfg, ctx, gen: engine.GenerationState, max_seq_len, track_mtp, logprobs, n_top):
    """One decode step of every active row: (the token [B] or -1, its logprob outputs (None without `logprobs`),
    the new state, the step's statistics summary (None without ctx.stats))."""
    active = ~gen.done
    logits, decode, *summary = engine.decode_rows(params, gen.decode, gen.last_token, active, cfg, ctx, max_seq_len,
                                                  track_mtp)
    token = jnp.where(active, sample_rows(logits, gen.generated, gen.sampling), -1)
    generated = gen.generated + active
    done = gen.done | is_stop(token, gen.sampling) | (generated >= gen.sampling.max_new_tokens)
    gen = gen.replace(decode=decode, last_token=jnp.where(active, token, gen.last_token), generated=generated,
                      done=done)
    return token, token_logprobs(logits, token, n_top) if logprobs else None, gen, (summary or [None])[0]


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "max_seq_len", "chunk", "logprobs", "n_top", "track_mtp",
                                             "speculative_tokens"), donate_argnames=("gen",))
def generate_chunk(params, gen: engine.GenerationState, halt: jax.Array, *, cfg: ModelConfig, ctx: RunContext,
                   max_seq_len: int, chunk: int, logprobs: bool = False, n_top: int = 0, track_mtp: bool = False,
                   speculative_tokens: int = 0) -> tuple[engine.GenerationState, ChunkOut]:
    """Up to `chunk` steps of the rows that are not done (after `halt` [B] marks rows done). Plain steps
    (`track_mtp`: keep the MTP block's window current), or with speculative_tokens k > 0 speculative steps (the rows'
    MTP windows tracked since their prefill). `logprobs` (plain steps only): also each token's log-probability and
    the n_top best. With ctx.stats (plain steps only) ChunkOut.stats sums up the layers' statistics of the chunk's
    steps. Returns (gen, ChunkOut)."""
    k = speculative_tokens
    if k and logprobs:
        raise NotImplementedError("log-probabilities of speculative steps")
    if k and ctx.stats:
        raise NotImplementedError("layer statistics of speculative steps (run with speculative_tokens=0)")
    batch = gen.last_token.shape[0]
    gen = gen.replace(done=gen.done | halt)
    steps_out = chunk if logprobs else 0
    out = ChunkOut(jnp.full((batch, chunk * (k + 1)), -1, jnp.int32), jnp.zeros((batch, steps_out), jnp.float32),
                   jnp.zeros((batch, steps_out, n_top), jnp.int32), jnp.zeros((batch, steps_out, n_top), jnp.float32),
                   jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, k), jnp.int32),
                   layer_stats.empty(cfg.n_layers, cfg.n_routed_experts) if ctx.stats else None)

    def cond(carry):
        i, gen, _ = carry
        return (i < chunk) & ~jnp.all(gen.done)

    def body(carry):
        i, gen, out = carry
        active = ~gen.done
        if k:
            emitted, gen, accepted = speculative.speculative_step(params, cfg, ctx, gen, max_seq_len, k)
            out = out._replace(accepted=out.accepted + accepted)
        else:
            token, token_lps, gen, summary = _plain_step(params, cfg, ctx, gen, max_seq_len, track_mtp, logprobs,
                                                         n_top)
            emitted = token[:, None]
            if summary is not None:
                out = out._replace(stats=layer_stats.merge(out.stats, summary))
            if logprobs:
                lp, top_ids, top_lp = token_lps
                out = out._replace(logprobs=out.logprobs.at[:, i].set(lp), top_ids=out.top_ids.at[:, i].set(top_ids),
                                   top_logprobs=out.top_logprobs.at[:, i].set(top_lp))
        tokens = jax.lax.dynamic_update_slice_in_dim(out.tokens, emitted, i * (k + 1), axis=1)
        return i + 1, gen, out._replace(tokens=tokens, steps=out.steps + active)

    _, gen, out = jax.lax.while_loop(cond, body, (jnp.int32(0), gen, out))
    return gen, out
