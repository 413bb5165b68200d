"""Text in, text out: prompts as strings (plain or chat messages), completions as strings.

    model = dsv4_jax.load()
    out = model.complete("And it came to pass")                   # Completion(text, token_ids, finish_reason, ...)
    outs = model.complete(["In the beginning", "Then"], stop=["\\n"])
    reply = model.complete([{"role": "user", "content": "Who was the first king of Israel?"}])

The sampling defaults are the command line's (SAMPLING_DEFAULTS: temperature 0.6, top-p 0.95, 100 new tokens), so
a call and `python -m dsv4_jax.generate` with the same options give the same text; `Model.generate` (token ids)
keeps a library call's reproducible defaults (greedy, 256 tokens).

A plain prompt is BOS + its text; chat messages go through the DeepSeek-V4 chat encoder (dsv4_jax.chat). Text
that looks like a special token stays text (the chat template's own control tokens are the only specials) unless
`special_tokens=True`. Stop strings end a sequence on the host as soon as its decoded text contains one; the text
is cut before it, and while the end of the text could still become a stop string it is held back from `stream`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from .chat import encode_message_ids

SAMPLING_DEFAULTS = {"max_new_tokens": 100, "temperature": 0.6, "top_p": 0.95, "top_k": 0, "seed": 0}


@dataclasses.dataclass
class Completion:
    text: str                     # the generated text (cut before a stop string; the final stop token left out)
    token_ids: list[int]          # the generated ids (a stop token, or the token completing a stop string, included)
    finish_reason: str            # "stop" (a stop token or stop string) or "length"
    prompt_token_ids: list[int]
    cached_tokens: int = 0        # prompt tokens continued from the prefix cache (load(..., prefix_cache=bytes))


def prompt_ids(tokenizer, prompt, *, chat: bool = False, system: str | None = None, thinking: bool = False,
               reasoning_effort: str | None = None, special_tokens: bool = False) -> list[int]:
    """The token ids of one prompt: a string (BOS + text, or with `chat` a user turn) or a list of chat messages.
    `special_tokens`: special-token strings in a plain prompt become their ids (raw control tokens)."""
    if isinstance(prompt, str) and not (chat or system is not None or thinking):
        return [tokenizer.bos_id] + tokenizer.encode(prompt, allow_special=special_tokens)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    return encode_message_ids(tokenizer, messages, thinking_mode="thinking" if thinking else "chat",
                              reasoning_effort=reasoning_effort)


def _is_conversation(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, dict) for m in value) \
        and len(value) > 0


def split_batch(prompts) -> tuple[list, bool]:
    """(the prompts as a list, whether one prompt was given): a string or a conversation (a list of message dicts)
    is one prompt; a list of those is a batch."""
    if isinstance(prompts, str) or _is_conversation(prompts):
        return [prompts], True
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) or _is_conversation(p)
                                                         for p in prompts):
        return list(prompts), False
    raise ValueError("prompts must be a string, a list of chat messages (dicts with 'role' and 'content'), or a "
                     f"non-empty list of those; got {type(prompts).__name__}")


class TextStream:
    """One sequence's generated ids as text: decoded incrementally, the stop ids left out, cut before the first stop
    string, and held back while the text's end could still grow into a stop string."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stop_ids: Sequence[int] = ()):
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        self._decoder = tokenizer.stream_decoder()
        self._stops = list(stop_strings)
        self._stop_ids = set(stop_ids)
        self._text = ""                 # decoded so far (cut at a stop string once one is found)
        self._released = 0              # characters of _text handed out
        self.token_ids: list[int] = []
        self.stopped = False

    @property
    def text(self) -> str:
        return self._text

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; returns the text that is now final. Ids after a stop are ignored."""
        for token in ids:
            if self.stopped:
                break
            self.token_ids.append(int(token))
            if token in self._stop_ids:
                self.stopped = True
                self._text += self._decoder.flush()
            else:
                self._text += self._decoder.push(int(token))
            self._cut_at_stop_string()
        return self._release()

    def flush(self) -> str:
        """The end of generation: everything still held back."""
        if not self.stopped:
            self._text += self._decoder.flush()
            self._cut_at_stop_string()
        end = len(self._text)
        out, self._released = self._text[self._released:end], end
        return out

    def _cut_at_stop_string(self):
        search_from = max(0, self._released - max((len(s) for s in self._stops), default=0))
        hits = [i for i in (self._text.find(s, search_from) for s in self._stops) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True

    def _release(self) -> str:
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        out, self._released = self._text[self._released:end], max(self._released, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class TextBatch:
    """The completions of a batch of prompts as they are generated: `on_tokens` is Model.generate's `stream` hook
    (it feeds each row's TextStream, passes new text to `stream(row, text)` and returns the rows a stop string
    ended); `completions` gives the results."""

    def __init__(self, tokenizer, prompt_token_ids: list[list[int]], stop: Sequence[str] | str | None = None,
                 stop_ids: Sequence[int] = (), stream: Callable[[int, str], None] | None = None):
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        self.prompt_token_ids = prompt_token_ids
        self.streams = [TextStream(tokenizer, stop_strings, stop_ids) for _ in prompt_token_ids]
        self._stream = stream

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.streams)

    def on_tokens(self, new_tokens: list[list[int]]) -> list[int]:
        stopped = []
        for row, (text_stream, toks) in enumerate(zip(self.streams, new_tokens)):
            was_stopped = text_stream.stopped
            delta = text_stream.push(toks)
            if self._stream is not None and delta:
                self._stream(row, delta)
            if text_stream.stopped and not was_stopped:
                stopped.append(row)
        return stopped

    def completions(self, finish_reasons: Sequence[str]) -> list[Completion]:
        out = []
        for row, (text_stream, reason) in enumerate(zip(self.streams, finish_reasons)):
            tail = text_stream.flush()
            if self._stream is not None and tail:
                self._stream(row, tail)
            out.append(Completion(text_stream.text, text_stream.token_ids, "stop" if text_stream.stopped else reason,
                                  self.prompt_token_ids[row]))
        return out


def complete(model, prompts, *, chat: bool = False, system: str | None = None, thinking: bool = False,
             reasoning_effort: str | None = None, stop: Sequence[str] | str | None = None,
             stream: Callable[[int, str], None] | None = None, special_tokens: bool = False, **sampling):
    """Model.complete: strings in, Completion(s) out (see the module docstring)."""
    unknown = set(sampling) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise TypeError(f"complete() got unexpected keyword arguments {sorted(unknown)} (sampling options: "
                        f"{sorted(SAMPLING_DEFAULTS)})")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (load a checkpoint directory with a tokenizer.json, or pass "
                         "Model(tokenizer=...)); Model.generate takes token ids")
    batch, single = split_batch(prompts)
    ids = [prompt_ids(tokenizer, p, chat=chat, system=system, thinking=thinking, reasoning_effort=reasoning_effort,
                      special_tokens=special_tokens) for p in batch]
    texts = TextBatch(tokenizer, ids, stop, [model.config.eos_token_id], stream)
    result = model.generate(ids, stream=texts.on_tokens, **{**SAMPLING_DEFAULTS, **sampling})
    completions = texts.completions(result.finish_reasons)
    for completion, cached in zip(completions, result.cached_tokens or [0] * len(completions), strict=True):
        completion.cached_tokens = cached
    return completions[0] if single else completions
