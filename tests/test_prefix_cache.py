"""The prefix cache (dsv4_jax/prefix_cache.py): continuing from a cached prefix gives what prefilling the whole prompt
gives, at every kind of boundary (inside the first window, across it, on and off multiples of 4 and 128, with
compact FP8 caches, with speculative decoding), for prompt ends and completion ends; it is bounded and evicts the
least recently used; the server reports the reuse (OpenAI's cached_tokens) and shows the cache on /health."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import openai
import pytest
from serving_runs import serving

import dsv4_jax
from dsv4_jax.prefix_cache import PrefixCache

MAX_SEQ_LEN = 512
PROMPT = np.random.default_rng(21).integers(2, 4096, 300).tolist()
# inside the first window, on / off multiples of 4, across the 128-token window and the 128-token HCA entries
BOUNDARIES = (1, 5, 64, 127, 128, 129, 131, 200, 256, 257, 299)


def _model(**options):
    """float32 without the trained fake-quant roundings, as tests/test_decode.py's chunked-prefill check (with them
    a value on an FP8 rounding tie may round the other way in another chunking: ~1e-4 on the logits)."""
    return dsv4_jax.load(dtype="float32", simulate_quant=False, max_seq_len=MAX_SEQ_LEN, max_batch=2, **options)


@pytest.fixture(scope="module")
def plain():
    return _model()


@pytest.fixture(scope="module")
def cached():
    return _model(prefix_cache=64 << 20)


@pytest.fixture(scope="module")
def plain_logits(plain):
    return np.asarray(plain.prefill(np.array([PROMPT], np.int32))[0])


def _in_pieces(model, boundary):
    """The prompt prefilled without the cache in the pieces a continuation from `boundary` makes: up to the boundary,
    on to the last token, the last token. (logits, state)"""
    _, state = model.prefill(np.array([PROMPT[:boundary]], np.int32))
    _, state = model.prefill(np.array([PROMPT[boundary:-1]], np.int32), state=state)
    return model.prefill(np.array([PROMPT[-1:]], np.int32), state=state)


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_continuing_from_a_prefix_equals_prefilling_the_whole_prompt(cached, plain, plain_logits, boundary):
    """The snapshot is an exact copy (the logits and every state buffer bit for bit those of the same pieces
    prefilled without the cache), and those pieces give the whole prefill up to float32 rounding."""
    cached.prefix_cache.clear()
    cached.prefill_prompts([PROMPT[:boundary + 1]])              # an earlier prompt: kept but its last token
    logits, state, taken = cached.prefill_prompts([PROMPT])
    assert taken == [boundary]
    assert int(jax.device_get(state.positions)[0]) == len(PROMPT)
    want_logits, want_state = _in_pieces(plain, boundary)
    assert np.array_equal(np.asarray(logits), np.asarray(want_logits))
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    # chunked prefill's float32 rounding: measured <= 7e-6 on logits of size ~5
    np.testing.assert_allclose(np.asarray(logits), plain_logits, atol=5e-5, rtol=0)


def test_a_resent_prompt_is_not_prefilled_again(cached, plain, plain_logits):
    cached.prefix_cache.clear()
    first = cached.generate([PROMPT], max_new_tokens=6)
    hits = cached.prefix_cache.hits
    again = cached.generate([PROMPT], max_new_tokens=6)
    assert first.cached_tokens == [0] and again.cached_tokens == [len(PROMPT) - 1]      # all but the last token
    assert cached.prefix_cache.hits == hits + 1
    assert again.tokens == first.tokens == plain.generate([PROMPT], max_new_tokens=6).tokens


@pytest.mark.parametrize("boundary", (129, 256, 299))
def test_greedy_tokens_from_a_cached_prefix_are_those_of_a_whole_prefill(cached, plain, boundary):
    cached.prefix_cache.clear()
    cached.generate([PROMPT[:boundary + 1]], max_new_tokens=2)
    out = cached.generate([PROMPT], max_new_tokens=12)
    assert out.cached_tokens[0] >= boundary
    assert out.tokens == plain.generate([PROMPT], max_new_tokens=12).tokens


def test_a_completion_end_is_continued(cached, plain):
    """The next prompt extends the prompt and the completion: the row the device finished (it consumed all but the
    last generated token) is reused."""
    cached.prefix_cache.clear()
    first = cached.generate([PROMPT[:100]], max_new_tokens=10)
    follow = PROMPT[:100] + first.tokens[0] + PROMPT[200:230]
    out = cached.generate([follow], max_new_tokens=8)
    assert out.cached_tokens == [100 + len(first.tokens[0]) - 1]
    assert out.tokens == plain.generate([follow], max_new_tokens=8).tokens


def test_a_batch_takes_each_row_from_its_own_prefix(cached, plain):
    cached.prefix_cache.clear()
    a, b = PROMPT[:150], PROMPT[20:90]
    cached.generate([a[:131], b[:64]], max_new_tokens=1)
    out = cached.generate([a, b], max_new_tokens=8)
    assert out.cached_tokens == [130, 63]
    assert out.tokens == plain.generate([a, b], max_new_tokens=8).tokens


@pytest.mark.parametrize("boundary", (5, 129, 257))
def test_compact_fp8_caches(boundary):
    """Compact FP8 caches with the trained roundings (what they are for): the continuation equals the same pieces
    prefilled without the cache bit for bit; against the whole prefill an FP8 rounding tie may fall the other way in
    another chunking (~2e-4 on logits of size ~5)."""
    options = dict(dtype="float32", max_seq_len=MAX_SEQ_LEN, kv_cache_dtype="fp8")
    plain = dsv4_jax.load(**options)
    cached = dsv4_jax.load(prefix_cache=16 << 20, **options)
    cached.prefill_prompts([PROMPT[:boundary + 1]])
    logits, _, taken = cached.prefill_prompts([PROMPT])
    assert taken == [boundary]
    assert np.array_equal(np.asarray(logits), np.asarray(_in_pieces(plain, boundary)[0]))
    whole = np.asarray(plain.prefill(np.array([PROMPT], np.int32))[0])
    np.testing.assert_allclose(np.asarray(logits), whole, atol=2e-3, rtol=0)


def test_speculative_decoding_continues_only_from_rows_that_kept_the_mtp_window(cached, plain):
    """A prefix prefilled without the MTP block's window cannot serve speculative decoding (its drafts read that
    window); one that kept it can, and speculative greedy output is the plain greedy output."""
    cached.prefix_cache.clear()
    cached.generate([PROMPT[:131]], max_new_tokens=1)                       # no MTP window kept
    first = cached.generate([PROMPT[:200]], max_new_tokens=1, speculative_tokens=2)
    assert first.cached_tokens == [0]
    out = cached.generate([PROMPT[:260]], max_new_tokens=12, speculative_tokens=2)
    assert out.cached_tokens == [199]
    assert out.tokens == plain.generate([PROMPT[:260]], max_new_tokens=12).tokens


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(plain):
    row = plain.state_bytes(1)
    cache = PrefixCache(2 * row + row // 2, row, plain.init_pool)
    assert cache.slots == 2 and cache.info()["bytes"] == 0               # nothing allocated before the first save
    state = plain.init_state(1)
    for key in ((1, 2, 3), (1, 2, 4)):
        cache.save(key, state, 0, False)
    assert cache.lookup((1, 2, 3, 9))[1] == 3                           # (1, 2, 3) is now the most recent
    cache.save((7, 8), state, 0, False)                                 # evicts (1, 2, 4)
    assert cache.lookup((1, 2, 4, 9))[1] == 0 and cache.lookup((1, 2, 3, 9))[1] == 3
    assert cache.lookup((7, 8, 9))[1] == 2
    assert cache.lookup((7, 8))[1] == 0                        # the last token is always prefilled: not a hit
    info = cache.info()
    assert info["entries"] == 2 and info["bytes"] == 2 * row and info["hits"] == 3 and info["misses"] == 2
    assert PrefixCache(row - 1, row, plain.init_pool).enabled is False
    with pytest.raises(ValueError, match="prefix_cache must be a number of bytes"):
        _model(prefix_cache=-1)


def test_restoring_and_saving_read_nothing_back(cached, monkeypatch):
    """The snapshot copies are device-side and the positions are known on the host: prefill_prompts and
    prefill_prompt_steps from a cached prefix run under transfer_guard("disallow") without a jax.device_get (a
    read would wait for whatever the device has queued before it: a server's decode chunk in flight)."""
    cached.prefix_cache.clear()
    cached.prefill_prompts([PROMPT[:64]])
    cached.prefill_prompts([PROMPT[:100]])                              # compiles the continuation
    cached.prefix_cache.clear()
    cached.prefill_prompts([PROMPT[:64]])
    reads = []
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or np.asarray(x))
    with jax.transfer_guard("disallow"):
        _, _, taken = cached.prefill_prompts([PROMPT[:100]])
        steps = cached.prefill_prompt_steps(PROMPT[:130], 8)
        for _ in steps:
            pass
    assert taken == [63] and reads == []


# ---- the server -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    from dsv4_jax.serving.scheduler import Scheduler
    model = _model(prefix_cache=32 << 20)
    with serving(Scheduler(model, chunk=4, max_queue=16).start(), "dsv4-default") as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300), model


def test_a_conversation_through_the_server_reuses_its_last_prompt(server, plain):
    url, client, model = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    cached = []
    for turn in range(3):
        reply = client.chat.completions.create(model="dsv4-default", messages=messages, max_tokens=6, temperature=0)
        usage = reply.usage
        cached.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And another one, number {turn + 2}?"}]
    assert cached[0][1] == 0
    for (before, _), (after, hit) in zip(cached, cached[1:]):
        assert before - 1 <= hit < after                  # at least the previous prompt but its last token
    stream = client.chat.completions.create(model="dsv4-default", messages=messages[:-2], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1     # sent again: all but one
    health = httpx.get(url + "/health").json()["prefix_cache"]
    assert health["entries"] >= 3 and health["hits"] >= 3 and health["cached_tokens"] >= sum(h for _, h in cached)
    completion = client.completions.create(model="dsv4-default", prompt="The capital of France", max_tokens=5,
                                           temperature=0)
    again = client.completions.create(model="dsv4-default", prompt="The capital of France", max_tokens=5,
                                      temperature=0)
    assert again.choices[0].text == completion.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    ids = [model.tokenizer.bos_id] + model.tokenizer.encode("The capital of France")
    want = plain.generate([ids], max_new_tokens=5).tokens[0]
    assert model.tokenizer.decode([t for t in want if t != model.config.eos_token_id]) == again.choices[0].text


def test_the_memory_plan_counts_the_pool(plain):
    from dsv4_jax.memory_plan import memory_plan
    row = plain.state_bytes(1)
    off = memory_plan(plain.config, max_seq_len=MAX_SEQ_LEN, dtype="float32")
    on = memory_plan(plain.config, max_seq_len=MAX_SEQ_LEN, dtype="float32", prefix_cache=5 * row + 1)
    assert off.prefix_cache == 0 and on.prefix_cache == 5 * row and on.total == off.total + 5 * row
    assert "prefix cache" in on.table()


def test_the_server_continues_a_finished_completion(server, plain):
    """A completion the device finished (max_tokens here) is kept: a prompt that extends the prompt and the
    completion continues from it (the prompt and all but the last generated token)."""
    _, client, _ = server
    prompt = PROMPT[40:140]
    generated = plain.generate([prompt], max_new_tokens=6).tokens[0]
    first = client.completions.create(model="dsv4-default", prompt=prompt, max_tokens=6, temperature=0)
    assert first.choices[0].finish_reason == "length" and len(generated) == 6
    follow = prompt + generated + PROMPT[300 - 20:]
    second = client.completions.create(model="dsv4-default", prompt=follow, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) + len(generated) - 1
    want = plain.generate([follow], max_new_tokens=4).tokens[0]
    tok = plain.tokenizer
    assert second.choices[0].text == tok.decode([t for t in want if t != plain.config.eos_token_id])


def test_model_complete_reports_what_it_continued(cached):
    """Model.complete over a conversation: the second turn continues from the first turn's prompt."""
    cached.prefix_cache.clear()
    turn = [{"role": "user", "content": "Who was Moses?"}]
    first = cached.complete(turn, temperature=0.0, max_new_tokens=6)
    turn += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And Aaron?"}]
    second = cached.complete(turn, temperature=0.0, max_new_tokens=6)
    assert first.cached_tokens == 0
    assert len(first.prompt_token_ids) - 1 <= second.cached_tokens < len(second.prompt_token_ids)
