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

import jax
import jax.numpy as jnp

from . import engine
from .config import ModelConfig
from .layers.chunk import Chunk
from .model import head_logits, mtp_streams
from .run_context import RunContext
from .sampling import Sampling, probabilities


# Every row samples with its own parameters and key (sampling.Sampling), so a row's draws depend only on its own
# key folded with its generated count: the same tokens in any batch.

def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row parameter [B] shaped to broadcast against [B, ..., V] arrays of `ndim` dims."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _split(keys, n: int) -> list:
    """n independent [B] typed keys from [B] typed keys."""
    return list(jax.vmap(lambda row_key: jax.random.split(row_key, n), out_axes=1)(keys))


def _categorical(keys, logits: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.categorical)(keys, logits)


def _uniform(keys, shape: tuple) -> jax.Array:
    return jax.vmap(lambda row_key: jax.random.uniform(row_key, shape[1:]))(keys)


def draft(params, cfg: ModelConfig, ctx: RunContext, state, last_token, k: int, keys, sampling: Sampling):
    """k draft tokens [B, k] and their draft distributions q float32 [B, k, V] (one-hot argmax when greedy)."""
    cache = state.mtp[0]                                   # a scratch copy: drafts are never committed
    X_main = state.mtp_hidden[:, None]
    token = last_token
    position = state.positions - 1
    ones = jnp.ones_like(position)
    drafts, dists = [], []
    for j, draft_key in enumerate(_split(keys, k)):
        X, cache, _ = mtp_streams(params, cfg, ctx, X_main, Chunk(token[:, None], position + j, ones), cache)
        logits = head_logits(params, params["mtp"][0], cfg, X, ctx)[:, 0]
        q = _distribution(logits, sampling)
        sampled = _categorical(draft_key, jnp.log(q)).astype(jnp.int32)
        token = jnp.where(sampling.temperature > 0, sampled, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        drafts.append(token)
        dists.append(q)
        X_main = X                                         # re-applied to its own output streams
    return jnp.stack(drafts, axis=1), jnp.stack(dists, axis=1)


def _distribution(logits, sampling: Sampling) -> jax.Array:
    """The sampling distribution [..., V]: `sample`'s for temperature > 0, the argmax one-hot for greedy. When every
    row is greedy the one-hots alone (a `lax.cond`): `probabilities` sorts each row's vocabulary."""
    temperature, top_k, top_p = (_per_row(x, logits.ndim) for x in (sampling.temperature, sampling.top_k,
                                                                      sampling.top_p))

    def greedy(logits):
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def drawn(logits):
        return jnp.where(temperature > 0, probabilities(logits, temperature, top_k, top_p), greedy(logits))
    return jax.lax.cond(jnp.any(sampling.temperature > 0), drawn, greedy, logits)


def accept(drafts, q, p, keys):
    """Rejection sampling over k drafts [B, k] drawn from q [B, k, V], against the target p [B, k+1, V].
    Returns (accepted count a [B] in 0..k, next token [B]: the correction drawn from norm(max(0, p_a - q_{a+1}))
    when a < k, else the bonus drawn from p_k). With one-hot p and q this is greedy verification exactly."""
    batch, k = drafts.shape
    accept_key, token_key = _split(keys, 2)
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


def speculative_step(params, cfg: ModelConfig, ctx: RunContext, gen: engine.GenerationState, max_seq_len: int,
                     k: int):
    """One draft-verify-accept-commit step of every active sequence, each drawing with its own sampling row (its
    key folded with its generated count). Returns (emitted tokens [B, k+1], -1 past each row's count, the new
    GenerationState, accepted [B, k] bool: draft j of an active row was accepted)."""
    sampling = gen.sampling
    state = gen.decode
    active = ~gen.done
    row_keys = jax.random.wrap_key_data(sampling.key, impl="threefry2x32")
    draft_key, verify_key = _split(jax.vmap(jax.random.fold_in)(row_keys, gen.generated), 2)
    drafts, q = draft(params, cfg, ctx.in_phase("decode"), state, gen.last_token, k, draft_key, sampling)

    chunk = jnp.concatenate([gen.last_token[:, None], drafts], axis=1)                  # [B, k+1]
    n_read = jnp.where(active, k + 1, 0).astype(jnp.int32)
    X, read_layers, deferred = engine.read_chunk(params, cfg, ctx, state, chunk, n_read)
    logits = head_logits(params, params, cfg, X, ctx)                                    # [B, k+1, V]
    n_accepted, token = accept(drafts, q, _distribution(logits, sampling), verify_key)
    # Past the buffers' capacity the caches would be wrong: as the plain decode step, say so with NaN logits.
    overflow = state.positions + k >= max_seq_len

    emitted = jnp.concatenate([drafts, jnp.zeros_like(token)[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == n_accepted[:, None], token[:, None], emitted)
    # A row ends at its first stop token (kept) or when its budget is spent; nothing past that is emitted.
    is_stop = jnp.any(emitted[..., None] == sampling.stop_tokens[:, None, :], axis=-1)   # emitted ids are >= 0
    position = jnp.arange(k + 1)[None, :]
    first_stop = jnp.min(jnp.where(is_stop & (position <= n_accepted[:, None]), position, k + 1), axis=1)
    n_emit = jnp.minimum(jnp.minimum(n_accepted + 1, first_stop + 1), sampling.max_new_tokens - gen.generated)
    n_emit = jnp.where(active & ~overflow, n_emit, 0)
    emitted = jnp.where(position < n_emit[:, None], emitted, -1)

    n_commit = jnp.where(active, n_accepted + 1, 0).astype(jnp.int32)
    decode = engine.commit_chunk(params, cfg, ctx, state, read_layers, deferred, X, chunk, n_read, n_commit,
                                 track_mtp=True)
    generated = gen.generated + n_emit
    done = gen.done | overflow | (first_stop < n_emit) | (generated >= sampling.max_new_tokens)
    new_gen = gen.replace(decode=decode, last_token=jnp.where(active, token, gen.last_token), generated=generated,
                          done=done)
    accepted = active[:, None] & (jnp.arange(k)[None, :] < n_accepted[:, None])
    return emitted, new_gen, accepted
