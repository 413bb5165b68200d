"""Speculative decoding with the MTP block (docs/model.md 4.8), the whole draft-verify-accept loop on the device.

One step, per sequence at committed position P with `last_token` (sampled, not yet consumed):
1. draft: the MTP block at P-1 reads the main streams of P-1 and last_token and proposes d1 for P+1; for k > 1 it is
   re-applied to its own output streams and its previous draft (on a scratch copy of its window, thrown away);
2. verify: the main model runs [last_token, d1, ..., dk] at P..P+k in one chunk without committing it
   (engine.read_chunk), giving the target distributions p_0..p_k;
3. accept: greedy, d_j is accepted while it equals argmax p_{j-1}; sampling, with probability min(1, p/q), else the
   correction is drawn from norm(max(0, p - q)) (Leviathan et al. / Chen et al.); if all k are accepted a bonus
   token is drawn from p_k. Temperature, top-k and top-p shape p and q alike; draft and verifier use independent
   random streams;
4. commit: the accepted prefix [last_token, d1..d_a] is committed (engine.commit_chunk), backbone and MTP window
   alike, so the state equals plain decoding's of the same tokens; the correction / bonus token is the next
   step's last_token.
Rows of a batch accept different counts in the same step; a fixed k keeps every shape static, so one program
serves each (k, batch) and no value is read on the host.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from . import engine
from .config import ModelConfig
from .layers.chunk import Chunk
from .model import head_logits, mtp_streams
from .run_context import RunContext
from .sampling import probabilities


@flax.struct.dataclass
class SpeculativeState:
    gen: engine.GenerationState
    steps: jax.Array          # [B] int32: verify steps each sequence took part in
    accepted: jax.Array       # [B, k] int32: steps in which draft j was accepted


def start(gen: engine.GenerationState, k: int) -> SpeculativeState:
    batch = gen.last_token.shape[0]
    return SpeculativeState(gen, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, k), jnp.int32))


# Sampling parameters and keys come two ways: one set for the whole batch (Model.generate: scalars and one raw key),
# or one per row (the server: [B] parameters and [B] typed keys, so a row's draws depend only on its own key).

def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row parameter [B] shaped to broadcast against [B, ..., V] arrays of `ndim` dims; scalars as they are."""
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _row_keys(key) -> bool:
    return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1


def _split(key, n: int) -> list:
    if _row_keys(key):
        return list(jax.vmap(lambda row_key: jax.random.split(row_key, n), out_axes=1)(key))
    return list(jax.random.split(key, n))


def _categorical(key, logits: jax.Array) -> jax.Array:
    if _row_keys(key):
        return jax.vmap(jax.random.categorical)(key, logits)
    return jax.random.categorical(key, logits, axis=-1)


def _uniform(key, shape: tuple) -> jax.Array:
    if _row_keys(key):
        return jax.vmap(lambda row_key: jax.random.uniform(row_key, shape[1:]))(key)
    return jax.random.uniform(key, shape)


def draft(params, cfg: ModelConfig, ctx: RunContext, state, last_token, k: int, key, sp):
    """k draft tokens [B, k] and their draft distributions q float32 [B, k, V] (one-hot argmax when greedy)."""
    cache = state.mtp[0]                                   # a scratch copy: drafts are never committed
    X_main = state.mtp_hidden[:, None]
    token = last_token
    position = state.positions - 1
    ones = jnp.ones_like(position)
    drafts, dists = [], []
    for j, draft_key in enumerate(_split(key, k)):
        X, cache, _ = mtp_streams(params, cfg, ctx, X_main, Chunk(token[:, None], position + j, ones), cache)
        logits = head_logits(params, params["mtp"][0], cfg, X, ctx)[:, 0]
        q = _distribution(logits, sp)
        sampled = _categorical(draft_key, jnp.log(q)).astype(jnp.int32)
        token = jnp.where(sp.temperature > 0, sampled, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        drafts.append(token)
        dists.append(q)
        X_main = X                                         # re-applied to its own output streams
    return jnp.stack(drafts, axis=1), jnp.stack(dists, axis=1)


def _distribution(logits, sp) -> jax.Array:
    """The sampling distribution [..., V]: `sample`'s for temperature > 0, the argmax one-hot for greedy."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    temperature, top_k, top_p = (_per_row(x, logits.ndim) for x in (sp.temperature, sp.top_k, sp.top_p))
    return jnp.where(temperature > 0, probabilities(logits, temperature, top_k, top_p), greedy)


def accept(drafts, q, p, key):
    """Rejection sampling over k drafts [B, k] drawn from q [B, k, V], against the target p [B, k+1, V].
    Returns (accepted count a [B] in 0..k, next token [B]: the correction drawn from norm(max(0, p_a - q_{a+1}))
    when a < k, else the bonus drawn from p_k). With one-hot p and q this is greedy verification exactly."""
    batch, k = drafts.shape
    accept_key, token_key = _split(key, 2)
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = _uniform(accept_key, (batch, k))
    ok = u * q_draft < p_draft                             # u < p/q, i.e. probability min(1, p/q); q(d) > 0
    n_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_next = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(q, jnp.minimum(n_accepted, k - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_next - jnp.where((n_accepted < k)[:, None], q_next, 0.0), 0.0)
    # p == q leaves nothing, but then every draft is accepted; keep the draw defined anyway
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    token = _categorical(token_key, jnp.log(residual)).astype(jnp.int32)
    return n_accepted, token


def speculative_step(params, cfg: ModelConfig, ctx: RunContext, spec: SpeculativeState, sp, max_seq_len: int,
                     k: int, row_keys=None):
    """One draft-verify-accept-commit step of every active sequence. Returns (emitted tokens [B, k+1], -1 past
    each row's count, new SpeculativeState). `sp` holds scalars or per-row [B] values (stop_tokens [n] or [B, n]);
    with `row_keys` ([B] typed keys) row b draws from its key folded with its generated count, and gen.key is
    left as it is."""
    gen = spec.gen
    state = gen.decode
    active = ~gen.done
    if row_keys is None:
        key, draft_key, verify_key = jax.random.split(gen.key, 3)
    else:
        key = gen.key
        draft_key, verify_key = _split(jax.vmap(jax.random.fold_in)(row_keys, gen.generated), 2)
    drafts, q = draft(params, cfg, ctx.in_phase("decode"), state, gen.last_token, k, draft_key, sp)

    chunk = jnp.concatenate([gen.last_token[:, None], drafts], axis=1)                  # [B, k+1]
    n_read = jnp.where(active, k + 1, 0).astype(jnp.int32)
    X, read_layers, deferred = engine.read_chunk(params, cfg, ctx, state, chunk, n_read)
    logits = head_logits(params, params, cfg, X, ctx)                                    # [B, k+1, V]
    n_accepted, token = accept(drafts, q, _distribution(logits, sp), verify_key)
    # Past the buffers' capacity the caches would be wrong: as the plain decode step, say so with NaN logits.
    overflow = state.positions + k >= max_seq_len

    emitted = jnp.concatenate([drafts, jnp.zeros_like(token)[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n_accepted[:, None], token[:, None], emitted)
    # A row ends at its first stop token (kept) or when its budget is spent; nothing past that is emitted.
    stops = sp.stop_tokens[None, None, :] if sp.stop_tokens.ndim == 1 else sp.stop_tokens[:, None, :]
    is_stop = jnp.any(emitted[..., None] == stops, axis=-1)         # emitted ids are >= 0: -1 pads nothing
    position = jnp.arange(k + 1)[None, :]
    first_stop = jnp.min(jnp.where(is_stop & (position <= n_accepted[:, None]), position, k + 1), axis=1)
    n_emit = jnp.minimum(jnp.minimum(n_accepted + 1, first_stop + 1), sp.max_new_tokens - gen.generated)
    n_emit = jnp.where(active & ~overflow, n_emit, 0)
    emitted = jnp.where(position < n_emit[:, None], emitted, -1)

    n_commit = jnp.where(active, n_accepted + 1, 0).astype(jnp.int32)
    decode = engine.commit_chunk(params, cfg, ctx, state, read_layers, deferred, X, chunk, n_read, n_commit,
                                 track_mtp=True)
    generated = gen.generated + n_emit
    done = gen.done | overflow | (first_stop < n_emit) | (generated >= sp.max_new_tokens)
    new_gen = engine.GenerationState(decode, jnp.where(active, token, gen.last_token), generated, done, key)
    steps = spec.steps + active
    accepted = spec.accepted + (active[:, None] & (jnp.arange(k)[None, :] < n_accepted[:, None]))
    return emitted, SpeculativeState(new_gen, steps, accepted)


def run_steps(params, cfg: ModelConfig, ctx: RunContext, spec: SpeculativeState, sp, max_seq_len: int, chunk: int,
              k: int, row_keys=None):
    """Up to `chunk` speculative steps in one `lax.while_loop`, stopping early once every sequence is done (traced
    inside a caller's jit; `sp` and `row_keys` as `speculative_step` takes them). Returns (tokens [B, chunk * (k+1)],
    in order, with -1 where nothing was produced; spec)."""
    batch = spec.gen.last_token.shape[0]
    out = jnp.full((batch, chunk * (k + 1)), -1, jnp.int32)

    def cond(carry):
        i, spec, _ = carry
        return (i < chunk) & ~jnp.all(spec.gen.done)

    def body(carry):
        i, spec, out = carry
        emitted, spec = speculative_step(params, cfg, ctx, spec, sp, max_seq_len, k, row_keys)
        out = jax.lax.dynamic_update_slice_in_dim(out, emitted, i * (k + 1), axis=1)
        return i + 1, spec, out

    _, spec, out = jax.lax.while_loop(cond, body, (jnp.int32(0), spec, out))
    return out, spec


@functools.partial(jax.jit, static_argnames=("cfg", "ctx", "max_seq_len", "chunk", "k"), donate_argnames=("spec",))
def generate_chunk(params, spec: SpeculativeState, sp, *, cfg: ModelConfig, ctx: RunContext, max_seq_len: int,
                   chunk: int, k: int):
    """`run_steps` for one batch-wide set of sampling parameters and key (Model.generate)."""
    return run_steps(params, cfg, ctx, spec, sp, max_seq_len, chunk, k)
