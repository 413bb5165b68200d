"""The OpenAI-compatible HTTP API over a `Scheduler`: FastAPI on uvicorn.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`. Each request
becomes one `scheduler.Request` per choice (OpenAI `n`) and prompt; their events come back from the device-loop
thread through `loop.call_soon_threadsafe` into an asyncio queue, so a handler never blocks the loop and the loop
never waits on a handler. A client that goes away (mid-stream or while waiting) cancels its requests, which frees
their rows at the next chunk boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time

import jax
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import encode_message_ids
from ..source_digest import source_digest
from . import protocol
from .chat_output import ChatOutput
from .protocol import APIError
from .scheduler import Failed, Finished, QueueFull, Scheduler, Tokens
from .scheduler import Request as GenRequest

log = logging.getLogger("dsv4_jax.serve")


class _Events:
    """The events of one HTTP request's generations, moved from the device-loop thread to this event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def callback(self, index: int):
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))


class _Choice:
    """What one choice has produced so far."""

    def __init__(self, thinking: bool = False, tools: bool = False):
        self.output = ChatOutput(thinking, tools)
        self.text = ""
        self.pieces: dict[str, str] = {"reasoning_content": "", "content": ""}
        self.logprobs: list = []
        self.tool_calls: list[dict] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0


class Server:
    def __init__(self, scheduler: Scheduler, model_name: str):
        self.scheduler = scheduler
        self.model_name = model_name
        self.tokenizer = scheduler.tokenizer
        self.model = scheduler.model
        self.created = int(time.time())

    # ---- helpers -------------------------------------------------------------------------------------------
    def _requests(self, prompts: list[list[int]], sampling: protocol.Sampling, logprobs: int | None,
                  events: _Events, prompt_param: str) -> list[GenRequest]:
        spare = self.scheduler.speculative_tokens        # a verify step may read k positions past the last token
        max_seq_len = self.model.max_seq_len - spare
        if logprobs is not None and spare:
            raise APIError("logprobs are not available on this server: it decodes speculatively "
                           "(--speculative-tokens)", param="logprobs")
        seed = secrets.randbits(64) if sampling.seed is None else sampling.seed
        requests = []
        for p, ids in enumerate(prompts):
            if len(ids) >= max_seq_len:
                raise APIError(f"the prompt has {len(ids)} tokens; this server's context is max_seq_len="
                               f"{max_seq_len} tokens, prompt and completion together", param=prompt_param,
                               code="context_length_exceeded")
            max_tokens = max_seq_len - len(ids) if sampling.max_tokens is None else sampling.max_tokens
            if len(ids) + max_tokens > max_seq_len:
                raise APIError(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this "
                               f"server's max_seq_len of {max_seq_len} tokens", param="max_tokens",
                               code="context_length_exceeded")
            for choice in range(sampling.n):
                index = p * sampling.n + choice
                requests.append(GenRequest(
                    prompt_ids=ids, max_tokens=max_tokens, on_event=events.callback(index),
                    temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                    choice=choice, stop=sampling.stop,
                    stop_token_ids=[self.model.config.eos_token_id] + sampling.stop_token_ids, logprobs=logprobs))
        return requests

    def _submit(self, requests: list[GenRequest]) -> None:
        try:
            self.scheduler.submit(requests)
        except QueueFull as err:
            raise APIError(str(err), status=429, type="rate_limit_error", code="server_busy") from None

    async def _events(self, events: _Events, requests: list[GenRequest], http: Request):
        """(index, event) until every request has finished; cancels them if the client leaves."""
        remaining = len(requests)
        try:
            while remaining:
                try:
                    index, event = await asyncio.wait_for(events.queue.get(), timeout=1.0)
                except TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                if isinstance(event, (Finished, Failed)):
                    remaining -= 1
                yield index, event
        finally:
            for r in requests:
                if remaining:
                    self.scheduler.cancel(r)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, logprobs) -> list[dict]:
        def entry(token_id, logprob):
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                for lp in logprobs]

    def _completion_logprobs(self, logprobs, offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            tops.append({self._token_text(i): v for i, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _usage(prompt_tokens: int, choices: list[_Choice], requests: list[GenRequest]) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens its first choice took from the
        prefix cache (each prompt counted once, as prompt_tokens counts it)."""
        completion = sum(c.completion_tokens for c in choices)
        cached = sum(r.cached_tokens for r in requests if r.choice == 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _sse(payload) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _sse_response(self, stream, updates, base: dict, include_usage: bool, usage, opening=()):
        """The streamed answer: the `opening` choice updates, then `updates(index, event)` of each event, an error
        event if generation fails, the usage chunk (`usage()`, at the end) and `[DONE]`."""
        async def sse():
            usage_null = {"usage": None} if include_usage else {}
            for update in opening:
                yield self._sse({**base, "choices": [update], **usage_null})
            try:
                async with contextlib.aclosing(stream):       # a client that leaves cancels its requests
                    async for index, event in stream:
                        for update in updates(index, event):
                            yield self._sse({**base, "choices": [update], **usage_null})
            except APIError as err:
                yield self._sse(err.body())
            if include_usage:
                yield self._sse({**base, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream")

    @staticmethod
    async def _drain(stream, updates) -> None:
        """Feed every event to `updates` (the whole answer, not streamed)."""
        async with contextlib.aclosing(stream):
            async for index, event in stream:
                updates(index, event)

    # ---- chat ----------------------------------------------------------------------------------------------
    async def chat(self, http: Request):
        req = protocol.parse_chat(await _json_body(http), self.model_name, self.model.config.vocab_size)
        try:
            prompt = encode_message_ids(self.tokenizer, req.messages, "thinking" if req.thinking else "chat",
                                        req.reasoning_effort, req.tools)
        except ValueError as err:
            raise APIError(str(err), param="messages") from None
        events = _Events()
        requests = self._requests([prompt], req.sampling, req.logprobs, events, "messages")
        self._submit(requests)
        choices = [_Choice(req.thinking, req.tools is not None) for _ in requests]
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        stream = self._events(events, requests, http)

        def updates(index: int, event) -> list[dict]:
            """The deltas (with their logprobs) an event gives its choice."""
            choice = choices[index]
            if isinstance(event, Failed):
                raise APIError(f"generation failed: {event.message}", status=500, type="server_error")
            pieces = choice.output.push(event.text)
            calls = []
            if isinstance(event, Finished):
                tail, calls = choice.output.finish()
                pieces += tail
                choice.tool_calls = calls
                choice.finish_reason = "tool_calls" if calls else event.reason
                choice.completion_tokens = event.completion_tokens
            deltas = [{field: text} for field, text in pieces if text]
            for field, text in pieces:
                choice.pieces[field] += text
            if calls:
                deltas.append({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                               "function": c["function"]} for k, c in enumerate(calls)]})
            logprobs = self._chat_logprobs(event.logprobs) if isinstance(event, Tokens) and event.logprobs else []
            choice.logprobs += logprobs
            if logprobs and not deltas:
                deltas = [{}]
            out = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if logprobs:
                out[0]["logprobs"] = {"content": logprobs}
            if isinstance(event, Finished):
                out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason})
            return out

        if req.stream:
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(len(choices))]
            return self._sse_response(stream, updates, base, req.include_usage,
                                      lambda: self._usage(len(prompt), choices, requests), opening)
        await self._drain(stream, updates)
        if any(c.finish_reason is None for c in choices):
            return JSONResponse({}, status_code=499)            # the client left; nobody reads this
        out = []
        for i, c in enumerate(choices):
            message = {"role": "assistant", "content": c.pieces["content"]}
            if req.thinking:
                message["reasoning_content"] = c.pieces["reasoning_content"]
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            out.append({"index": i, "message": message, "finish_reason": c.finish_reason,
                        "logprobs": {"content": c.logprobs} if req.logprobs is not None else None})
        return {"id": rid, "object": "chat.completion", "created": base["created"], "model": self.model_name,
                "choices": out, "usage": self._usage(len(prompt), choices, requests)}

    # ---- completions ---------------------------------------------------------------------------------------
    async def completions(self, http: Request):
        req = protocol.parse_completion(await _json_body(http), self.model_name, self.model.config.vocab_size)
        prompts = [[self.tokenizer.bos_id] + self.tokenizer.encode(p) if isinstance(p, str) else list(p)
                   for p in req.prompts]
        events = _Events()
        requests = self._requests(prompts, req.sampling, req.logprobs, events, "prompt")
        self._submit(requests)
        choices = [_Choice() for _ in requests]
        rid = f"cmpl-{secrets.token_hex(12)}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        stream = self._events(events, requests, http)
        prompt_tokens = sum(len(p) for p in prompts)

        def update(index: int, event) -> dict:
            choice = choices[index]
            if isinstance(event, Failed):
                raise APIError(f"generation failed: {event.message}", status=500, type="server_error")
            logprobs = None
            if isinstance(event, Tokens) and event.logprobs is not None:
                logprobs = self._completion_logprobs(event.logprobs, len(choice.text))
                choice.logprobs.append(logprobs)
            choice.text += event.text
            if isinstance(event, Finished):
                choice.finish_reason = event.reason
                choice.completion_tokens = event.completion_tokens
            return {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

        if req.stream:
            return self._sse_response(stream, lambda index, event: [update(index, event)], base,
                                      req.include_usage, lambda: self._usage(prompt_tokens, choices, requests))
        await self._drain(stream, update)
        if any(c.finish_reason is None for c in choices):
            return JSONResponse({}, status_code=499)
        out = []
        for i, c in enumerate(choices):
            logprobs = None
            if req.logprobs is not None:
                logprobs = {k: [v for part in c.logprobs for v in part[k]]
                            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            out.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": rid, "object": "text_completion", "created": base["created"], "model": self.model_name,
                "choices": out, "usage": self._usage(prompt_tokens, choices, requests)}


def _prefix_cache_info(scheduler) -> dict | None:
    """The model's prefix cache: entries, bytes, hits, misses, cached tokens (None for a model without one)."""
    cache = getattr(getattr(scheduler, "model", None), "prefix_cache", None)
    return None if cache is None else cache.info()


async def _json_body(http: Request):
    try:
        return json.loads(await http.body())
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(f"the request body is not valid JSON: {err}") from None


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(scheduler: Scheduler, model_name: str) -> FastAPI:
    """The FastAPI application serving `scheduler`'s model as `model_name` (the scheduler must be started)."""
    server = Server(scheduler, model_name)
    devices = jax.devices()
    device = f"{len(devices)} x {devices[0].device_kind}"            # what the load tests record beside their rows
    source_sha256 = source_digest()["sha256"]                        # and the code that served them
    app = FastAPI(title="dsv4_jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(str(err.detail), status=err.status_code, type=kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        return _error_response(APIError(f"invalid request: {err.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def internal_error(_, err: Exception):
        log.exception("request failed")
        return _error_response(APIError(f"internal error: {type(err).__name__}: {err}", status=500,
                                        type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "device": device, "source_sha256": source_sha256, "busy_rows": scheduler.busy_rows(),
                "rows": scheduler.rows,
                "stats": dict(getattr(scheduler, "stats", {})), "prefix_cache": _prefix_cache_info(scheduler)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "dsv4_jax", "max_model_len": scheduler.model.max_seq_len}]}

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await server.chat(http)

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await server.completions(http)

    return app
