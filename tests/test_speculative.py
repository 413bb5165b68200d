"""Speculative decoding with the MTP block (dsv4_jax/speculative.py): the deferred commit leaves exactly the state
that plain decoding of the accepted tokens leaves, greedy output is lossless, and the rejection sampler's output
distribution is the target's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import engine, generation, presets, speculative
from dsv4_jax.sampling import Sampling

K_MAX = 3
CORRECT_ACCEPT = speculative.accept


@pytest.fixture(scope="module")
def tiny_exact():
    """Random tiny model, float32 without quantization roundings: chunked and single-token arithmetic then differ
    by float32 rounding only, so no rounding decision can make the comparisons below flip."""
    return dsv4_jax.init_random(presets.tiny(), seed=3, dtype="float32", simulate_quant=False, max_seq_len=512,
                                max_batch=3)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"), donate_argnames=("state",))
def _read_then_commit(params, state, tokens, n_read, n_commit, *, cfg, ctx):
    X, read_layers, deferred = engine.read_chunk(params, cfg, ctx, state, tokens, n_read)
    return engine.commit_chunk(params, cfg, ctx, state, read_layers, deferred, X, tokens, n_read, n_commit,
                               track_mtp=True)


def _feed_one_at_a_time(model, state, tokens, n_commit):
    """Plain decoding: single-token chunks, row b taking part in the first n_commit[b] of them."""
    logits = jnp.zeros((tokens.shape[0], model.config.vocab_size), jnp.float32)
    for i in range(tokens.shape[1]):
        active = jnp.asarray((i < n_commit).astype(np.int32))
        logits, state = engine.prefill_chunk(model.params, state, jnp.asarray(tokens[:, i:i + 1]), active, logits,
                                             cfg=model.config, ctx=model.context, track_mtp=True)
    return state


def _assert_states_equal(a, b, where):
    leaves_a, tree = jax.tree_util.tree_flatten_with_path(a)
    leaves_b = jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), where
    for (path, x), y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        name = f"{where}: {jax.tree_util.keystr(path)}"
        if np.issubdtype(x.dtype, np.integer):
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            finite = np.isfinite(y)
            np.testing.assert_array_equal(np.isfinite(x), finite, err_msg=name)
            scale = max(float(np.max(np.abs(y[finite]), initial=0.0)), 1e-6)
            np.testing.assert_allclose(x[finite], y[finite], rtol=0, atol=2e-5 * scale, err_msg=name)


def _mixed_commit_run(model, n_steps, commit_all_drafts=False, check_every=10):
    """Prompts of mixed lengths, then n_steps verify chunks of K_MAX + 1 tokens (random stand-in drafts) with a
    random accepted count per row, committed by read_chunk + commit_chunk; the same accepted tokens fed one at a
    time to a second state. Compares every state leaf every `check_every` steps."""
    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size
    lengths = np.array([3, 126, 60], np.int32)              # row 1 crosses the window and an HCA boundary early
    prompts = rng.integers(1, vocab, (3, int(lengths.max()))).astype(np.int32)
    _, spec_state = model.prefill(prompts, lengths, track_mtp=True)
    _, plain_state = model.prefill(prompts, lengths, track_mtp=True)
    positions = lengths.copy()
    for step in range(n_steps):
        chunk = rng.integers(1, vocab, (3, K_MAX + 1)).astype(np.int32)
        n_read = np.full(3, K_MAX + 1, np.int32)
        n_read[step % 3] = 0 if step % 5 == 0 else n_read[step % 3]    # a finished row now and then
        n_commit = np.where(n_read > 0, rng.integers(1, K_MAX + 2, 3), 0).astype(np.int32)
        committed = n_read if commit_all_drafts else n_commit
        spec_state = _read_then_commit(model.params, spec_state, jnp.asarray(chunk), jnp.asarray(n_read),
                                       jnp.asarray(committed), cfg=model.config, ctx=model.context)
        plain_state = _feed_one_at_a_time(model, plain_state, chunk, n_commit)
        positions += n_commit
        if (step + 1) % check_every == 0 or step == n_steps - 1:
            _assert_states_equal(spec_state, plain_state, f"after step {step}")
    return positions


def test_deferred_commit_equals_plain_decoding(tiny_exact):
    """Window rings, compressor pending tokens, compressed caches, indexer keys, the MTP window, its streams and
    the positions after mixed accepted counts, across the 128 window and the 4 / 128 compression boundaries."""
    positions = _mixed_commit_run(tiny_exact, n_steps=60)
    assert positions.min() > 128 and positions.max() > 256, positions      # both boundaries crossed


# Layers 1..6 repeat (CSA, HCA): the scanned backbone's deferred commit runs inside its lax.scan.
SCANNED = presets.tiny().replace(n_layers=8, compress_ratios=(0, 4, 128, 4, 128, 4, 128, 0, 0))


@pytest.fixture(scope="module")
def scanned_exact():
    return dsv4_jax.init_random(SCANNED, seed=3, dtype="float32", simulate_quant=False, max_seq_len=512,
                                max_batch=3, scan_layers=True)


def test_deferred_commit_of_a_scanned_model_equals_plain_decoding(scanned_exact):
    assert scanned_exact.scan_layers
    positions = _mixed_commit_run(scanned_exact, n_steps=36, check_every=12)
    assert positions.max() > 128, positions


def test_scanned_speculative_greedy_equals_greedy(scanned_exact):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    base = scanned_exact.generate(prompts, max_new_tokens=40)
    result = scanned_exact.generate(prompts, max_new_tokens=40, speculative_tokens=2)
    _assert_same_greedy_tokens(scanned_exact, prompts, base.tokens, result.tokens, "scanned, k=2")


def test_committing_rejected_drafts_is_detected(tiny_exact):
    """The check above can fail: committing every drafted token (what a verify that commits as it reads would do)
    leaves a state unlike plain decoding's."""
    with pytest.raises(AssertionError):
        _mixed_commit_run(tiny_exact, n_steps=4, commit_all_drafts=True, check_every=1)


@pytest.fixture(scope="module")
def default_f32():
    return dsv4_jax.load(dtype="float32", max_seq_len=512, max_batch=4)


# A near-tie: the top two logits closer than this (relative to the largest), where float32 rounding of a 1-row
# step and a (k+1)-row verify may pick either. Real divergences (a wrong state) are far larger than this.
TIE = 1e-3


def _assert_same_greedy_tokens(model, prompts, expected, got, what):
    """Equal token lists, except that a row may part at a near-tie: there both picks must be the teacher-forced
    model's top two with logits within TIE of each other (so no rounding decision can decide the check)."""
    for b, (want, have) in enumerate(zip(expected, got)):
        first = next((i for i in range(min(len(want), len(have))) if want[i] != have[i]), None)
        if first is None:
            assert len(want) == len(have), (what, b)
            continue
        logits = np.asarray(model.forward(np.array([prompts[b] + want[:first]], np.int32)))[0, -1]
        top2 = set(np.argsort(-logits)[:2].tolist())
        gap = float(np.sort(logits)[-1] - np.sort(logits)[-2]) / float(np.abs(logits).max())
        assert {want[first], have[first]} == top2 and gap < TIE, (
            f"{what}, row {b}: tokens part at {first} ({want[first]} vs {have[first]}), not at a near-tie "
            f"(top two {sorted(top2)}, gap {gap:.2e} of the largest logit)")


def test_greedy_speculative_equals_greedy(default_f32):
    """The packaged model's MTP block is trained, so drafts are accepted and rejected in the same batch; the
    tokens must equal plain greedy generation's exactly (mixed prompt lengths, k = 1 and 3)."""
    tok = default_f32.tokenizer
    texts = ["And it came to pass", "In the beginning God created the heaven and the earth. And", "Blessed"]
    prompts = [[tok.bos_id] + tok.encode(t) for t in texts]
    base = default_f32.generate(prompts, max_new_tokens=160)
    for k in (1, 3):
        result = default_f32.generate(prompts, max_new_tokens=160, speculative_tokens=k)
        _assert_same_greedy_tokens(default_f32, prompts, base.tokens, result.tokens, f"k={k}")
        assert 1.2 < result.acceptance <= k + 1, result.acceptance            # drafts really were accepted
        assert len(result.acceptance_rates) == k
        assert all(0 < r < 1 for r in result.acceptance_rates), result.acceptance_rates


@pytest.mark.slow
@pytest.mark.parametrize("which", ["default", "tiny_random"])
def test_greedy_speculative_equals_greedy_long(which):
    """500+ tokens per sequence, mixed prompt lengths, k = 1, 2, 3: the packaged model (drafts often accepted) and a
    random tiny model (drafts almost never accepted). Over this many tokens a row can reach a near-tie (at 488
    tokens, k = 3, the fourth prompt meets top logits 7.3103 / 7.3074, and the teacher-forced forward sides with the
    speculative pick), so rows may part there and only there."""
    if which == "default":
        model = dsv4_jax.load(dtype="float32", max_seq_len=1024, max_batch=4)
        tok = model.tokenizer
        texts = ["And it came to pass", "In the beginning God created the heaven and the earth. And the earth was",
                 "Blessed", "Now the serpent was more subtil than any beast of the field"]
        prompts = [[tok.bos_id] + tok.encode(t) for t in texts]
    else:
        model = dsv4_jax.init_random(presets.tiny(), seed=5, dtype="float32", max_seq_len=1024, max_batch=4)
        rng = np.random.default_rng(2)
        prompts = [rng.integers(2, 512, n).tolist() for n in (1, 7, 130, 40)]
    stops = [model.config.vocab_size + 1]                   # no stop token can end a row early
    base = model.generate(prompts, max_new_tokens=520, stop_tokens=stops)
    assert all(len(t) >= 500 for t in base.tokens) or which == "tiny_random"
    for k in (1, 2, 3):
        result = model.generate(prompts, max_new_tokens=520, stop_tokens=stops, speculative_tokens=k)
        _assert_same_greedy_tokens(model, prompts, base.tokens, result.tokens, f"k={k}")


def test_speculative_loop_never_touches_the_host_and_compiles_once(default_f32):
    """Sampled speculation (k = 2) inside the jitted loop: no host transfer, and further chunks (across ratio-4
    and ratio-128 boundaries) reuse the one compiled program."""
    model = default_f32
    prompts = np.array([[1, 5, 9, 11], [2, 7, 0, 0]], np.int32)
    logits, state = model.prefill(prompts, [4, 2], track_mtp=True)
    sampling = Sampling.rows(2, temperature=0.7, top_p=0.9, max_new_tokens=200)
    gen, _ = generation.start(state, logits, sampling)
    halt = jnp.zeros((2,), bool)
    kw = dict(cfg=model.config, ctx=model.context, max_seq_len=model.max_seq_len, chunk=8, speculative_tokens=2)
    gen, out = generation.generate_chunk(model.params, gen, halt, **kw)              # compiles
    compiled = generation.generate_chunk._cache_size()
    with jax.transfer_guard("disallow"):
        for _ in range(6):
            gen, out = generation.generate_chunk(model.params, gen, halt, **kw)
    assert generation.generate_chunk._cache_size() == compiled
    assert np.asarray(gen.decode.positions).min() > 40
    assert out.tokens.shape == (2, 8 * 3)


def test_generate_rejects_bad_speculative_requests(default_f32):
    with pytest.raises(ValueError, match="speculative_tokens must be an integer >= 0"):
        default_f32.generate([[1, 2]], max_new_tokens=4, speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative positions exceeds max_seq_len"):
        default_f32.generate([[1, 2]], max_new_tokens=509, speculative_tokens=2)
    no_mtp = dsv4_jax.init_random(presets.tiny().replace(n_mtp_layers=0, compress_ratios=(0, 4, 128, 4)), seed=0)
    with pytest.raises(ValueError, match="MTP block"):
        no_mtp.generate([[1, 2]], max_new_tokens=4, speculative_tokens=1)


# ---- sampled speculative generation against the model's exact distribution -------------------------------------

SAMPLING = dict(temperature=0.8, top_k=6, top_p=0.9)


def _filtered_np(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference of the sampling distribution: tempered softmax over the top_k tokens, then the smallest
    prefix (by probability) whose mass reaches top_p, renormalized."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    kept = order[:top_k]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    probs = np.where(before < top_p, probs, 0.0)
    out = np.zeros_like(scaled)
    out[kept] = probs / probs.sum()
    return out


def _exact_marginals(model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Distributions of the 2nd and 3rd sampled tokens after `prompt`, summed over every earlier choice, from
    teacher-forced logits of every prefix the filters allow. Category V: no token (an earlier EOS ended the row)."""
    vocab, eos = model.config.vocab_size, model.config.eos_token_id

    def dist(prefixes):
        logits = np.asarray(model.forward(np.array([prompt + list(t) for t in prefixes], np.int32)))[:, -1]
        return [np.append(_filtered_np(row, **SAMPLING), 0.0) for row in logits]
    ended = np.eye(vocab + 1)[vocab]
    (p1,) = dist([()])
    firsts = [t for t in range(vocab) if p1[t] > 0 and t != eos]
    p2_given = dict(zip(firsts, dist([(t,) for t in firsts])))
    second = p1[eos] * ended + sum(p1[a] * p2_given[a] for a in firsts)
    pairs = [(a, b) for a in firsts for b in range(vocab) if p2_given[a][b] > 0 and b != eos]
    third = second[eos] * ended + p1[eos] * ended + sum(
        p1[a] * p2_given[a][b] * p3 for (a, b), p3 in zip(pairs, dist(pairs)))
    return second, third


def _chi_square_against(samples: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's statistic; categories expected below 5 samples are pooled into one."""
    counts = np.bincount(samples, minlength=len(expected)).astype(np.float64)
    want = expected * len(samples)
    if counts[want == 0].sum():
        return float("inf")                                # a token the filters exclude was emitted
    small = want < 5
    counts = np.append(counts[~small], counts[small].sum())
    want = np.append(want[~small], want[small].sum())
    return float(np.sum((counts - want) ** 2 / np.maximum(want, 1e-12)))


def _sampled_statistics(model, rows: int = 4096):
    prompt = [1, 2, 3, 4]
    result = model.generate([prompt] * rows, max_new_tokens=3, speculative_tokens=2, seed=11, **SAMPLING)
    vocab = model.config.vocab_size
    tokens = np.array([row + [vocab] * (3 - len(row)) for row in result.tokens])     # V: ended by an EOS
    second, third = _exact_marginals(model, prompt)
    return _chi_square_against(tokens[:, 1], second), _chi_square_against(tokens[:, 2], third)


@pytest.fixture(scope="module")
def tiny_vocab16():
    """A random tiny model over 16 tokens: 4,096 independent sequences in one batch."""
    return dsv4_jax.init_random(presets.tiny(vocab_size=16), seed=0, dtype="float32", max_seq_len=16,
                                max_batch=4096)


# At most 15 degrees of freedom: P(statistic > 50) < 1e-5 for a correct sampler.
CHI2_LIMIT_16 = 50.0


def test_sampled_speculative_tokens_follow_the_models_distribution(tiny_vocab16):
    """The 2nd and 3rd tokens (drafted by the MTP block and verified, k = 2, temperature / top-k / top-p applied to
    both) are distributed as the model's own sampling distribution says, summed over the earlier tokens."""
    second, third = _sampled_statistics(tiny_vocab16)
    assert second < CHI2_LIMIT_16 and third < CHI2_LIMIT_16, (second, third)


@pytest.mark.slow                                           # recompiles the loop: ~45 s
def test_sampled_check_catches_a_wrong_acceptance_rule(tiny_vocab16, monkeypatch):
    monkeypatch.setattr(speculative, "accept", _accept_without_residual)
    jax.clear_caches()                                     # retrace the loop with the wrong rule
    try:
        second, third = _sampled_statistics(tiny_vocab16)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert max(second, third) > 3 * CHI2_LIMIT_16, (second, third)


# ---- the rejection sampler, on distributions we choose ----------------------------------------------------------

VOCAB = 6


def _target_and_draft():
    """Fixed target p_j and draft q_j over 6 tokens, unlike each other (q puts mass where p has none)."""
    p = np.array([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                  [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                  [0.30, 0.10, 0.10, 0.20, 0.20, 0.10]])
    q = np.array([[0.10, 0.40, 0.10, 0.10, 0.10, 0.20],
                  [0.30, 0.05, 0.30, 0.05, 0.20, 0.10]])
    return p, q


def _emitted_tokens(accept_rule, n_samples: int, seed: int):
    """n_samples independent draft-verify steps with k = 2: drafts from q, accept_rule against p. Returns
    (first emitted token, second emitted token or -1 where only one came) [n_samples]."""
    p, q = _target_and_draft()
    p_j, q_j = jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)
    keys = jax.random.split(jax.random.key(seed), n_samples)

    def one(key):
        draft_key, verify_key = jax.random.split(key)
        drafts = jax.random.categorical(draft_key, jnp.log(q_j), axis=-1).astype(jnp.int32)     # [2]
        n_acc, token = accept_rule(drafts[None], q_j[None], p_j[None], verify_key[None])      # one row, its key
        emitted = jnp.where(jnp.arange(3) < n_acc[0], jnp.append(drafts, 0), -1)
        emitted = jnp.where(jnp.arange(3) == n_acc[0], token[0], emitted)
        return emitted[0], emitted[1]

    first, second = jax.jit(jax.vmap(one))(keys)
    return np.asarray(first), np.asarray(second)


def _chi_square(samples: np.ndarray, expected: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=VOCAB).astype(np.float64)
    nonzero = expected > 0
    if counts[~nonzero].sum():
        return float("inf")                                # a token the target never emits was emitted
    want = expected[nonzero] * counts.sum()
    return float(np.sum((counts[nonzero] - want) ** 2 / want))


# chi-square with 4-5 degrees of freedom: P(statistic > 30) < 2e-5, so a correct sampler fails about never, while the
# wrong rules below land in the thousands with these sample counts.
CHI2_LIMIT = 30.0


def _check_distribution(accept_rule, seed: int = 0):
    p, _ = _target_and_draft()
    first, second = _emitted_tokens(accept_rule, 200_000, seed)
    return _chi_square(first, p[0]), _chi_square(second[second >= 0], p[1])


def test_rejection_sampling_emits_the_target_distribution():
    """Each emitted token is distributed as the target's p at its position: the first always, the second in the
    steps that accepted the first draft."""
    first, second = _check_distribution(CORRECT_ACCEPT)
    assert first < CHI2_LIMIT and second < CHI2_LIMIT, (first, second)


def _accept_without_residual(drafts, q, p, keys):
    """A wrong rule: the correction drawn from p instead of norm(max(0, p - q))."""
    n_acc, _ = CORRECT_ACCEPT(drafts, q, p, keys)
    p_next = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    other = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    return n_acc, jax.vmap(jax.random.categorical)(other, jnp.log(p_next)).astype(jnp.int32)


def _accept_always(drafts, q, p, keys):
    """A wrong rule: every draft accepted (the bonus from p_k)."""
    batch, k = drafts.shape
    token = jax.vmap(jax.random.categorical)(keys, jnp.log(p[:, k])).astype(jnp.int32)
    return jnp.full((batch,), k, jnp.int32), token


@pytest.mark.parametrize("wrong_rule", [_accept_without_residual, _accept_always])
def test_a_wrong_acceptance_rule_fails_the_distribution_check(wrong_rule):
    first, second = _check_distribution(wrong_rule)
    assert max(first, second) > 10 * CHI2_LIMIT, (first, second)


def test_greedy_acceptance_is_argmax_verification():
    """One-hot p and q (temperature 0): accept while the draft is the target's argmax; the next token is the
    target's argmax at the first mismatch, or after the last draft."""
    vocab = 5
    target = np.array([[2, 4, 1, 3], [2, 0, 1, 3], [0, 4, 1, 3]])         # argmax p_0..p_3 per row
    drafts = np.array([[2, 4, 1], [2, 4, 1], [2, 4, 1]])
    p = jax.nn.one_hot(target, vocab)
    q = jax.nn.one_hot(drafts, vocab)
    n_acc, token = speculative.accept(jnp.asarray(drafts, jnp.int32), q, p, jax.random.split(jax.random.key(0), 3))
    np.testing.assert_array_equal(np.asarray(n_acc), [3, 1, 0])
    np.testing.assert_array_equal(np.asarray(token), [3, 0, 0])
