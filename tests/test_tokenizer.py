"""Tokenizer wrapper and streaming detokenization, on a tiny byte-level BPE built here."""

import json

import pytest
import tokenizers

from dsv4_jax import tokenizer as T
from dsv4_jax.chat import encode_message_ids, encode_messages
from dsv4_jax.tokenizer import OFFICIAL_SPECIAL_IDS, StreamDecoder, Tokenizer, train_byte_level_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — déjà vu",
    "你好，世界！今天天气很好。",
    "DeepSeek-V4 inference in JAX: prefill, decode, generate.",
    "emoji 🙂🚀 and symbols ∑ ∫ √",
]
SPECIALS = list(OFFICIAL_SPECIAL_IDS)  # BOS first, EOS second: ids 0 and 1 as in the official vocab


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    path = tmp_path_factory.mktemp("tok")
    backend.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer(tok_dir)


def test_load_from_dir_or_file(tok_dir, tok):
    assert Tokenizer(tok_dir / "tokenizer.json").vocab_size == tok.vocab_size
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.vocab_size == 400
    assert not tok.is_official_vocab


def test_round_trip(tok):
    for text in CORPUS + ["", " leading space", "tabs\tand\nnewlines  ", "unseen: Ωmega ß ₿ 𝔘"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("hello") == tok.encode("hello")  # no BOS added
    assert tok.bos_id not in tok.encode("hello")


def test_special_tokens_recognised_only_with_allow_special(tok):
    assert not set(tok.encode("<｜User｜>hi<｜Assistant｜></think>")) & tok.special_ids  # default: plain text
    ids = tok.encode("<｜User｜>hi<｜Assistant｜></think>", allow_special=True)
    user, assistant, think_end = (tok.special_token_id(n) for n in ("user", "assistant", "think_end"))
    assert ids[0] == user and ids[-2:] == [assistant, think_end]
    assert tok.decode(ids[1:-2]) == "hi"
    assert tok.decode(ids) == "<｜User｜>hi<｜Assistant｜></think>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"

    messages = [{"role": "user", "content": "你好"}]
    prompt = encode_messages(messages, thinking_mode="thinking")
    ids = encode_message_ids(tok, messages, thinking_mode="thinking")
    assert ids == tok.encode(prompt, allow_special=True)
    assert ids[:2] == [tok.bos_id, user] and ids[-2:] == [assistant, tok.special_token_id("<think>")]
    assert tok.decode(ids) == prompt

    dsml = tok.special_token_id("dsml")
    assert dsml in tok.encode('<｜DSML｜invoke name="f">', allow_special=True)
    assert dsml not in tok.encode('<｜DSML｜invoke name="f">')
    assert tok.special_token_id("<｜latest_reminder｜>") == tok.special_token_id("latest_reminder")
    with pytest.raises(ValueError, match="not in this tokenizer"):
        tok.special_token_id("<｜nope｜>")


def test_special_token_ids_match_constants(tok):
    # every special token string of the spec exists in our file, at the position we trained it
    for i, token in enumerate(SPECIALS):
        assert tok.token_to_id(token) == i
    assert T.USER == "<｜User｜>" and "\uff5c" in T.USER and "\u2581" in T.BOS


def test_is_official_vocab_uses_the_official_table(tmp_path):
    # A fake vocab that places the special tokens at their official ids (ids beyond a tiny BPE).
    vocab = {chr(0x100 + i): i + 2 for i in range(10)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
    data = json.loads(backend.to_str())
    data["added_tokens"] = [
        {"id": tid, "content": tokstr, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for tokstr, tid in OFFICIAL_SPECIAL_IDS.items()
    ]
    data["model"]["vocab"].update({tokstr: tid for tokstr, tid in OFFICIAL_SPECIAL_IDS.items()})
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    official = Tokenizer(path)
    assert official.is_official_vocab
    assert official.special_token_id("user") == 128803 and official.special_token_id("think_start") == 128821
    assert official.encode("<｜User｜><｜Assistant｜></think>", allow_special=True) == [128803, 128804, 128822]
    assert official.vocab_size == 128845 + 1


def _stream(tok, ids, step):
    dec = StreamDecoder(tok)
    pieces = []
    for i in range(0, len(ids), step):
        pieces.append(dec.push(ids[i:i + step]))
    pieces.append(dec.flush())
    return dec, pieces


@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_decoder_multibyte(tok, step):
    text = "naïve café 你好 🙂🚀 ∑√ done<｜end▁of▁sentence｜>"
    ids = tok.encode(text, allow_special=True)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens do split characters
    dec, pieces = _stream(tok, ids, step)
    assert "".join(pieces) == text == dec.text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces[:-1]) or step > 1  # something was held back at step 1


def test_stream_decoder_single_ids_update_and_skip_special(tok):
    ids = tok.encode("<｜Assistant｜>你好 résumé<｜end▁of▁sentence｜>", allow_special=True)
    dec = tok.stream_decoder(skip_special_tokens=True)
    out = ""
    for n in range(1, len(ids) + 1):
        out += dec.update(ids[:n])  # the whole growing list each time
    out += dec.flush()
    assert out == "你好 résumé"
    with pytest.raises(ValueError, match="must extend"):
        dec.update([5])


def test_stream_decoder_invalid_bytes_flush(tok):
    # A lone UTF-8 lead byte never completes: held back, then flushed as U+FFFD like a full decode.
    lead = tok.encode("\U0001d518")[0]  # unseen 4-byte char: byte tokens, the first is the lead byte
    assert tok.decode([lead]).endswith("\ufffd")
    ids = tok.encode("ok ") + [lead]
    dec = StreamDecoder(tok)
    assert dec.push(ids) == "ok "
    assert dec.flush() == tok.decode(ids)[len("ok "):]
    assert dec.text == tok.decode(ids)


def test_train_helper(tmp_path):
    tok = train_byte_level_bpe(CORPUS, vocab_size=350)
    assert tok.bos_id == 0 and tok.eos_id == 1 and tok.special_token_id("user") == 2
    path = tok.save(tmp_path)
    again = Tokenizer(path)
    for allow_special in (False, True):
        assert again.encode("café 你好<｜User｜>", allow_special) == tok.encode("café 你好<｜User｜>", allow_special)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        Tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)  # a directory without tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="invalid tokenizer file") as info:
        Tokenizer(bad)
    assert "\n" not in str(info.value)
    # valid tokenizer without the DeepSeek special tokens
    plain = tokenizers.Tokenizer(tokenizers.models.BPE())
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match="has no token"):
        Tokenizer(tmp_path / "plain.json")


def test_encode_rejects_non_str(tok):
    with pytest.raises(ValueError, match="expects a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="encode_batch expects a str"):
        tok.encode_batch(["ok", None])


def test_load_carries_the_checkpoints_tokenizer_read_on_first_use(tmp_path):
    import shutil

    import dsv4_jax
    model = dsv4_jax.load()                                    # the packaged default model
    assert model.tokenizer.decode(model.tokenizer.encode("And it came to pass")) == "And it came to pass"
    assert dsv4_jax.init_random(dsv4_jax.presets.tiny()).tokenizer is None
    broken = tmp_path / "model"
    shutil.copytree(dsv4_jax.DEFAULT_MODEL_DIR, broken)
    (broken / "tokenizer.json").write_text("{}")
    model = dsv4_jax.load(str(broken))                         # the weights load without reading it
    with pytest.raises(ValueError, match="tokenizer"):
        model.tokenizer


def test_widened_tokenizer_reads_every_id_of_a_larger_vocabulary():
    """widened(V): text encodes as before, the special ids stay, and the ids past the tokenizer's vocabulary decode
    to `<id>` (a random-weights model of a real geometry emits them), streamed too."""
    import os

    import dsv4_jax

    tok = Tokenizer(os.path.join(dsv4_jax.DEFAULT_MODEL_DIR, "tokenizer.json"))
    wide = tok.widened(tok.vocab_size + 100)
    assert wide.vocab_size == tok.vocab_size + 100 and tok.widened(tok.vocab_size) is tok
    text = "And it came to pass <｜User｜> 4100"
    assert wide.encode(text) == tok.encode(text)
    assert wide.encode(f"x <{tok.vocab_size + 3}>")[-1] == tok.vocab_size + 3      # (a placeholder spelled out)
    assert (wide.bos_id, wide.eos_id, wide.special_ids) == (tok.bos_id, tok.eos_id, tok.special_ids)
    last = tok.vocab_size + 99
    ids = tok.encode("Amen") + [tok.vocab_size, last]
    assert wide.decode(ids) == tok.decode(ids[:-2]) + f"<{tok.vocab_size}><{last}>"
    stream = wide.stream_decoder()
    assert "".join(stream.push(i) for i in ids) == wide.decode(ids) == stream.text
