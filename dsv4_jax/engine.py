"""Jitted programs over explicit pytrees: forward, prefill chunk, decode step and the on-device generation loop.

Research code may call these directly; `dsv4_jax.Model` wraps them with validation and host-side chunking.
Nothing here reads a device value on the host. Every program takes the model config `cfg` and the run context
`ctx` (run_context.RunContext, kernel plan resolved) as static arguments: one compiled program per pair. Each
program declares the phase it runs (ctx.in_phase): "prefill" (forward, forward_mtp, prefill_chunk), "decode"
(decode_step, generate_chunk, mtp_draft) or "verify" (read_chunk and commit_chunk, a speculative step's); the
ops choose their kernels from it (ops/choice.py). A training context stays in "train".
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layer_scan import is_scanned
from .layers.chunk import Chunk
from .model import backbone, commit_backbone, head_logits, mtp_block, mtp_streams
from .ops import layer_stats
from .run_context import RunContext
from .sampling import Sampling
from .state import DecodeState, init_state

# Prompt tokens per prefill program, the default of load / Model / the command lines. A chunk routes its tokens to
# the 256 experts of each layer and reads every expert's weights once, so longer chunks share that read among more
# tokens: on an H200 (4 Flash layers, docs/performance.md) an 8K prompt takes 115 ms in 4,096-token chunks, 142 ms
# in 2,048-token ones and 257 ms in 512-token ones. Memory sets the limit: 4,096-token chunks need 4.70 GB of
# compiled temporaries per device (4 Flash layers on 8 H200s at 1M tokens, benchmarks/plan_h200.py), what
# 2,048-token chunks needed before the indexer's weighted sum stopped writing a transposed copy of its products.
PREFILL_CHUNK = 4096


def _run_chunk(params, cfg: ModelConfig, ctx: RunContext, state: DecodeState, tokens, n_valid,
               track_mtp: bool = False):
    """Consume tokens [B, S] (the first n_valid[b] real) at each sequence's position. Returns (final streams
    X [B, S, n, D], state, the layers' statistics summary with ctx.stats, else None). With `track_mtp` the MTP
    block's window is updated too (see `_mtp_window_update`)."""
    X, layers, stats, _ = backbone(params, cfg, ctx, Chunk(tokens, state.positions, n_valid), state.layers)
    return X, _advance(params, cfg, ctx, state, layers, X, tokens, n_valid, track_mtp), _summary(ctx, stats, n_valid)


def _summary(ctx: RunContext, stats: list, n_valid) -> dict | None:
    """The backbone's per-layer statistics as one ops/layer_stats.py summary (None without ctx.stats)."""
    if not ctx.stats:
        return None
    record = layer_stats.stack_layers([layer["diagnostics"] for layer in stats])
    return layer_stats.summarize(record, jnp.sum(n_valid))


def with_stats(outputs: tuple, summary: dict | None):
    """A program's outputs, with the statistics summary appended when there is one (ctx.stats)."""
    return outputs if summary is None else (*outputs, summary)


def _advance(params, cfg, ctx, state, layers, X, tokens, n_valid, track_mtp):
    """The state after the first n_valid[b] tokens of a chunk whose backbone caches are `layers` and final streams
    X: positions, the MTP block's window (with `track_mtp`) and the streams of each row's last consumed position."""
    new_state = state.replace(layers=layers, positions=state.positions + n_valid)
    if track_mtp and cfg.n_mtp_layers:
        new_state = new_state.replace(mtp=[_mtp_window_update(params, cfg, ctx, state, X, tokens, n_valid)])
    last = jnp.take_along_axis(X, jnp.maximum(n_valid - 1, 0)[:, None, None, None], axis=1)[:, 0]
    hidden = jnp.where((n_valid > 0)[:, None, None], last.astype(state.mtp_hidden.dtype), state.mtp_hidden)
    return new_state.replace(mtp_hidden=hidden)


def read_chunk(params, cfg: ModelConfig, ctx: RunContext, state: DecodeState, tokens, n_read):
    """Run tokens [B, S] (the first n_read[b] real) at each sequence's position WITHOUT committing them: returns
    (final streams X [B, S, n, D], the backbone caches as read, and what the commit needs beside them: both for
    commit_chunk). A speculative verify."""
    ctx = ctx.in_phase("verify")
    X, layers, _, deferred = backbone(params, cfg, ctx, Chunk(tokens, state.positions, n_read), state.layers,
                                      defer=True)
    return X, layers, deferred


def commit_chunk(params, cfg: ModelConfig, ctx: RunContext, state: DecodeState, read_layers, deferred, X, tokens,
                 n_read, n_commit, track_mtp: bool = False) -> DecodeState:
    """Commit the first n_commit[b] <= n_read[b] tokens of a chunk run by read_chunk on `state`: the result equals
    the state that feeding only those tokens (prefill_chunk / decode steps) produces."""
    ctx = ctx.in_phase("verify")
    layers = commit_backbone(params, cfg, ctx, read_layers, deferred, state.positions, n_read, n_commit)
    return _advance(params, cfg, ctx, state, layers, X, tokens, n_commit, track_mtp)


def _mtp_window_update(params, cfg, ctx, state, X, tokens, n_valid):
    """The MTP block at position q reads the main streams of q and the token at q+1, so its window runs one
    position behind the backbone: a chunk at positions start..start+S-1 feeds MTP positions start-1..start+S-2
    (0..S-2 for a fresh sequence), using the streams saved from the previous chunk for position start-1."""
    seq = tokens.shape[1]
    fresh = (state.positions == 0).astype(jnp.int32)
    idx = jnp.arange(seq, dtype=jnp.int32)[None, :] + fresh[:, None]       # element i -> position start-1+i+fresh
    streams = jnp.concatenate([state.mtp_hidden[:, None].astype(X.dtype), X], axis=1)
    mtp_X = jnp.take_along_axis(streams, idx[:, :, None, None], axis=1)
    next_tokens = jnp.take_along_axis(tokens, jnp.minimum(idx, seq - 1), axis=1)
    chunk = Chunk(next_tokens, state.positions - 1 + fresh, jnp.maximum(n_valid - fresh, 0))
    _, cache, _ = mtp_streams(params, cfg, ctx, mtp_X, chunk, state.mtp[0])
    return cache


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"))
def mtp_draft(params, state: DecodeState, next_tokens, *, cfg: ModelConfig, ctx: RunContext):
    """Draft logits [B, V] for the token after `next_tokens` [B] (the tokens that follow each sequence's last
    consumed position p): the MTP block at p reads the main streams of p and next_tokens and predicts p+2.
    Needs a state built with track_mtp; the state itself is left unchanged."""
    ctx = ctx.in_phase("decode")
    chunk = Chunk(next_tokens[:, None], state.positions - 1, jnp.ones_like(state.positions))
    X, _, _ = mtp_streams(params, cfg, ctx, state.mtp_hidden[:, None], chunk, state.mtp[0])
    return head_logits(params, params["mtp"][0], cfg, X, ctx)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"))
def forward(params, tokens, *, cfg: ModelConfig, ctx: RunContext):
    """Teacher-forced logits float32 [B, S, V] of tokens [B, S] from position 0; with ctx.stats (logits, the
    layers' statistics summary, ops/layer_stats.py)."""
    ctx = ctx.in_phase("prefill")
    batch, seq = tokens.shape
    state = init_state(cfg, batch, seq, ctx.jnp_dtype, is_scanned(params))
    X, _, summary = _run_chunk(params, cfg, ctx, state, tokens, jnp.full((batch,), seq, jnp.int32))
    logits = head_logits(params, params, cfg, X, ctx)
    return logits if summary is None else (logits, summary)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"))
def forward_mtp(params, tokens, next_tokens, *, cfg: ModelConfig, ctx: RunContext):
    """Teacher-forced MTP logits [B, S, V]: position i sees the main streams of i and next_tokens[:, i]
    (the token at i+1) and predicts the token at i+2. (No statistics: ctx.stats is set aside.)"""
    ctx = ctx.in_phase("prefill").replace(stats=False)
    batch, seq = tokens.shape
    state = init_state(cfg, batch, seq, ctx.jnp_dtype, is_scanned(params))
    n_valid = jnp.full((batch,), seq, jnp.int32)
    X, _, _ = _run_chunk(params, cfg, ctx, state, tokens, n_valid)
    logits, _, _ = mtp_block(params, cfg, ctx, X, Chunk(next_tokens, state.positions, n_valid), state.mtp[0])
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "track_mtp"), donate_argnames=("state",))
def prefill_chunk(params, state: DecodeState, tokens, n_valid, last_logits, *, cfg: ModelConfig,
                  ctx: RunContext, track_mtp: bool = False):
    """Consume tokens [B, C] (the first n_valid[b] real) at each sequence's current position. Returns
    (logits of each row's last real token in this chunk, or `last_logits` where the row had none; state; with
    ctx.stats the chunk's statistics summary)."""
    ctx = ctx.in_phase("prefill")
    X, state, summary = _run_chunk(params, cfg, ctx, state, tokens, n_valid, track_mtp)
    last = jnp.maximum(n_valid - 1, 0)
    X_last = jnp.take_along_axis(X, last[:, None, None, None], axis=1)
    logits = head_logits(params, params, cfg, X_last, ctx)[:, 0]
    return with_stats((jnp.where((n_valid > 0)[:, None], logits, last_logits), state), summary)


def decode_rows(params, state, tokens, active, cfg: ModelConfig, ctx: RunContext, max_seq_len: int,
                track_mtp: bool = False):
    """One decode step of the rows where `active` [B] holds (the others consume nothing): tokens [B] ->
    (logits [B, V] float32, state[, the step's statistics summary with ctx.stats]). Traced inside a program
    (decode_step, generation.generate_chunk)."""
    ctx = ctx.in_phase("decode")
    X, new_state, summary = _run_chunk(params, cfg, ctx, state, tokens[:, None], active.astype(jnp.int32),
                                       track_mtp)
    # Past the buffers' capacity the caches would be wrong, and a token id outside the vocabulary has no embedding
    # (the gather would clamp it): say so with NaN rather than a plausible token. Checking on the host would need
    # a device read per step. The NaN goes into the row's streams, so every logit of the row is NaN through the head
    # (a NaN input makes each of its dot products NaN): a select on the [B, V] logits would be a pass of its own over
    # them (XLA does not fuse it into the head's GEMM; 2 x 132 MB at batch 256).
    invalid = (state.positions >= max_seq_len) | (tokens < 0) | (tokens >= cfg.vocab_size)
    X = jnp.where(invalid[:, None, None, None], jnp.asarray(jnp.nan, X.dtype), X)
    return with_stats((head_logits(params, params, cfg, X, ctx)[:, 0], new_state), summary)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "max_seq_len", "track_mtp"), donate_argnames=("state",))
def decode_step(params, state: DecodeState, tokens, *, cfg: ModelConfig, ctx: RunContext, max_seq_len: int,
                track_mtp: bool = False):
    """One token per sequence: tokens [B] -> (logits [B, V] float32, state[, statistics summary with ctx.stats])."""
    return decode_rows(params, state, tokens, jnp.ones(tokens.shape, bool), cfg, ctx, max_seq_len, track_mtp)


@flax.struct.dataclass
class GenerationState:
    """A batch of rows generating (Model.generate's prompts, the server's requests): their decode state, the token
    each feeds next, how many tokens each has produced, whether each is done (finished, or a free row) and how each
    samples. generation.py runs the steps."""
    decode: DecodeState
    last_token: jax.Array     # [B] int32: token to feed next
    generated: jax.Array      # [B] int32: tokens produced so far per row
    done: jax.Array           # [B] bool
    sampling: Sampling
