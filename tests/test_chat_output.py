"""An assistant turn's text split into reasoning, content and tool calls (dsv4_jax.serving.chat_output): the same
split whatever the chunking (every cut point of the text, one character at a time), no piece of a marker in any
field, tool calls as OpenAI objects, and a malformed tool block kept as content."""

import json

import pytest

from dsv4_jax.chat import TOOL_CALLS_START, encode_messages
from dsv4_jax.serving.chat_output import ChatOutput
from dsv4_jax.tokenizer import DSML, THINK_END

CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
    {"city": "Jericho", "days": 3, "units": {"kind": "metric"}})}},
         {"type": "function", "function": {"name": "now", "arguments": "{}"}}]


def _tool_block() -> str:
    """The DSML text the chat encoder writes for CALLS in an assistant turn (what the model is trained to emit),
    from the tool-calls marker to the end of the turn."""
    prompt = encode_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS}])
    start = prompt.index(TOOL_CALLS_START)
    return prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]


def _split(text: str, cuts, thinking: bool, tools: bool):
    out = ChatOutput(thinking, tools)
    fields = {"reasoning_content": "", "content": ""}
    pieces = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        pieces += out.push(text[a:b])
    tail, calls = out.finish()
    for field, piece in pieces + tail:
        fields[field] += piece
    return fields, calls, pieces


def _all_chunkings(text: str):
    yield []
    yield list(range(1, len(text)))                      # one character at a time
    for cut in range(1, len(text)):
        yield [cut]


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_calls_parsed_at_any_chunking(thinking):
    reasoning = "The user wants weather."
    text = (reasoning + THINK_END if thinking else "") + "Let me look." + _tool_block()
    for cuts in _all_chunkings(text):
        fields, calls, pieces = _split(text, cuts, thinking, tools=True)
        assert fields == {"reasoning_content": reasoning if thinking else "", "content": "Let me look."}
        assert [{"type": c["type"], "function": c["function"]} for c in calls] == [
            {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                {"city": "Jericho", "days": 3, "units": {"kind": "metric"}})}},
            {"type": "function", "function": {"name": "now", "arguments": "{}"}}]
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
        assert not any(DSML in piece or "</think" in piece for _, piece in pieces)


def test_reasoning_ends_at_think_end_and_prefixes_are_held_back():
    text = "step one </thi then </think>The answer is <b>."
    for cuts in _all_chunkings(text):
        fields, calls, pieces = _split(text, cuts, thinking=True, tools=False)
        assert fields == {"reasoning_content": "step one </thi then ", "content": "The answer is <b>."}
        assert calls == []


def test_tool_block_without_closing_the_reasoning():
    """The model sometimes starts its tool calls inside the reasoning: the block ends the reasoning."""
    text = "I should call it." + _tool_block()
    fields, calls, _ = _split(text, [], thinking=True, tools=True)
    assert fields == {"reasoning_content": "I should call it.", "content": ""}
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]


def test_malformed_tool_block_stays_content():
    text = "Sure." + TOOL_CALLS_START + ">\n<oops"
    for cuts in _all_chunkings(text):
        fields, calls, _ = _split(text, cuts, thinking=False, tools=True)
        assert calls == [] and fields["content"] == text


def test_without_tools_the_marker_is_text():
    text = "Sure." + _tool_block()
    fields, calls, _ = _split(text, [3], thinking=False, tools=False)
    assert calls == [] and fields["content"] == text
