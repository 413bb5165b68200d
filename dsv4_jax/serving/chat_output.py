"""An assistant turn's text, as it streams, split into OpenAI's fields.

In thinking mode the text before `</think>` is `reasoning_content` and the rest `content`; a DSML tool-call block
(`\\n\\n<｜DSML｜tool_calls>`, only looked for when the request gave tools) becomes `tool_calls` at the end of the
turn. The model sometimes starts the tool block without closing its reasoning: the block ends the reasoning then.
A marker's first characters are held back until they can no longer be part of it, so no field ever carries a piece
of a marker. A tool block that does not parse is returned as content, as written (nothing the model said is lost).
The split depends only on the text, never on how it was chunked: streamed and whole outputs agree.
"""

from __future__ import annotations

import secrets

from ..chat import TOOL_CALLS_START, parse_tool_calls
from ..tokenizer import THINK_END


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ChatOutput:
    """Feed text with `push`, end with `finish`; each returns [(field, text)] pieces to send, field one of
    "reasoning_content" and "content"; `finish` also gives the parsed tool calls (a list, maybe empty)."""

    def __init__(self, thinking: bool, tools: bool):
        self._field = "reasoning_content" if thinking else "content"
        self._tools = tools
        self._pending = ""          # text not yet sent: a possible marker prefix
        self._tool_block: str | None = None

    def _markers(self) -> tuple[str, ...]:
        markers = (THINK_END,) if self._field == "reasoning_content" else ()
        return markers + ((TOOL_CALLS_START,) if self._tools else ())

    def push(self, text: str) -> list[tuple[str, str]]:
        if self._tool_block is not None:
            self._tool_block += text
            return []
        self._pending += text
        out: list[tuple[str, str]] = []
        while True:
            markers = self._markers()
            hits = [(at, m) for m in markers if (at := self._pending.find(m)) >= 0]
            if not hits:
                break
            at, marker = min(hits)
            if self._pending[:at]:
                out.append((self._field, self._pending[:at]))
            rest = self._pending[at + len(marker):]
            self._pending = ""
            if marker == TOOL_CALLS_START:
                self._tool_block = rest
                return out
            self._field = "content"            # </think>: the reasoning is over
            self._pending = rest
        keep = _held_back(self._pending, self._markers())
        send, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        if send:
            out.append((self._field, send))
        return out

    def finish(self) -> tuple[list[tuple[str, str]], list[dict]]:
        out = [(self._field, self._pending)] if self._pending else []
        self._pending = ""
        calls: list[dict] = []
        if self._tool_block is not None:
            try:
                calls = parse_tool_calls(self._tool_block)
            except ValueError:
                out.append(("content", TOOL_CALLS_START + self._tool_block))
            self._tool_block = None
        for call in calls:
            call["id"] = f"call_{secrets.token_hex(12)}"
        return out, calls
