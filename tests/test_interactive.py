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
    lines = iter(["Who was Moses?", "   ", "And who was Aaron?"])

    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
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
