"""Decode engine: prefill + one-token steps reproduce the teacher-forced forward, chunked prefill, batches of
different lengths, the on-device generation loop, no host transfers and no recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import engine, generation, presets
from dsv4_jax.sampling import Sampling
from dsv4_jax.state import state_bytes
from reference_np import reference_forward
from shared_decisions import DecisionRecorder, ModelDecisions, join_chunks, model_layers

SEQ = 300


@pytest.fixture(scope="module")
def exact_model(tiny_checkpoint):
    """float32 without the fake-quant roundings, so decode and forward can be compared at float32 precision."""
    return dsv4_jax.load(tiny_checkpoint[0], dtype="float32", simulate_quant=False, max_seq_len=320, max_batch=2,
                         prefill_chunk=64)


@pytest.fixture(scope="module")
def exact_forward(exact_model, tiny_tokens):
    return np.asarray(exact_model.forward(tiny_tokens))[0]


def _relative_error(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def _prefill_then_decode(model, tokens, prompt_len, steps_to):
    logits, state = model.prefill(tokens[:, :prompt_len])
    out = [np.asarray(logits)[0]]
    for p in range(prompt_len, steps_to):
        logits, state = model.decode(jnp.asarray(tokens[:, p]), state)
        out.append(np.asarray(logits)[0])
    return np.stack(out), state


@pytest.mark.parametrize("prompt_len, steps_to", [(5, 140), (130, SEQ)])
def test_prefill_and_decode_match_forward(exact_model, exact_forward, tiny_tokens, prompt_len, steps_to):
    """Prompt below / across the 128 window; the steps then cross multiples of 4 and of 128 (the window and
    the HCA entries completed at positions 127 and 255)."""
    logits, state = _prefill_then_decode(exact_model, tiny_tokens, prompt_len, steps_to)
    for i, row in enumerate(logits):
        pos = prompt_len - 1 + i
        err = _relative_error(row, exact_forward[pos])
        assert err < 1e-4, f"position {pos}: relative error {err:.2e} (measured ~2e-6)"
    assert int(state.positions[0]) == steps_to


def test_decode_with_quant_simulation_matches_reference(tiny_checkpoint, tiny_f32, tiny_tokens):
    """Prefill + decode steps with the FP8/FP4 fake-quant on equal the float64 reference of the same tokens. The
    reference takes the model's rounding and top-k decisions of every chunk and step (tests/shared_decisions.py,
    each checked to be the spec's up to float32 noise), so no rounding tie can decide the comparison. Prompt 64,
    steps to 200: across multiples of 4, the 128 window and the HCA entry completed at position 127."""
    model, cfg = tiny_f32, tiny_f32.config
    layers, prompt, end = model_layers(cfg), 64, 200
    prefill = DecisionRecorder(cfg, layers, engine.prefill_chunk.__wrapped__, cfg=cfg, ctx=model.context)
    step = DecisionRecorder(cfg, layers, engine.decode_step.__wrapped__, cfg=cfg, ctx=model.context,
                            max_seq_len=model.max_seq_len)
    (logits, state), records = prefill(model.params, model.init_state(1), jnp.asarray(tiny_tokens[:, :prompt]),
                                       jnp.array([prompt], jnp.int32), jnp.zeros((1, cfg.vocab_size), jnp.float32))
    chunks, ours = [(0, prompt, records)], [np.asarray(logits)[0]]
    for p in range(prompt, end):
        (logits, state), records = step(model.params, state, jnp.asarray(tiny_tokens[:, p]))
        chunks.append((p, 1, records))
        ours.append(np.asarray(logits)[0])
    decisions = ModelDecisions(join_chunks(chunks, {prefix: cfg.compress_ratios[i] for prefix, i in layers}))
    ref = reference_forward(cfg, tiny_checkpoint[1], tiny_tokens[:, :end], decisions=decisions)[0, prompt - 1:]
    print(f"{decisions.summary()}; max |logit diff| {np.abs(np.stack(ours) - ref).max():.2e}")
    np.testing.assert_allclose(np.stack(ours), ref, atol=1e-4, rtol=1e-4)   # measured ~4e-6


def test_chunked_prefill_equals_one_shot(tiny_checkpoint, exact_model, tiny_tokens):
    one_shot = dsv4_jax.load(tiny_checkpoint[0], dtype="float32", simulate_quant=False, max_seq_len=320,
                             prefill_chunk=512)
    logits_a, state_a = one_shot.prefill(tiny_tokens[:, :200])
    logits_b, state_b = exact_model.prefill(tiny_tokens[:, :200])          # internal chunks of 64
    # and in uneven pieces given by the caller: 3 + 61 + 136 tokens
    logits_c, state_c = exact_model.prefill(tiny_tokens[:, :3])
    logits_c, state_c = exact_model.prefill(tiny_tokens[:, 3:64], state=state_c)
    logits_c, state_c = exact_model.prefill(tiny_tokens[:, 64:200], state=state_c)
    for logits, state in ((logits_b, state_b), (logits_c, state_c)):
        assert _relative_error(np.asarray(logits), np.asarray(logits_a)) < 1e-5
        for a, b in zip(jax.tree_util.tree_leaves(state_a), jax.tree_util.tree_leaves(state)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_batch_of_different_lengths_equals_each_alone(exact_model, tiny_tokens):
    rng = np.random.default_rng(7)
    other = rng.integers(0, exact_model.config.vocab_size, (1, SEQ)).astype(np.int32)
    lengths = [37, 150]
    batch = np.zeros((2, 150), np.int32)
    batch[0, :37] = tiny_tokens[0, :37]
    batch[1] = other[0, :150]
    logits, state = exact_model.prefill(batch, lengths=lengths)
    together = [np.asarray(logits)]
    for step in range(12):
        nxt = np.array([tiny_tokens[0, 37 + step], other[0, 150 + step]], np.int32)
        logits, state = exact_model.decode(jnp.asarray(nxt), state)
        together.append(np.asarray(logits))
    together = np.stack(together, axis=1)                              # [2, 13, V]
    for b, (seq, length) in enumerate(((tiny_tokens, 37), (other, 150))):
        alone, _ = _prefill_then_decode(exact_model, seq, length, length + 12)
        assert _relative_error(together[b], alone) < 1e-5, f"sequence {b}"


def test_greedy_generate_equals_stepwise_argmax(exact_model, tiny_tokens):
    """The generation loop (one program) against decode steps and a host argmax (other programs). Without the
    fake-quant roundings: XLA:CPU does not promise two programs the same float32 bits, and with them a last-bit
    difference on a rounding tie could move a logit by far more than an argmax margin."""
    prompt = tiny_tokens[0, :20].tolist()
    result = exact_model.generate([prompt], max_new_tokens=40, temperature=0.0, chunk=16)
    logits, state = exact_model.prefill(np.array([prompt], np.int32))
    expected = []
    for _ in range(40):
        token = int(np.argmax(np.asarray(logits)[0]))
        expected.append(token)
        if token == exact_model.config.eos_token_id:
            break
        logits, state = exact_model.decode(jnp.asarray([token], jnp.int32), state)
    assert result.tokens[0] == expected
    assert result.finish_reasons == ["length" if len(expected) == 40 else "stop"]


def test_generate_streams_chunks_and_stops_on_stop_tokens(exact_model, tiny_tokens):
    """Two generation programs (the stop-token list has another shape), so without fake quant as above."""
    prompt = tiny_tokens[0, :20].tolist()
    free = exact_model.generate([prompt], max_new_tokens=30, chunk=8).tokens[0]
    stop = free[10]
    seen = []
    result = exact_model.generate([prompt], max_new_tokens=30, chunk=8, stop_tokens=[stop], stream=seen.append)
    first = free.index(stop)
    assert result.tokens[0] == free[:first + 1]
    assert result.finish_reasons == ["stop"]
    assert sum((chunk[0] for chunk in seen), []) == result.tokens[0]
    assert len(seen) >= 2   # the first token, then chunks


def test_sampling_options(tiny_f32, tiny_tokens):
    prompt = [tiny_tokens[0, :10].tolist()]
    greedy = tiny_f32.generate(prompt, max_new_tokens=12).tokens
    assert tiny_f32.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=1).tokens == greedy
    a = tiny_f32.generate(prompt, max_new_tokens=12, temperature=1.0, seed=3).tokens
    b = tiny_f32.generate(prompt, max_new_tokens=12, temperature=1.0, seed=3).tokens
    c = tiny_f32.generate(prompt, max_new_tokens=12, temperature=1.0, seed=4).tokens
    assert a == b and a != c


def test_sample_respects_top_k_and_top_p():
    from dsv4_jax.sampling import sample
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 50)), jnp.float32)
    order = np.argsort(-np.asarray(logits[0]))
    probs = np.asarray(jax.nn.softmax(logits[0]))[order]
    nucleus = order[: int(np.searchsorted(np.cumsum(probs), 0.5) + 1)]
    top_k, top_p = set(), set()
    for i in range(300):
        key = jax.random.PRNGKey(i)
        top_k.add(int(sample(logits, key, jnp.float32(1.0), jnp.int32(3), jnp.float32(1.0))[0]))
        top_p.add(int(sample(logits, key, jnp.float32(1.0), jnp.int32(0), jnp.float32(0.5))[0]))
    assert top_k == set(order[:3].tolist())
    assert top_p == set(nucleus.tolist())


def test_generate_rejects_bad_requests(tiny_f32):
    with pytest.raises(ValueError, match="exceeds max_seq_len=320"):
        tiny_f32.generate([[1] * 300], max_new_tokens=21)
    with pytest.raises(ValueError, match="temperature"):
        tiny_f32.generate([[1, 2]], temperature=float("nan"))
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_f32.generate([[1, 2]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        tiny_f32.generate([[1, 2]], top_p=0.0)
    with pytest.raises(ValueError, match="token ids"):
        tiny_f32.prefill(np.array([[1, 10**6]]))
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        tiny_f32.prefill(np.ones((1, 321), np.int32))
    state = tiny_f32.init_state(1)
    with pytest.raises(ValueError, match="positions must be 1 integers"):
        tiny_f32.prefill(np.ones((1, 4), np.int32), state=state, positions=[0, 0])
    with pytest.raises(ValueError, match="exceed max_seq_len"):                  # the positions the caller knows
        tiny_f32.prefill(np.ones((1, 4), np.int32), state=state, positions=[318])
    with pytest.raises(ValueError, match="step must be positive"):
        next(tiny_f32.prefill_prompt_steps([1, 2, 3], 0))


def test_decode_and_generate_never_touch_the_host(tiny_f32, tiny_tokens):
    logits, state = tiny_f32.prefill(tiny_tokens[:, :9])
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    _, state = tiny_f32.decode(token, state)                     # compile outside the guard
    sampling = Sampling.rows(1, max_new_tokens=50, stop_tokens=[1])
    halt = jnp.zeros((1,), bool)
    kwargs = dict(cfg=tiny_f32.config, ctx=tiny_f32.context, max_seq_len=tiny_f32.max_seq_len, chunk=8)
    gen = generation.start(tiny_f32.prefill(tiny_tokens[:, :9])[1], logits, sampling)[0]
    gen, out = generation.generate_chunk(tiny_f32.params, gen, halt, **kwargs)
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            _, state = tiny_f32.decode(token, state)
        gen, out = generation.generate_chunk(tiny_f32.params, gen, halt, **kwargs)
        gen, out = generation.generate_chunk(tiny_f32.params, gen, halt, **kwargs)
    assert out.tokens.shape == (1, 8)


def test_decode_compiles_once(tiny_f32, tiny_tokens):
    _, state = tiny_f32.prefill(tiny_tokens[:, :9])
    token = jnp.asarray([5], jnp.int32)
    _, state = tiny_f32.decode(token, state)
    compiled = engine.decode_step._cache_size()
    for _ in range(6):    # positions 10..15 cross a ratio-4 boundary
        _, state = tiny_f32.decode(token, state)
    assert engine.decode_step._cache_size() == compiled


def test_out_of_range_device_token_ids_give_nan_rows(tiny_f32, tiny_tokens, tiny_checkpoint):
    """A device array of ids is not read back on the host (that would be a sync per step): an id outside the
    vocabulary gives NaN logits, as a sequence past max_seq_len does; host ids are refused before the step."""
    vocab = tiny_f32.config.vocab_size
    for token, finite in ((5, True), (vocab, False), (-1, False)):
        _, state = tiny_f32.prefill(tiny_tokens[:, :9])
        logits, _ = tiny_f32.decode(jnp.asarray([token], jnp.int32), state)
        assert np.isfinite(np.asarray(logits)).all() == finite and (finite or np.isnan(np.asarray(logits)).all())
    # row by row: in a batch, only the row with the bad id is NaN, every logit of it; the other row's logits are
    # those of its step alone
    import dsv4_jax
    pair = dsv4_jax.load(tiny_checkpoint[0], dtype="float32", max_seq_len=320, max_batch=2)
    _, state = pair.prefill(np.concatenate([tiny_tokens[:, :9]] * 2))
    logits = np.asarray(pair.decode(jnp.asarray([5, vocab], jnp.int32), state)[0])
    _, alone = tiny_f32.prefill(tiny_tokens[:, :9])
    np.testing.assert_allclose(logits[0], np.asarray(tiny_f32.decode(jnp.asarray([5], jnp.int32), alone)[0])[0],
                               rtol=1e-5, atol=1e-5)
    assert np.isnan(logits[1]).all()
    with pytest.raises(ValueError, match=rf"tokens must be token ids in \[0, {vocab}\)"):
        tiny_f32.decode(np.array([vocab], np.int32), tiny_f32.prefill(tiny_tokens[:, :9])[1])


def test_state_bytes_flash_at_one_million_tokens():
    """Spec 5.1: bf16 caches take 21 CSA x (512 + 128) x 2 / 4 + 20 HCA x 512 x 2 / 128 = 6,880 bytes per token;
    the rings and compressor pending state add a constant."""
    n = 1 << 20
    total = state_bytes(presets.flash(), 1, n)
    per_token = 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128
    assert per_token == 6880
    constant = total - per_token * n
    assert 0 < constant < 0.01 * total, f"{total / 2**30:.2f} GiB"


def test_mtp_window_tracks_the_teacher_forced_mtp(tiny_checkpoint, tiny_tokens):
    """With track_mtp the state keeps the MTP block's window; a draft at every step equals the teacher-forced
    MTP logits (position p reads the main streams of p and token p+1)."""
    model = dsv4_jax.load(tiny_checkpoint[0], dtype="float32", simulate_quant=False, max_seq_len=320,
                          prefill_chunk=64, track_mtp=True)
    seq = 136
    tokens = tiny_tokens[:, :seq + 1]
    expected = np.asarray(model.forward_mtp(tokens[:, :seq], tokens[:, 1:seq + 1]))[0]
    _, state = model.prefill(tokens[:, :120])                  # internal chunks of 64: 64 + 56
    for p in range(119, seq):                                  # the MTP window crosses 128
        draft = np.asarray(model.mtp_draft(jnp.asarray(tokens[:, p + 1]), state))[0]
        assert _relative_error(draft, expected[p]) < 1e-4, f"position {p}"
        _, state = model.decode(jnp.asarray(tokens[:, p + 1]), state)


def test_context_buckets_give_the_same_generation(tiny_f32, monkeypatch):
    """With buckets of 64 positions (api.MIN_CONTEXT_BUCKET lowered from 4096 for the tiny model), prefill and
    generation read only the compressed entries their positions can see, and produce what the whole buffers do:
    the same greedy tokens, prefill logits within float32 noise."""
    from dsv4_jax import api
    model = tiny_f32
    prompt = np.random.default_rng(263).integers(0, model.config.vocab_size, (1, 40)).astype(np.int32)
    want_logits, _ = model.prefill(prompt)
    want = model.generate([list(prompt[0])], max_new_tokens=24).tokens
    monkeypatch.setattr(api, "MIN_CONTEXT_BUCKET", 64)
    assert [api.context_bucket(n, 320) for n in (40, 64, 65, 200, 256, 257)] == [64, 64, 128, 256, 256, None]
    got_logits, _ = model.prefill(prompt)
    programs = generation.generate_chunk._cache_size()
    got = model.generate([list(prompt[0])], max_new_tokens=24).tokens
    assert generation.generate_chunk._cache_size() - programs == 2          # chunks of 16: bounds 56 and 72
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    assert got == want
