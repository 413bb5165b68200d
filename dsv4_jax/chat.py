"""DeepSeek-V4 prompt encoding (docs/model.md section 8).

Produces exactly the strings of the official encoder, ``encoding/encoding_dsv4.py`` shipped with the
DeepSeek-V4 checkpoints (no Jinja chat template ships with V4). Grammar, in short::

    BOS [REASONING_EFFORT_MAX if thinking and effort == "max"] {system}["\\n\\n## Tools…"]
    <｜User｜>{user}<｜Assistant｜>{"<think>" | "</think>"}{reasoning}</think>{content}{DSML tool calls}<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result>…

Messages are OpenAI-style dicts. Roles: ``system``, ``user``, ``assistant`` (``content``,
``reasoning_content``, ``tool_calls``), ``tool`` (merged into a user turn as ``<tool_result>``),
``latest_reminder``, ``developer`` (internal search-agent role of the official encoder). Optional
official per-message fields: ``tools`` and ``response_format`` (system / developer), ``task``
(quick-instruction tokens), ``wo_eos`` (assistant turn left open).

Two outputs: `encode_messages` gives the prompt string (the official encoder's output, byte for byte) and
`encode_message_ids` its token ids. In the ids only the template's own control tokens are special: every
piece of caller text (message content, system text, tool schemas / arguments / results, reasoning) is
encoded as text, so a special-token string typed into a message stays text. The renderer therefore
produces segments that say which text is the template's; with no special-token text in the caller's
text, the ids equal ``tokenizer.encode(encode_messages(...), allow_special=True)``.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, NamedTuple, Optional

from dsv4_jax.tokenizer import (
    ACTION,
    ASSISTANT,
    AUTHORITY,
    BOS,
    DOMAIN,
    DSML,
    EOS,
    LATEST_REMINDER,
    QUERY,
    READ_URL,
    THINK_END,
    THINK_START,
    TITLE,
    USER,
)

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")  # "high" is accepted and, as in the official code, adds nothing
ROLES = ("system", "user", "assistant", "tool", "latest_reminder", "developer")
TASK_TOKENS = {
    "action": ACTION,
    "query": QUERY,
    "authority": AUTHORITY,
    "domain": DOMAIN,
    "title": TITLE,
    "read_url": READ_URL,
}

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
    "\n\n"
)

_TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
_TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"

TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "{_TOOL_CALLS_OPEN}" block like the following:\n\n'
    f"{_TOOL_CALLS_OPEN}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"{_TOOL_CALLS_CLOSE}\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning "
    f"inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)


# ------------------------------------------------------------------------------------------------
# segments: the rendered prompt, marked by origin
# ------------------------------------------------------------------------------------------------

class Segment(NamedTuple):
    """A piece of the prompt. ``template``: written by this encoder, so its special-token strings are
    control tokens; otherwise caller text (content, tool schemas, arguments, ...), always plain text."""
    text: str
    template: bool


def _tpl(text: str) -> list[Segment]:
    return [Segment(text, True)]


def _txt(text: str) -> list[Segment]:
    return [Segment(text, False)]


def _join(parts: list[list[Segment]], separator: str) -> list[Segment]:
    """Like ``separator.join``, for segment lists (the separator is template text)."""
    out: list[Segment] = []
    for i, part in enumerate(parts):
        if i:
            out += _tpl(separator)
        out += part
    return out


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def _function_of(tool: Any, where: str) -> dict:
    """OpenAI tool ``{"type": "function", "function": {...}}`` -> the function dict (bare dicts pass)."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return tool["function"]
    if isinstance(tool, dict) and "name" in tool:
        return tool
    raise ValueError(f"{where}: each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r:.80}")


def _render_tools(tools: list, where: str) -> list[Segment]:
    schemas = [_txt(_to_json(_function_of(t, where))) for t in tools]
    before, after = TOOLS_SECTION.split("{schemas}")
    return _tpl(before) + _join(schemas, "\n") + _tpl(after)


def _tool_call_name_args(call: Any, where: str) -> tuple[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        fn = call if isinstance(call, dict) and "name" in call else None
    if fn is None or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: each tool call needs function.name, got {call!r:.80}")
    return fn["name"], fn.get("arguments", "{}")


def _dsml_parameters(arguments: Any, where: str) -> list[Segment]:
    """Arguments (a JSON object string, as OpenAI sends them) -> DSML parameter lines."""
    if isinstance(arguments, dict):
        args = arguments
    else:
        try:
            args = json.loads(arguments)
        except (TypeError, ValueError):
            args = {"arguments": arguments}  # official fallback for arguments that are not JSON
        if not isinstance(args, dict):
            raise ValueError(f"{where}: tool call arguments must be a JSON object, got {arguments!r:.80}")
    lines = []
    for key, value in args.items():
        is_str = isinstance(value, str)
        text = value if is_str else _to_json(value)
        lines.append(
            _tpl(f'<{DSML}parameter name="') + _txt(str(key))
            + _tpl(f'" string="{"true" if is_str else "false"}">') + _txt(text) + _tpl(f"</{DSML}parameter>")
        )
    return _join(lines, "\n")


def _render_tool_calls(tool_calls: list, where: str) -> list[Segment]:
    invokes = []
    for call in tool_calls:
        name, arguments = _tool_call_name_args(call, where)
        invokes.append(
            _tpl(f'<{DSML}invoke name="') + _txt(name) + _tpl('">\n')
            + _dsml_parameters(arguments, where) + _tpl(f"\n</{DSML}invoke>")
        )
    return _tpl("\n\n" + _TOOL_CALLS_OPEN + "\n") + _join(invokes, "\n") + _tpl("\n" + _TOOL_CALLS_CLOSE)


def _tool_call_id(call: Any) -> str:
    if not isinstance(call, dict):
        return ""
    fn = call.get("function")
    return call.get("id") or (fn.get("id", "") if isinstance(fn, dict) else "")


def _tool_result(content: Any) -> list[Segment]:
    if isinstance(content, list):  # content blocks: text joined, anything else marked unsupported
        parts = []
        for block in content:
            if block.get("type") == "text":
                parts.append(_txt(block.get("text", "")))
            else:
                parts.append(_tpl("[Unsupported ") + _txt(str(block.get("type"))) + _tpl("]"))
        body = _join(parts, "\n\n")
    else:
        body = _txt(content)
    return _tpl("<tool_result>") + body + _tpl("</tool_result>")


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------

def _check_str(msg: dict, key: str, where: str, required: bool, nonempty: bool = False) -> None:
    if key not in msg or msg[key] is None:
        if required:
            raise ValueError(f"{where}: missing '{key}'")
        return
    if not isinstance(msg[key], str):
        raise ValueError(f"{where}: '{key}' must be a str, got {type(msg[key]).__name__}")
    if nonempty and not msg[key]:
        raise ValueError(f"{where}: '{key}' must not be empty")


def _validate(messages: Any, thinking_mode: Any, reasoning_effort: Any) -> None:
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be None, 'high' or 'max', got {reasoning_effort!r}")
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        where = f"messages[{i}] ({role})"
        if role == "system":
            _check_str(msg, "content", where, required=False)
        elif role == "developer":
            _check_str(msg, "content", where, required=True, nonempty=True)
        elif role in ("user", "latest_reminder"):
            _check_str(msg, "content", where, required=True)
        elif role == "tool":
            content = msg.get("content")
            if content is None:
                raise ValueError(f"{where}: missing 'content'")
            if not isinstance(content, (str, list)) or (
                isinstance(content, list) and not all(isinstance(b, dict) for b in content)
            ):
                raise ValueError(f"{where}: 'content' must be a str or a list of content blocks")
        elif role == "assistant":
            _check_str(msg, "content", where, required=False)
            _check_str(msg, "reasoning_content", where, required=False)
            calls = msg.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise ValueError(f"{where}: 'tool_calls' must be a list")
            for call in calls or ():
                _tool_call_name_args(call, where)
        if msg.get("tools") is not None:
            if role not in ("system", "developer"):
                raise ValueError(f"{where}: 'tools' belong on a system or developer message")
            if not isinstance(msg["tools"], list):
                raise ValueError(f"{where}: 'tools' must be a list")
            for tool in msg["tools"]:
                _function_of(tool, where)
        task = msg.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ValueError(f"{where}: unknown task {task!r} (expected one of {', '.join(TASK_TOKENS)})")


# ------------------------------------------------------------------------------------------------
# preprocessing: tool messages become user turns, tool results follow the call order
# ------------------------------------------------------------------------------------------------

def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """V4 has no tool turn: each tool result becomes a ``<tool_result>`` block of a user turn.

    A tool result joins the preceding user turn (typically the one made from the previous tool
    result); a user message joins a preceding user turn unless that one carries a task. Each merged
    user turn is ``{"role": "user", "blocks": [(segments, tool_call_id or None), ...], ...}``.
    """
    merged: list[dict] = []
    for msg in messages:
        role = msg["role"]
        last = merged[-1] if merged else None
        if role == "tool":
            block = (_tool_result(msg["content"]), msg.get("tool_call_id") or "")
            if last is not None and last["role"] == "user":
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = (_txt(msg["content"]), None)
            if last is not None and last["role"] == "user" and last.get("task") is None:
                last["blocks"].append(block)
            else:
                turn = {"role": "user", "blocks": [block]}
                for key in ("task", "wo_eos"):
                    if key in msg:
                        turn[key] = msg[key]
                merged.append(turn)
        else:
            merged.append(dict(msg))
    return merged


def _sort_tool_results(messages: list[dict]) -> None:
    """Reorder tool-result blocks of each user turn to follow the previous assistant's call order."""
    call_order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            call_order = {}
            for idx, call in enumerate(msg["tool_calls"]):
                call_id = _tool_call_id(call)
                if call_id:
                    call_order[call_id] = idx
        elif msg["role"] == "user":
            results = [b for b in msg["blocks"] if b[1] is not None]
            if len(results) > 1 and call_order:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b[1], 0)))  # stable
                msg["blocks"] = [next(ordered) if b[1] is not None else b for b in msg["blocks"]]


def _last_user_index(messages: list[dict]) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        if messages[idx]["role"] in ("user", "developer"):
            return idx
    return -1


def _drop_old_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: strip assistants' reasoning and drop developer turns."""
    last_user = _last_user_index(messages)
    kept = []
    for idx, msg in enumerate(messages):
        if idx >= last_user or msg["role"] in ("user", "system", "latest_reminder"):
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


# ------------------------------------------------------------------------------------------------
# rendering
# ------------------------------------------------------------------------------------------------

def _render_turn(
    idx: int,
    messages: list[dict],
    thinking: bool,
    drop_thinking: bool,
    reasoning_effort: Optional[str],
    add_generation_prompt: bool,
) -> list[Segment]:
    msg = messages[idx]
    role = msg["role"]
    where = f"{role} turn {idx}"
    out = _tpl(REASONING_EFFORT_MAX) if idx == 0 and thinking and reasoning_effort == "max" else []
    last_user = _last_user_index(messages)

    if role in ("system", "developer"):
        body = _txt(msg.get("content") or "")
        if msg.get("tools"):
            body += _tpl("\n\n") + _render_tools(msg["tools"], where)
        if msg.get("response_format"):
            before, after = RESPONSE_FORMAT_SECTION.split("{schema}")
            body += _tpl("\n\n" + before) + _txt(_to_json(msg["response_format"])) + _tpl(after)
        out += (_tpl(USER) + body) if role == "developer" else body
    elif role == "user":
        out += _tpl(USER) + _join([segments for segments, _ in msg["blocks"]], "\n\n")
    elif role == "latest_reminder":
        out += _tpl(LATEST_REMINDER) + _txt(msg["content"])
    elif role == "assistant":
        prev_task = idx > 0 and messages[idx - 1].get("task") is not None
        if thinking and not prev_task and (not drop_thinking or idx > last_user):
            out += _txt(msg.get("reasoning_content") or "") + _tpl(THINK_END)
        out += _txt(msg.get("content") or "")
        if msg.get("tool_calls"):
            out += _render_tool_calls(msg["tool_calls"], where)
        if not msg.get("wo_eos", False):
            out += _tpl(EOS)

    # What follows the turn: nothing if the next turn is user-side; otherwise a task token or the
    # assistant prefix (which, after the final user turn, is the generation prompt).
    if idx + 1 < len(messages) and messages[idx + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task == "action":
            out += _tpl(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
        else:
            out += _tpl(TASK_TOKENS[task])
    elif role in ("user", "developer"):
        if idx == len(messages) - 1 and not add_generation_prompt:
            return out
        open_think = thinking and (not drop_thinking or idx >= last_user)
        out += _tpl(ASSISTANT + (THINK_START if open_think else THINK_END))
    return out


def render_segments(
    messages: list[dict],
    thinking_mode: str = "chat",
    reasoning_effort: Optional[str] = None,
    tools: Optional[list] = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> list[Segment]:
    """The prompt of `encode_messages` (same arguments) as segments, in order; their texts joined are the
    prompt string."""
    _validate(messages, thinking_mode, reasoning_effort)
    messages = list(messages)
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError(f"tools must be a list of OpenAI tool dicts, got {type(tools).__name__}")
        for tool in tools:
            _function_of(tool, "tools")
        if tools:
            if messages and messages[0]["role"] == "system":
                if messages[0].get("tools"):
                    raise ValueError("tools given both as an argument and on the system message")
                messages[0] = {**messages[0], "tools": tools}
            else:
                messages.insert(0, {"role": "system", "content": "", "tools": tools})

    turns = _merge_tool_messages(messages)
    _sort_tool_results(turns)
    if any(t.get("tools") for t in turns):
        drop_thinking = False
    thinking = thinking_mode == "thinking"
    if thinking and drop_thinking:
        turns = _drop_old_thinking(turns)

    segments = _tpl(BOS) if add_bos else []
    for idx in range(len(turns)):
        segments += _render_turn(idx, turns, thinking, drop_thinking, reasoning_effort, add_generation_prompt)
    return segments


def encode_messages(
    messages: list[dict],
    thinking_mode: str = "chat",
    reasoning_effort: Optional[str] = None,
    tools: Optional[list] = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """Encode a conversation into the DeepSeek-V4 prompt string (official ``encoding_dsv4.py``).

    thinking_mode: ``"chat"`` (generation prompt ``<｜Assistant｜></think>``) or ``"thinking"``
        (``<｜Assistant｜><think>``).
    reasoning_effort: None, ``"high"`` or ``"max"``; ``"max"`` in thinking mode prefixes the prompt
        (after BOS) with `REASONING_EFFORT_MAX`.
    tools: OpenAI-format tool list; attached to the leading system message (one with empty content is
        inserted if the conversation has none). Tools may instead be given on a system/developer
        message's ``tools`` field, as in the official API. With tools anywhere, earlier turns keep
        their reasoning (``drop_thinking`` is ignored), as in the official code.
    add_generation_prompt: False leaves out the ``<｜Assistant｜><think>`` / ``</think>`` suffix after
        a final user (or developer) turn; everything else is unchanged. (The official encoder always
        adds it; a final assistant turn never gets one.)
    drop_thinking: official default True: in thinking mode, reasoning of assistant turns before the
        last user turn is removed (and developer turns there are dropped).
    add_bos: prepend ``<｜begin▁of▁sentence｜>``.
    """
    segments = render_segments(messages, thinking_mode, reasoning_effort, tools, add_generation_prompt,
                               drop_thinking, add_bos)
    return "".join(segment.text for segment in segments)


def encode_message_ids(
    tokenizer,
    messages: list[dict],
    thinking_mode: str = "chat",
    reasoning_effort: Optional[str] = None,
    tools: Optional[list] = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> list[int]:
    """Token ids of the `encode_messages` prompt (same arguments) for a `dsv4_jax.tokenizer.Tokenizer`.

    The special-token strings of the template's own text (BOS, ``<｜User｜>``, ``<｜Assistant｜>``,
    ``<think>``, ``</think>``, ``｜DSML｜``, task tokens, ...) become their ids; caller text is encoded as
    text, so special-token strings in it stay text. Without such strings in the caller's text this
    equals ``tokenizer.encode(encode_messages(...), allow_special=True)``.
    """
    segments = render_segments(messages, thinking_mode, reasoning_effort, tools, add_generation_prompt,
                               drop_thinking, add_bos)
    return _segment_ids(tokenizer, segments)


def _segment_ids(tokenizer, segments: list[Segment]) -> list[int]:
    # Template text is cut at its special tokens (ids); caller text is kept whole. The text between two
    # control tokens, template and caller pieces alike, is encoded as ONE string: BPE then merges across
    # the seams exactly as in the whole prompt string, where only the special tokens cut the text.
    pieces: list[str | int] = []
    for segment in segments:
        pieces += tokenizer.split_special_tokens(segment.text) if segment.template else [segment.text]
    ids: list[int] = []
    for is_control, run in itertools.groupby(pieces, key=lambda piece: isinstance(piece, int)):
        ids += list(run) if is_control else tokenizer.encode("".join(run))
    return ids


# ------------------------------------------------------------------------------------------------
# parsing a completion (official ``parse_message_from_completion_text``)
# ------------------------------------------------------------------------------------------------

_INVOKE = f"<{DSML}invoke"
_INVOKE_END = f"</{DSML}invoke"
_PARAM = f"<{DSML}parameter"
_PARAM_END = f"/{DSML}parameter"
_TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"
TOOL_CALLS_START = _TOOL_CALLS_START      # where a completion's tool calls begin
_NAME_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _read_until(text: str, pos: int, stops: tuple[str, ...]) -> tuple[int, str, Optional[str]]:
    """(position after the earliest stop, text before it, the stop) or (len, rest, None)."""
    best, found = len(text), None
    for stop in stops:
        at = text.find(stop, pos)
        if at != -1 and at < best:
            best, found = at, stop
    if found is None:
        return len(text), text[pos:], None
    return best + len(found), text[pos:best], found


def _parse_tool_calls(text: str, pos: int) -> tuple[int, list[dict]]:
    calls = []
    while pos < len(text):
        pos, between, stop = _read_until(text, pos, (_INVOKE, _TOOL_CALLS_CLOSE))
        if between != ">\n":
            raise ValueError(f"tool call format error: expected '>\\n', got {between!r:.60}")
        if stop == _TOOL_CALLS_CLOSE:
            break
        pos, head, stop = _read_until(text, pos, (_PARAM, _INVOKE_END))
        name = _NAME_RE.findall(head)
        if len(name) != 1:
            raise ValueError(f"tool call format error: bad invoke name {head!r:.60}")
        params: dict[str, tuple[str, str]] = {}
        while stop == _PARAM:
            pos, body, stop = _read_until(text, pos, (_PARAM_END,))
            kv = _PARAM_RE.findall(body)
            if len(kv) != 1:
                raise ValueError(f"tool call format error: bad parameter {body!r:.60}")
            key, is_str, value = kv[0]
            if key in params:
                raise ValueError(f"tool call format error: duplicate parameter {key!r}")
            params[key] = (value, is_str)
            pos, between, stop = _read_until(text, pos, (_PARAM, _INVOKE_END))
            if between != ">\n":
                raise ValueError(f"tool call format error: expected '>\\n', got {between!r:.60}")
        arguments = "{" + ", ".join(
            f"{_to_json(k)}: {_to_json(v) if s == 'true' else v}" for k, (v, s) in params.items()
        ) + "}"
        calls.append({"type": "function", "function": {"name": name[0], "arguments": arguments}})
    return pos, calls


def parse_tool_calls(block: str) -> list[dict]:
    """The OpenAI-format tool calls of the text that follows ``TOOL_CALLS_START`` in a completion (to the end of
    the turn, EOS left out). Malformed text raises ValueError."""
    pos, calls = _parse_tool_calls(block, 0)
    if block[pos:]:
        raise ValueError(f"unexpected text after tool calls: {block[pos:]!r:.60}")
    return calls


def parse_completion(text: str, thinking_mode: str = "chat") -> dict:
    """Split one generated assistant turn (text up to and including EOS) into its parts.

    Returns ``{"role": "assistant", "content", "reasoning_content", "tool_calls"}`` with tool calls in
    OpenAI format (arguments as a JSON string). In thinking mode the text starts after the prompt's
    ``<think>`` and must contain ``</think>``. Malformed text raises ValueError (as the official parser,
    it does not try to repair model output).
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    pos, reasoning, calls = 0, "", []
    if thinking_mode == "thinking":
        pos, reasoning, stop = _read_until(text, pos, (THINK_END, _TOOL_CALLS_START))
        if stop != THINK_END:
            raise ValueError("completion has no </think> closing the reasoning")
    pos, content, stop = _read_until(text, pos, (EOS, _TOOL_CALLS_START))
    if stop == _TOOL_CALLS_START:
        pos, calls = _parse_tool_calls(text, pos)
        pos, rest, stop = _read_until(text, pos, (EOS,))
        if rest:
            raise ValueError(f"unexpected text after tool calls: {rest!r:.60}")
    elif stop != EOS:
        raise ValueError("completion does not end with <｜end▁of▁sentence｜>")
    if pos != len(text):
        raise ValueError(f"unexpected text after the end of the turn: {text[pos:]!r:.60}")
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ValueError(f"unexpected special token {token!r} in the completion's content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


__all__ = [
    "encode_messages",
    "encode_message_ids",
    "render_segments",
    "Segment",
    "parse_completion",
    "parse_tool_calls",
    "TOOL_CALLS_START",
    "REASONING_EFFORT_MAX",
    "THINKING_MODES",
    "ROLES",
    "TASK_TOKENS",
]
