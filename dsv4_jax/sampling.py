"""On-device sampling: greedy, temperature, top-k, top-p, all from traced parameters (no recompiles), each row with
its own parameters and key (`Sampling`).

A row with temperature T > 0 draws argmax_i (logits_i / T + g_i) over the tokens its filters keep, g the Gumbel
noise of its key, one value per vocabulary id: the Gumbel-max form of drawing from softmax(logits / T) restricted
to the kept tokens. The filters keep a prefix of the tokens in the order of a sort by probability (top-k, then
top-p), and on a GPU a sort of [rows, vocab] costs more than a decode step's layers from batch 32 up. So
`sample_rows` takes the argmax alone when every row is greedy, the Gumbel-max over the whole vocabulary when no row
filters, and otherwise tries the filters without a sort first (`_draw_by_rejection`: the Gumbel-max over the
tokens ranked before the last candidate, until the candidate is kept), sorting only when a row is still open after
MAX_REJECTION_ROUNDS rounds. Every path gives a row the token the sorting path gives it, so a row's tokens do not
depend on the other rows of its batch, with one exception: top-p without the sort sums the probabilities in another
order, so a token whose preceding mass lies within float32 rounding of top_p can be kept on one path and dropped on
the other."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .ops.threshold_top_k import kth_largest_key, order_keys


def _filtered_sorted(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(order, tempered logits in descending order, the kept ranks): the distribution temperature, top-k and top-p
    leave, over the last axis. top_k 0 and top_p >= 1 keep every token. The kept ranks are a prefix (the leading
    run of ranks within top-k whose preceding probability is below top_p; the top token always stays)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, top_k, vocab)
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top_p >= 1 is off exactly, whatever the float32 sums of the tail round to
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((before < top_p) | (top_p >= 1))
    n_kept = jnp.where(jnp.all(keep, axis=-1, keepdims=True), vocab, jnp.argmin(keep, axis=-1, keepdims=True))
    return order, sorted_logits, rank < n_kept


def _ranked_before(scaled: jax.Array, token: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens before token [B] in the sort's order (descending tempered logit, then ascending
    id)."""
    value = jnp.take_along_axis(scaled, token[:, None], axis=-1)
    ids = jnp.arange(scaled.shape[-1])
    return (scaled > value) | ((scaled == value) & (ids < token[:, None]))


def _kept(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] bool in vocabulary order: the tokens each row's filters keep (a sort of every row). The kept ranks are
    a prefix, so a token is kept iff it is not after the last kept one in the sort's order (descending tempered
    logit, then ascending id): one comparison with that token, no scatter back to vocabulary order."""
    order, _, keep = _filtered_sorted(logits, temperature[:, None], top_k[:, None], top_p[:, None])
    last = jnp.take_along_axis(order, jnp.sum(keep, axis=-1, keepdims=True) - 1, axis=-1)[:, 0]
    scaled = logits / jnp.maximum(temperature[:, None], 1e-6)
    return _ranked_before(scaled, last) | (jnp.arange(logits.shape[-1]) == last[:, None])


def _draw(logits: jax.Array, noise: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
          filtered: bool) -> jax.Array:
    """Token ids [B] from logits and Gumbel noise [B, V] and each row's temperature, top_k, top_p [B]: the argmax of
    the tempered logits plus the noise over the kept tokens (`filtered`; else over all of them: the same tokens
    where no row filters), or of the logits for temperature 0."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    perturbed = logits / jnp.maximum(temperature, 1e-6)[:, None] + noise
    if filtered:
        perturbed = jnp.where(_kept(logits, temperature, top_k, top_p), perturbed, -jnp.inf)
    return jnp.where(temperature > 0, jnp.argmax(perturbed, axis=-1).astype(jnp.int32), greedy)


# The most rounds of _draw_by_rejection before a batch with a row still open falls back to the sort. A round
# accepts a row's candidate at least as often as the row's filters keep probability (top-p 0.95: 95%; an open
# row's next candidate comes from a smaller set that the kept tokens fill more of); the slowest case, top-k on a
# flat distribution, halves the candidate's rank each round in expectation (17 halvings from 129,280 to 1).
# Most batches stop after one or two rounds; the loop exits once every row is decided.
MAX_REJECTION_ROUNDS = 16


def _top_k_mass(scaled: jax.Array, weight: jax.Array, k: jax.Array) -> jax.Array:
    """[B]: the sum of weight [B, V] over each row's k [B] highest tempered logits scaled [B, V] (k = V: all)."""
    keys = order_keys(scaled)
    threshold = kth_largest_key(keys, k)[:, None]
    above = keys > threshold
    at_threshold = jnp.max(jnp.where(keys == threshold, weight, 0.0), axis=-1)     # every tied token's weight
    ties_kept = k - jnp.sum(above, axis=-1)
    return jnp.sum(jnp.where(above, weight, 0.0), axis=-1) + ties_kept * at_threshold


def _draw_by_rejection(logits: jax.Array, noise: jax.Array, temperature: jax.Array, top_k: jax.Array,
                       top_p: jax.Array, max_rounds: int = MAX_REJECTION_ROUNDS):
    """(token ids [B], decided [B] bool): each decided row's token is the one the sorting path draws, found without
    a sort. The candidate is the Gumbel-max over a set that holds every kept token (first the whole vocabulary).
    The kept tokens are a prefix of the sort's order, so a kept candidate (its rank below top_k and the probability
    of the tokens before it below top_p: one pass over the row) is the answer; otherwise every kept token ranks
    before it, and the next candidate is the Gumbel-max over those. Where a drawn row has both top_k and top_p, its
    top-p renormalises over its top-k tokens: their sum comes from the k-th value, found by a radix search over
    the float32 bits (8 passes over the batch, only then). Greedy rows are decided (the caller takes their argmax).
    Rounds run until every row is decided or max_rounds."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    perturbed = scaled + noise
    weight = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    k = jnp.where(top_k > 0, top_k, vocab)
    both = (temperature > 0) & (top_k > 0) & (top_p < 1)
    mass_total = jax.lax.cond(jnp.any(both), _top_k_mass, lambda scaled, weight, k: jnp.sum(weight, axis=-1),
                              scaled, weight, jnp.where(both, k, vocab))

    def kept(token):
        before = _ranked_before(scaled, token)
        rank = jnp.sum(before, axis=-1)
        mass = jnp.sum(jnp.where(before, weight, 0.0), axis=-1) / mass_total
        return (rank < k) & ((mass < top_p) | (top_p >= 1))

    def next_round(state):
        token, decided, rounds = state
        # an open row's candidate ranks after every kept token (the top token is always kept: rank 0, mass 0)
        inner = jnp.argmax(jnp.where(_ranked_before(scaled, token), perturbed, -jnp.inf), axis=-1)
        token = jnp.where(decided, token, inner.astype(jnp.int32))
        return token, decided | kept(token), rounds + 1

    def still_open(state):
        _, decided, rounds = state
        return (rounds < max_rounds) & ~jnp.all(decided)

    token = jnp.argmax(perturbed, axis=-1).astype(jnp.int32)
    state = (token, (temperature <= 0) | kept(token), jnp.int32(1))
    token, decided, _ = jax.lax.while_loop(still_open, next_round, state)
    return token, decided


def _draw_filtered(logits: jax.Array, noise: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, max_rounds: int = MAX_REJECTION_ROUNDS) -> jax.Array:
    """_draw(filtered=True)'s tokens: by rejection where that decides every row, else by the sort. The arrays go to
    the cond as operands, not closed over: called outside jit, a closure's arrays would be constants of a new
    program each call."""
    args = (logits, noise, temperature, top_k, top_p)
    token, decided = _draw_by_rejection(*args, max_rounds=max_rounds)
    token = jnp.where(temperature > 0, token, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return jax.lax.cond(jnp.all(decided), lambda token, *_: token, lambda _, *args: _draw(*args, filtered=True),
                        token, *args)


@jax.jit
@jax.named_scope("sampling")
def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """logits [B, V] float32 -> token ids [B] int32, every row with the same parameters and one key. temperature 0
    means greedy; top_k 0 and top_p 1 disable."""
    per_row = lambda v, dtype: jnp.broadcast_to(jnp.asarray(v, dtype), logits.shape[:1])  # noqa: E731
    noise = jax.random.gumbel(key, logits.shape, jnp.float32)
    return _draw_filtered(logits, noise, per_row(temperature, jnp.float32), per_row(top_k, jnp.int32),
                          per_row(top_p, jnp.float32))


@jax.named_scope("sampling")
def probabilities(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution `sample` draws from for temperature > 0, float32 [..., V] in vocabulary order."""
    order, sorted_logits, keep = _filtered_sorted(logits, temperature, top_k, top_p)
    sorted_probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(sorted_probs, jnp.argsort(order, axis=-1), axis=-1)


@flax.struct.dataclass
class Sampling:
    """How each row samples, [B] each: temperature (0: greedy), top_k (0: off), top_p (1: off), max_new_tokens,
    stop_tokens [B, S] (padded with -1) and key [B, 2] uint32 (the row's threefry key data: its i-th generated
    token is drawn with the key folded with i, so a row samples the same tokens in any batch). The one sampling
    type of Model.generate, the server's rows and speculative decoding."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new_tokens: jax.Array
    stop_tokens: jax.Array
    key: jax.Array

    @classmethod
    def rows(cls, batch: int, *, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1, stop_tokens=(), seed=0,
             first_choice: int = 0) -> Sampling:
        """`batch` rows with the given values (scalars, or one per row; stop_tokens a list of ids, or one list
        per row), row b keyed by `seed` and choice first_choice + b (row_key). Built on the host."""
        # host arrays go over explicitly (jax.device_put): Model.generate runs under jax.transfer_guard("disallow")
        per_row = lambda v, dtype: jax.device_put(np.broadcast_to(np.asarray(v, dtype), (batch,)))  # noqa: E731
        nested = len(stop_tokens) > 0 and np.ndim(stop_tokens[0]) > 0
        stops = [list(s) for s in stop_tokens] if nested else [list(stop_tokens)] * batch
        width = max(1, max(len(s) for s in stops))
        stop_array = np.full((batch, width), -1, np.int32)
        for b, s in enumerate(stops):
            stop_array[b, :len(s)] = s
        keys = _row_keys(seed_words(seed), jax.device_put(np.arange(batch, dtype=np.int32) + first_choice))
        return cls(per_row(temperature, np.float32), per_row(top_k, np.int32), per_row(top_p, np.float32),
                   per_row(max_new_tokens, np.int32), jax.device_put(stop_array), keys)


def seed_words(seed: int) -> jax.Array:
    """A 64-bit seed as the uint32 [2] (high, low) key data of threefry."""
    return jax.device_put(np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32))


@jax.jit
def _row_keys(words: jax.Array, choices: jax.Array) -> jax.Array:
    """row_key of each of choices [B]: uint32 [B, 2]."""
    return jax.vmap(lambda c: row_key(words, c))(choices)


def row_key(words: jax.Array, choice: jax.Array) -> jax.Array:
    """A row's key data uint32 [2]: the seed's threefry key folded with the choice index (OpenAI `n`, or the row of
    a Model.generate batch)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"), choice))


def row_noise(sampling: Sampling, step: jax.Array, vocab: int) -> jax.Array:
    """float32 [B, vocab]: row b's Gumbel noise, one value per token id, from its key folded with step[b]."""
    def one(key_data, row_step):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), row_step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)
    return jax.vmap(one)(sampling.key, step)


@jax.named_scope("sampling")
def sample_rows(logits: jax.Array, step: jax.Array, sampling: Sampling) -> jax.Array:
    """Token ids [B]: row b drawn from logits[b] with its own parameters and its key folded with step[b]. One of
    three paths, by a `lax.switch` on the rows' parameters: every row greedy, the argmax alone; no row filtering,
    the Gumbel-max over the whole vocabulary; else the filters by rejection, or by each row's vocabulary sorted
    where that leaves a row open (_draw_filtered). The tokens are the same on every path (module docstring)."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    vocab = logits.shape[-1]
    paths = [lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
             lambda x: _draw(x, row_noise(sampling, step, vocab), temperature, top_k, top_p, filtered=False),
             lambda x: _draw_filtered(x, row_noise(sampling, step, vocab), temperature, top_k, top_p)]
    drawn = temperature > 0
    filters = drawn & ((top_k > 0) | (top_p < 1))
    path = jnp.where(jnp.any(filters), 2, jnp.where(jnp.any(drawn), 1, 0))
    return jax.lax.switch(path, paths, logits)


def is_stop(token: jax.Array, sampling: Sampling) -> jax.Array:
    """[B] bool: the token is one of its row's stop tokens (-1, no token, never is)."""
    return (token >= 0) & jnp.any(token[:, None] == sampling.stop_tokens, axis=-1)


def token_logprobs(logits: jax.Array, token: jax.Array, n_top: int):
    """(log-probability [B] of `token` under the model's distribution (the logits before temperature and
    filters), top ids [B, n_top], their log-probabilities [B, n_top])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(token, 0)[:, None], axis=-1)[:, 0]
    if not n_top:
        return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), logprobs[:, :0]
    top_lp, top_ids = jax.lax.top_k(logprobs, n_top)
    return chosen, top_ids.astype(jnp.int32), top_lp
