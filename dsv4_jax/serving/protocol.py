"""OpenAI requests in, validated options out; errors in OpenAI's shape.

Every check names the field and what it expected, and ends as a 400 `{"error": {"message", "type", "param",
"code"}}`. Fields this server does not use (`user`, `presence_penalty` at 0, ...) are accepted and ignored, as
OpenAI's own server does; fields whose meaning it cannot honour (`echo`, `best_of` > n, penalties other than 0,
`logit_bias`, `suffix`, a `tool_choice` that forces a call, a `response_format` other than text: both would need
decoding constrained to a grammar) are refused rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5      # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20            # and for chat


class APIError(Exception):
    """An error answered to the client: HTTP `status` and OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Sampling:
    max_tokens: int | None        # None: up to max_seq_len
    temperature: float
    top_p: float
    top_k: int                    # 0: off
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    n: int


@dataclasses.dataclass
class ChatRequest:
    messages: list
    tools: list | None
    thinking: bool
    reasoning_effort: str | None
    stream: bool
    include_usage: bool
    sampling: Sampling
    logprobs: int | None          # None: off; else how many top alternatives (0-20)


@dataclasses.dataclass
class CompletionRequest:
    prompts: list                 # each a string or a list of token ids
    stream: bool
    include_usage: bool
    sampling: Sampling
    logprobs: int | None


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


def _number(body: dict, key: str, default, low: float, high: float, *, integer: bool = False,
            low_open: bool = False):
    value = body.get(key)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _bad(key, f"expected {kind}, got {value!r:.60}")
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        raise _bad(key, f"expected {kind} in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return value


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"expected true or false, got {value!r:.60}")
    return value


def _object(body: dict, key: str) -> dict:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(key, f"expected an object, got {type(value).__name__}")
    return value


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return                     # OpenAI requires it; a local server can serve its one model without it
    if model != served:
        raise APIError(f"model {model!r:.80} is not served here; this server serves {served!r}", param="model",
                       code="model_not_found")


def _refuse_unsupported(body: dict) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(key, "not supported by this server (only 0)")
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise _bad("repetition_penalty", "not supported by this server (only 1)")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "not supported by this server")


def _sampling(body: dict, vocab_size: int) -> Sampling:
    _refuse_unsupported(body)
    max_tokens = _number(body, "max_tokens", None, 1, 2**31 - 1, integer=True)
    max_completion = _number(body, "max_completion_tokens", None, 1, 2**31 - 1, integer=True)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_completion_tokens", f"disagrees with max_tokens ({max_completion} != {max_tokens})")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s
                                                                         for s in stop):
        raise _bad("stop", f"expected a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                                             for t in stop_ids) or len(stop_ids) > 7:
        raise _bad("stop_token_ids", f"expected at most 7 token ids in [0, {vocab_size})")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"expected an integer, got {seed!r:.60}")
    top_k = _number(body, "top_k", 0, -1, vocab_size, integer=True)
    return Sampling(max_tokens=max_completion if max_tokens is None else max_tokens,
                    temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                    top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
                    top_k=max(top_k, 0),                      # -1 (vLLM's "off") and 0 both disable it
                    seed=None if seed is None else seed % 2**64, stop=stop, stop_token_ids=list(stop_ids),
                    n=_number(body, "n", 1, 1, MAX_N, integer=True))


def _stream_options(body: dict, stream: bool) -> bool:
    options = _object(body, "stream_options")
    if options and not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    return _bool(options, "include_usage", False)


def _check_response_format(body: dict) -> None:
    """`response_format` other than {"type": "text"} asks for JSON the model would be constrained to write: refused
    (no grammar-constrained decoding here), not ignored."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind != "text":
        raise _bad("response_format", f"only {{'type': 'text'}} is supported (no constrained decoding for JSON "
                                      f"output), got {fmt!r:.60}")


def parse_chat(body: Any, served: str, vocab_size: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "expected a list of tools")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none", "auto", "required") and not isinstance(tool_choice, dict):
        raise _bad("tool_choice", f"expected 'none', 'auto', 'required' or a function, got {tool_choice!r:.60}")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise _bad("tool_choice", "only 'auto' and 'none' are supported: this server does not constrain the model to "
                                  "call a tool (no grammar-constrained decoding)")
    _check_response_format(body)
    if tool_choice == "none":
        tools = None                  # the model is not told of them
    template = _object(body, "chat_template_kwargs")
    thinking = template.get("thinking", template.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise _bad("chat_template_kwargs.thinking", f"expected true or false, got {thinking!r:.60}")
    effort = template.get("reasoning_effort", body.get("reasoning_effort"))
    if effort not in (None, "high", "max"):
        raise _bad("reasoning_effort", f"expected 'high' or 'max', got {effort!r:.60}")
    stream = _bool(body, "stream", False)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "needs logprobs: true")
    return ChatRequest(messages=messages, tools=tools or None, thinking=thinking, reasoning_effort=effort,
                       stream=stream, include_usage=_stream_options(body, stream),
                       sampling=_sampling(body, vocab_size), logprobs=logprobs)


def parse_completion(body: Any, served: str, vocab_size: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_model(body, served)
    if _bool(body, "echo", False):
        raise _bad("echo", "not supported by this server")
    if body.get("suffix"):
        raise _bad("suffix", "not supported by this server")
    _check_response_format(body)
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)  # noqa: E731
                                                         for t in p)
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise _bad("prompt", "expected a string, a list of token ids, or a non-empty list of either")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise _bad("prompt", "a prompt is empty")
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise _bad("prompt", f"token ids must lie in [0, {vocab_size})")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = _number(body, "best_of", n, 1, MAX_N, integer=True)
    if best_of != n:
        raise _bad("best_of", "only best_of = n is supported")
    stream = _bool(body, "stream", False)
    return CompletionRequest(prompts=prompts, stream=stream, include_usage=_stream_options(body, stream),
                             sampling=_sampling(body, vocab_size),
                             logprobs=_number(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, integer=True))
