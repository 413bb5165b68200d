"""Text in, text out (`Model.complete`, dsv4_jax/text.py): stop strings held back and cut, chat messages, the
command line's defaults, and batches padded to a few compiled sizes (Model.generate)."""

import os

import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import generation
from dsv4_jax.text import SAMPLING_DEFAULTS, TextStream, split_batch
from dsv4_jax.tokenizer import Tokenizer

DEFAULT_MODEL = dsv4_jax.DEFAULT_MODEL_DIR
HAS_DEFAULT_MODEL = os.path.isfile(os.path.join(DEFAULT_MODEL, "model.safetensors"))
PROMPTS = ["And the LORD spake unto Moses", "In the beginning", "Then", "And it came to pass, when the king"]


@pytest.fixture(scope="module")
def model():
    if not HAS_DEFAULT_MODEL:
        pytest.skip("the packaged default model is not in this checkout")
    return dsv4_jax.load(dtype="float32", max_batch=4, max_seq_len=128, prefill_chunk=16)


def _emitted_by_brute_force(text: str, stops: list[str]) -> str:
    """What may be shown of `text` while generation goes on: everything but the longest end that could still grow
    into a stop string (or, once one occurs, everything before it)."""
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[:min(hits)]
    held = max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
    return text[:len(text) - held]


@pytest.mark.parametrize("stops", [["said unto"], ["LORD said", "zz"], ["Moses, Go"], ["\n", "LORD s"]])
def test_text_stream_holds_back_then_cuts(stops):
    tok = Tokenizer(DEFAULT_MODEL)
    text = "And the LORD said unto Moses, Go in, speak unto Pharaoh"
    ids = tok.encode(text)
    stream = TextStream(tok, stops, stop_ids=[tok.eos_id])
    shown = ""
    for n, token in enumerate(ids):
        shown += stream.push([token])
        so_far = tok.decode(ids[:n + 1])
        if not so_far.endswith("\ufffd"):
            assert shown == _emitted_by_brute_force(so_far, stops), (n, shown, so_far)
    shown += stream.flush()
    hits = [text.find(s) for s in stops if s in text]
    assert shown == stream.text == (text[:min(hits)] if hits else text)
    assert stream.stopped == bool(hits)
    if hits:                                     # the ids end with the token that completed the stop string
        assert any(s in tok.decode(stream.token_ids) for s in stops)
        assert not any(s in tok.decode(stream.token_ids[:-1]) for s in stops)


def test_text_stream_leaves_out_the_stop_token_and_ignores_what_follows():
    tok = Tokenizer(DEFAULT_MODEL)
    ids = tok.encode("And the LORD")
    stream = TextStream(tok, [], stop_ids=[tok.eos_id])
    text = stream.push(ids + [tok.eos_id] + tok.encode(" more")) + stream.flush()
    assert text == "And the LORD" and stream.stopped and stream.token_ids == ids + [tok.eos_id]


def test_inputs_single_or_batch():
    conversation = [{"role": "user", "content": "hi"}]
    assert split_batch("hi") == (["hi"], True)
    assert split_batch(conversation) == ([conversation], True)
    assert split_batch(["a", conversation]) == (["a", conversation], False)
    for bad in ([], 3, [3], [{"role": "user"}, "a"]):
        with pytest.raises(ValueError, match="prompts must be"):
            split_batch(bad)


def test_complete_is_generate_with_the_command_lines_defaults(model):
    tok = model.tokenizer
    out = model.complete(PROMPTS[0], max_new_tokens=20, seed=7)
    ids = [tok.bos_id] + tok.encode(PROMPTS[0])
    ref = model.generate([ids], max_new_tokens=20, seed=7, temperature=SAMPLING_DEFAULTS["temperature"],
                         top_p=SAMPLING_DEFAULTS["top_p"], top_k=SAMPLING_DEFAULTS["top_k"])
    assert out.prompt_token_ids == ids
    assert out.token_ids == ref.tokens[0] and out.finish_reason == ref.finish_reasons[0]
    eos = tok.eos_id
    assert out.text == tok.decode([t for t in ref.tokens[0] if t != eos])
    with pytest.raises(TypeError, match="unexpected keyword"):
        model.complete("hi", temprature=0.5)


def test_complete_stops_on_strings_in_a_batch(model):
    full = model.complete(PROMPTS[:3], max_new_tokens=24, temperature=0)
    stops = [" the", ",", ";"]
    cut = model.complete(PROMPTS[:3], max_new_tokens=24, temperature=0, stop=stops)
    for whole, part in zip(full, cut):
        hits = [whole.text.find(s) for s in stops if s in whole.text]
        if hits:
            assert part.text == whole.text[:min(hits)] and part.finish_reason == "stop"
            assert part.token_ids == whole.token_ids[:len(part.token_ids)]
        else:
            assert (part.text, part.token_ids, part.finish_reason) == (whole.text, whole.token_ids,
                                                                       whole.finish_reason)
    assert any(s in w.text for w in full for s in stops)          # the check above cut something


def test_complete_takes_chat_messages(model):
    tok = model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who was king?"}]
    out = model.complete(messages, max_new_tokens=8, temperature=0)
    from dsv4_jax.chat import encode_message_ids
    assert out.prompt_token_ids == encode_message_ids(tok, messages, thinking_mode="chat")
    same = model.complete("Who was king?", system="Be brief.", max_new_tokens=8, temperature=0)
    assert same.prompt_token_ids == out.prompt_token_ids and same.token_ids == out.token_ids


def test_batches_share_a_few_programs_and_padding_changes_no_row(model):
    """Every batch size up to max_batch runs on batch 1, 2 or 4 programs; greedy rows equal the prompts alone."""
    tok = model.tokenizer
    own = dsv4_jax.load(dtype="float32", max_batch=4, max_seq_len=96, prefill_chunk=16)   # programs of its own
    ids = [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    before = generation.generate_chunk._cache_size()
    alone = [own.generate([p], max_new_tokens=10).tokens[0] for p in ids]
    for n in (1, 2, 3, 4):
        result = own.generate(ids[:n], max_new_tokens=10)
        assert result.tokens == alone[:n], n
    assert generation.generate_chunk._cache_size() - before == 3           # batches 1, 2 and 4 (3 runs on 4)
    sampled = own.generate(ids[:3], max_new_tokens=10, temperature=1.0, seed=5)
    padded_away = own.generate(ids[:3] + [[tok.bos_id]], max_new_tokens=10, temperature=1.0, seed=5)
    assert sampled.tokens == padded_away.tokens[:3]             # the padding row is a row like any other


@pytest.mark.parametrize("option,value,message", [
    ("temperature", "abc", "temperature must be a number"), ("top_p", None, "top_p must be a number"),
    ("seed", -1, "seed must be an integer"), ("seed", 1.5, "seed must be an integer"),
    ("max_new_tokens", True, "max_new_tokens must be a positive integer"), ("top_k", "3", "top_k must be an integer"),
])
def test_bad_sampling_options_are_one_line_errors(option, value, message):
    model = dsv4_jax.load()
    with pytest.raises(ValueError, match=message):
        model.complete("x", **{option: value})
    with pytest.raises(ValueError, match="stop_tokens must be token ids"):
        model.generate([[1, 2]], max_new_tokens=2, stop_tokens=["eos"])
