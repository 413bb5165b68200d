"""The command line's interactive chat (dsv4_jax.interactive): on a terminal without --prompt, --chat holds a
conversation whose every turn re-encodes the whole history with the chat encoder; Ctrl-D leaves."""

import io
import sys

import pytest

import dsv4_jax
from dsv4_jax import generate as cli
from dsv4_jax.chat import encode_message_ids
from dsv4_jax.interactive import chat_loop, wants_interactive


@pytest.fixture(scope="module")
def model():
    return dsv4_jax.load(dtype="float32", max_seq_len=512)


def _typed(*lines):
    """A read_line that returns `lines` one after another, then Ctrl-D (EOFError)."""
    pending = iter(lines)

    def read_line(prompt):
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None
    return read_line


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("argv,expected", [
    (["--chat"], True), (["--system", "Be brief."], True), (["--thinking"], True),
    (["--chat", "--prompt", "hi"], False), (["--chat", "--json"], False), (["--chat", "--no-stream"], False),
    ([], False),
])
def test_interactive_only_for_chat_without_a_prompt_on_a_terminal(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "stdin", _Terminal())
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert wants_interactive(cli.parse_args(argv)) == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO())             # a pipe: never interactive
    assert not wants_interactive(cli.parse_args(argv))


def test_each_turn_reencodes_the_history(model, monkeypatch):
    args = cli.parse_args(["--system", "Answer briefly.", "--temperature", "0", "--max-new-tokens", "12"])
    read_line = _typed("Who was Moses?", "   ", "And who was Aaron?")
    prompts = []
    real_generate = model.generate

    def generate(prompt_ids, **kw):
        prompts.append(prompt_ids[0])
        return real_generate(prompt_ids, **kw)
    monkeypatch.setattr(model, "generate", generate)
    written, notes = [], []
    assert chat_loop(model, args, read_line, written.append, notes.append) == 0
    assert len(prompts) == 2                                      # the blank line is skipped
    tok = model.tokenizer

    def greedy_reply(ids):
        tokens = real_generate([ids], max_new_tokens=12).tokens[0]
        return tok.decode([t for t in tokens if t != tok.eos_id])
    first = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who was Moses?"}]
    assert prompts[0] == encode_message_ids(tok, first)
    reply = greedy_reply(prompts[0])
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And who was Aaron?"}]
    assert prompts[1] == encode_message_ids(tok, second)
    assert "".join(written) == reply + "\n" + greedy_reply(prompts[1]) + "\n" + "\n"
    assert "Ctrl-D" in notes[0]


@pytest.mark.parametrize("thinking", [False, True])
def test_each_turn_prefills_only_what_it_adds(model, thinking):
    """With the prefix cache (the command line's default for the chat) a turn continues from the last prompt's end:
    its history is not prefilled again (thinking mode too, whose earlier reasoning the encoder drops), and the
    replies are those of the model without the cache."""
    cached = dsv4_jax.load(dtype="float32", max_seq_len=512, prefix_cache=32 << 20)
    argv = ["--system", "Answer briefly.", "--temperature", "0", "--max-new-tokens", "10"]
    args = cli.parse_args(argv + (["--thinking"] if thinking else []))
    replies = {}
    for which in (model, cached):
        read_line = _typed("Who was Moses?", "And who was Aaron?", "And Miriam?")
        runs = []
        real_generate = which.generate

        def generate(prompt_ids, _real=real_generate, _runs=runs, **kw):
            result = _real(prompt_ids, **kw)
            _runs.append((len(prompt_ids[0]), result.cached_tokens[0]))
            return result
        which.generate = generate
        written = []
        try:
            assert chat_loop(which, args, read_line, written.append, lambda _: None) == 0
        finally:
            del which.generate
        replies[which] = ("".join(written), runs)
    (plain_text, plain_runs), (text, runs) = replies[model], replies[cached]
    assert text == plain_text
    assert [c for _, c in plain_runs] == [0, 0, 0] and runs[0][1] == 0
    for (before, _), (after, hit) in zip(runs, runs[1:]):
        assert before - 1 <= hit < after, runs             # the last prompt but its last token (<think> or </think>)
