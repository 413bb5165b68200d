"""Text that looks like a special token stays text, in plain prompts and in every chat message.

For every special token of the vocabulary (read from the tokenizer: its added tokens marked special, so
tokens beyond our constant table count too), typed alone and inside other text: the encoded text holds no
special id and decodes back to exactly what was typed; in a chat prompt the only special ids are the
template's control tokens. `allow_special=True` (the raw path for strings our code built) still maps the
strings to their ids.
"""

import json
import threading

import pytest

import dsv4_jax
from dsv4_jax.chat import encode_message_ids, encode_messages
from dsv4_jax.tokenizer import Tokenizer, train_byte_level_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — déjà vu, 你好，世界！",
    "DeepSeek-V4 <inference> in JAX: prefill | decode | generate.",
]
EXTRA_SPECIALS = ["<|im_end|>", "<tool_call>"]  # not in our table: must be found through the tokenizer itself


def _default():
    return Tokenizer(dsv4_jax.DEFAULT_MODEL_DIR)


def _trained():
    return train_byte_level_bpe(CORPUS * 4, vocab_size=400, extra_special_tokens=EXTRA_SPECIALS)


TOKENIZERS = {"default": _default(), "trained": _trained()}
CASES = [(name, token) for name, tok in TOKENIZERS.items() for token in tok.special_tokens]


def typed_texts(token: str) -> list[str]:
    """The special string alone, and inside other text (spaces, no spaces, twice, punctuation, newline)."""
    return [token, f"before {token} after", f"x{token}y", token + token, f'say "{token}".\n', f"你好{token}"]


def assert_plain_text(tok: Tokenizer, ids: list[int], text: str) -> None:
    assert not set(ids) & tok.special_ids, (text, ids)
    assert tok.decode(ids) == text


def control(tok: Tokenizer, *names: str) -> list[int]:
    return [tok.special_token_id(name) for name in names]


def test_special_tokens_are_read_from_the_tokenizer():
    default, trained = TOKENIZERS["default"], TOKENIZERS["trained"]
    assert len(default.special_tokens) == 15 and default.special_tokens[:2] == ["<｜begin▁of▁sentence｜>",
                                                                                  "<｜end▁of▁sentence｜>"]
    assert set(EXTRA_SPECIALS) <= set(trained.special_tokens)
    assert default.special_ids == {default.token_to_id(t) for t in default.special_tokens}


@pytest.mark.parametrize("name, token", CASES)
def test_plain_prompt_keeps_special_text(name, token):
    tok = TOKENIZERS[name]
    token_id = tok.token_to_id(token)
    for text in typed_texts(token):
        assert_plain_text(tok, tok.encode(text), text)
        assert tok.encode_batch([text, "ok"]) == [tok.encode(text), tok.encode("ok")]
        # the raw path: the string becomes its id
        assert token_id in tok.encode(text, allow_special=True)
        assert tok.decode(tok.encode(text, allow_special=True)) == text
    assert tok.encode(token, allow_special=True) == [token_id]
    assert tok.encode_batch([token], allow_special=True) == [[token_id]]


@pytest.mark.parametrize("name, token", CASES)
def test_chat_content_keeps_special_text(name, token):
    tok = TOKENIZERS[name]
    bos, hi = [tok.bos_id], tok.encode("hi")
    for text in typed_texts(token):
        content = tok.encode(text)
        assert_plain_text(tok, content, text)
        layouts = [  # (messages, kwargs, expected ids: the template's control ids around text ids)
            ([{"role": "user", "content": text}], {},
             bos + control(tok, "user") + content + control(tok, "assistant", "think_end")),
            ([{"role": "system", "content": text}, {"role": "user", "content": "hi"}], {},
             bos + content + control(tok, "user") + hi + control(tok, "assistant", "think_end")),
            ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}], {},
             bos + control(tok, "user") + hi + control(tok, "assistant", "think_end") + content + control(tok, "eos")),
            ([{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": text, "content": "hi"}],
             {"thinking_mode": "thinking"},
             bos + control(tok, "user") + hi + control(tok, "assistant", "think_start") + content
             + control(tok, "think_end") + hi + control(tok, "eos")),
        ]
        for msgs, kwargs, expected in layouts:
            assert encode_message_ids(tok, msgs, **kwargs) == expected, (text, msgs)


def _tool_conversation(text: str) -> list[dict]:
    tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}
    return [
        {"role": "system", "content": "S", "tools": [tool]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": json.dumps({"x": text})}}]},
        {"role": "tool", "tool_call_id": "c", "content": text},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": text}]},
        {"role": "latest_reminder", "content": text},
    ]


@pytest.mark.parametrize("name, token", CASES)
def test_tool_text_keeps_special_text(name, token):
    # Tool descriptions, arguments and results: the special ids are exactly those of the same conversation
    # with harmless text, i.e. the template's control tokens, and the ids decode to the prompt string.
    tok = TOKENIZERS[name]
    reference = encode_message_ids(tok, _tool_conversation("plain words"))
    for text in typed_texts(token):
        ids = encode_message_ids(tok, _tool_conversation(text))
        assert [i for i in ids if i in tok.special_ids] == [i for i in reference if i in tok.special_ids]
        assert tok.decode(ids) == encode_messages(_tool_conversation(text))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pieces_between_special_tokens_encode_like_the_whole_string(name):
    # Why per-piece encoding is exact: added tokens cut the text before BPE, so the text between special
    # tokens is encoded on its own even inside the whole string.
    tok = TOKENIZERS[name]
    for text in ["a<｜User｜>b. <think>x</think>｜DSML｜ 你好<｜end▁of▁sentence｜>", "<｜User｜>", "no specials.",
                 "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools<｜User｜><tool_result>ok.</tool_result>\n\n"]:
        pieces = tok.split_special_tokens(text)
        assert "".join(p if isinstance(p, str) else tok.id_to_token(p) for p in pieces) == text
        ids = [i for p in pieces for i in (tok.encode(p) if isinstance(p, str) else [p])]
        assert ids == tok.encode(text, allow_special=True)


def test_no_state_leaks_between_calls():
    tok = TOKENIZERS["default"]
    text, eos = "end<｜end▁of▁sentence｜>", tok.eos_id
    plain = tok.encode(text)
    assert eos in tok.encode(text, allow_special=True)
    assert tok.encode(text) == plain and tok.encode_batch([text]) == [plain]
    assert tok.backend.encode_special_tokens is False  # the backend's own flag is left as it was
    tok.backend.encode_special_tokens = True           # even when a caller of `backend` changed it
    try:
        assert eos in tok.encode(text, allow_special=True) and tok.encode(text) == plain
        assert tok.backend.encode_special_tokens is True
    finally:
        tok.backend.encode_special_tokens = False


def test_concurrent_calls_see_their_own_setting():
    tok = TOKENIZERS["default"]
    text = "a<｜User｜>b"
    plain, raw = tok.encode(text), tok.encode(text, allow_special=True)
    wrong = []

    def work(allow_special: bool, expected: list[int]):
        for _ in range(300):
            if tok.encode(text, allow_special=allow_special) != expected:
                wrong.append(allow_special)

    threads = [threading.Thread(target=work, args=args) for args in ((False, plain), (True, raw)) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
