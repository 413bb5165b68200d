"""The device loop of the server: one thread owns the model and the shared decode batch (`slots`).

Each turn of the loop it
1. frees the rows of requests that ended on the host (a stop string, a client that went away);
2. admits waiting requests into free rows (prefilled alone, or with `admit_batch` > 1 up to that many together, then
   each written into its row: `slots.admit`);
3. starts the next chunk of the whole batch (`generation.generate_chunk`, `chunk` steps, speculative or not);
4. reads the tokens of the chunk before it, which ran while the host handled the previous turn, and hands each
   request its tokens and text through its `on_event` callback.
So the device always has the next chunk queued while the host reads, and requests join and leave at chunk
boundaries. The HTTP side only calls `submit` and `cancel` (thread-safe); it never touches the device, and this
thread never waits on a client: `on_event` must return at once (the server's posts to its event loop).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..api import batch_bucket
from ..generation import ChunkOut, generate_chunk
from ..sampling import Sampling
from ..text import TextStream
from . import slots as device

log = logging.getLogger("dsv4_jax.serve")

MAX_STOP_TOKENS = 8          # stop token ids per request, EOS included


class QueueFull(Exception):
    """Every row is busy and the waiting queue holds `max_queue` requests."""


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # (id, logprob), best first; empty unless top logprobs were asked for


@dataclasses.dataclass
class Tokens:
    """New output of a request: final text (held back while it could still become a stop string) and ids."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


@dataclasses.dataclass
class Finished:
    reason: str                # "stop" or "length"
    text: str                  # the last text released at the end
    completion_tokens: int


@dataclasses.dataclass
class Failed:
    message: str


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to generate (one choice of an OpenAI request). Sampling: temperature 0 is greedy, top_k 0 and
    top_p 1 disable those filters; `seed` in [0, 2**64); `logprobs`: None, or how many top alternatives (0-20)."""
    prompt_ids: list[int]
    max_tokens: int
    on_event: Callable[[object], None]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    choice: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    cancelled: bool = False            # set by `Scheduler.cancel`; the loop frees the row
    cached_tokens: int = 0             # prompt tokens taken from the prefix cache (set when the request starts)


class _Live:
    """A request while it holds a row: its text stream and what the host knows of its progress."""

    def __init__(self, request: Request, tokenizer, slot: int):
        self.request = request
        self.slot = slot
        self.text = TextStream(tokenizer, request.stop, request.stop_token_ids)
        self.generated = 0
        self.finished = False
        self.received: list[int] = []      # every id the device emitted for the row (past a stop string too)

    def emit(self, event) -> None:
        try:
            self.request.on_event(event)
        except Exception:               # a receiver that is gone (its event loop closed) must not stop the loop
            log.exception("delivering an event failed")
            self.request.cancelled = True

    def take(self, ids: list[int], logprobs: list[TokenLogprob] | None) -> str | None:
        """Hand over new tokens; returns the finish reason once the request is complete."""
        req = self.request
        self.received += ids
        ids = ids[:req.max_tokens - self.generated]
        self.generated += len(ids)
        before = len(self.text.token_ids)
        delta = self.text.push(ids)
        used = len(self.text.token_ids) - before          # ids after a stop are not part of the output
        if ids:
            self.emit(Tokens(delta, ids[:used], logprobs[:used] if logprobs is not None else None))
        if self.text.stopped:
            return "stop"
        if self.generated >= req.max_tokens:
            return "length"
        return None

    def consumed_by_device(self) -> list[int] | None:
        """The tokens the row's state consumed, when the device finished the row itself (a stop token, or
        max_tokens): the prompt and all but the last generated token. None when the host stopped it (a stop
        string): the device may have gone on."""
        received, req = self.received, self.request
        if not received or not (received[-1] in req.stop_token_ids or len(received) >= req.max_tokens):
            return None
        return req.prompt_ids + received[:-1]


class Scheduler:
    """Continuous batching over `model` (a dsv4_jax Model; its max_batch rows are the slots)."""

    def __init__(self, model, *, chunk: int = 8, max_queue: int = 256, speculative_tokens: int = 0,
                 idle_wait_s: float = 0.05, admit_batch: int = 1, admit_tokens: int = 8192, prefill_step: int = 0):
        """`admit_batch` (a power of two, at most the model's max_batch): how many waiting requests may be prefilled
        in one call (one state of that many rows, padded to a power of two with one-token rows, so the prefill
        programs are those of batch 1, 2, 4, ... admit_batch), each weight then read once for all of them instead
        of once per request; a group takes the queue's requests in order while its rows times its longest prompt
        stay within `admit_tokens` (a long prompt is not padded up to by short ones), one group per turn of the
        loop while other rows are generating (their next chunk waits for it). 1: each request alone.
        `prefill_step` (0: off): while other rows are generating, a prompt longer than that is prefilled alone, that
        many tokens per turn of the loop (Model.prefill_prompt_steps), so each of their chunks waits for one step of
        it instead of its whole prefill; no other request is admitted meanwhile (the queue keeps its order)."""
        if admit_batch < 1 or admit_batch & (admit_batch - 1) or admit_batch > model.max_batch:
            raise ValueError(f"admit_batch must be a power of two in [1, max_batch={model.max_batch}], got "
                             f"{admit_batch}")
        if admit_tokens < 1:
            raise ValueError(f"admit_tokens must be positive, got {admit_tokens}")
        if prefill_step < 0:
            raise ValueError(f"prefill_step must be >= 0 (0: off), got {prefill_step}")
        if model.tokenizer is None:
            raise ValueError("the server needs a tokenizer: the checkpoint directory has no tokenizer.json")
        if speculative_tokens and not model.config.n_mtp_layers:
            raise ValueError("speculative decoding needs a model with an MTP block (its config has n_mtp_layers=0)")
        self.speculative_tokens = speculative_tokens
        self.model = model
        self.tokenizer = model.tokenizer
        self.chunk = chunk
        self.max_queue = max_queue
        self.idle_wait_s = idle_wait_s
        self.admit_batch = admit_batch
        self.admit_tokens = admit_tokens
        self.prefill_step = prefill_step
        self._stepping = None           # (request, its Model.prefill_prompt_steps) while a long prompt is prefilled
        self.rows = model.max_batch
        self._slots = device.init_slots(model.init_state(), MAX_STOP_TOKENS)
        self._owners: list[_Live | None] = [None] * self.rows
        self._fed = np.zeros(self.rows, np.int64)       # a bound on each row's position, known on the host
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsv4_jax-device-loop", daemon=True)
        # cancelled: rows freed for a client that left; verify_steps / accepted_drafts: speculative decoding's.
        # Where the device loop's time goes, in seconds: busy_s, the loop's passes that had work; chunk_wait_s, of
        # those, waiting for a decode chunk's outputs (the device decoding while the host has nothing left to do);
        # admit_s, admitting requests (their prefill and first token); dispatch_s, launching the next decode chunk.
        # It is counted apart because a launch may wait on the device: on one H100 (2026-12-06, before dispatch_s
        # existed) the host's share per chunk matched the chunk's decode time and chunk_wait_s was ~0, as when XLA
        # reads the chunk's while-loop condition on the host after each step. The rest of busy_s is the host's own
        # work between chunks (reading tokens, detokenizing, stop strings, events), which the device overlaps with
        # the chunk in flight.
        # admitted: requests; admit_calls: the prefill calls that admitted them (fewer with admit_batch > 1);
        # prefill_steps: the steps of prompts prefilled in steps (prefill_step).
        self.stats = {"admitted": 0, "admit_calls": 0, "prefill_steps": 0, "chunks": 0, "cancelled": 0,
                      "verify_steps": 0, "accepted_drafts": 0, "busy_s": 0.0, "chunk_wait_s": 0.0, "admit_s": 0.0,
                      "dispatch_s": 0.0}

    # ---- called from any thread ------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, requests: list[Request]) -> None:
        """Queue requests (all or none). Raises QueueFull when the queue cannot take them."""
        for r in requests:
            if len(r.stop_token_ids) > MAX_STOP_TOKENS:
                raise ValueError(f"at most {MAX_STOP_TOKENS} stop token ids, got {len(r.stop_token_ids)}")
        with self._lock:
            free_rows = sum(o is None for o in self._owners)       # read without the loop's lock: a hint
            if len(self._waiting) + len(requests) > self.max_queue + free_rows:
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are waiting for one of its "
                                f"{self.rows} rows (queue limit {self.max_queue}); retry later")
            self._waiting.extend(requests)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): it gets no more events and its row is freed."""
        request.cancelled = True
        self._wake.set()

    def busy_rows(self) -> int:
        return sum(o is not None for o in self._owners)

    # ---- the device-loop thread ------------------------------------------------------------------------------
    def _run(self):
        in_flight = None                  # (owners when dispatched, device outputs) of the chunk not yet read
        while not self._stop.is_set():
            start = time.perf_counter()
            self._free_cancelled()
            admitted = self._admit_waiting()
            admit_s = time.perf_counter() - start
            live = [o for o in self._owners if o is not None and not o.finished]
            launch = time.perf_counter()
            dispatched = self._dispatch(live) if live else None
            dispatch_s = time.perf_counter() - launch
            try:
                if in_flight is not None:
                    self.stats["chunk_wait_s"] += self._deliver(*in_flight)
                for first in admitted:
                    admit_s += self._deliver(*first)
            except Exception as err:          # a bug here must not kill the loop silently
                log.exception("reading a chunk failed")
                self._fail_all(f"internal error: {err}")
                dispatched = None
            if admitted or in_flight is not None or dispatched is not None:
                self.stats["busy_s"] += time.perf_counter() - start
                self.stats["admit_s"] += admit_s
                self.stats["dispatch_s"] += dispatch_s
            in_flight = dispatched
            if in_flight is None and not admitted:
                with self._lock:
                    idle = not self._waiting and self._stepping is None
                if idle:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        self._fail_all("the server is shutting down")

    def _free(self, live: _Live):
        live.finished = True
        if self._owners[live.slot] is live:
            self._owners[live.slot] = None

    def _free_cancelled(self):
        for live in self._owners:
            if live is not None and live.request.cancelled:
                self._free(live)
                self.stats["cancelled"] += 1

    def _fail_all(self, message: str):
        for live in self._owners:
            if live is not None:
                self._free(live)
                live.emit(Failed(message))
        if self._stepping is not None:
            req, self._stepping = self._stepping[0], None
            req.on_event(Failed(message))
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for req in waiting:
            req.on_event(Failed(message))

    def _admit_waiting(self) -> list:
        """Prefill waiting requests into free rows; returns their first-token reads. Alone (admit_batch 1): every
        waiting request that has a row. In groups: one group while other rows are generating, so that their next
        chunk waits for one prefill call only; all that have rows while none is."""
        reads = []
        while True:
            free = [s for s, o in enumerate(self._owners) if o is None]
            generating = len(free) < self.rows
            if self._stepping is not None:
                return reads + self._step(free, generating)
            group = self._next_group(len(free))
            if not group:
                return reads
            if generating and self._long(group[0]):
                self._stepping = (group[0], self.model.prefill_prompt_steps(group[0].prompt_ids, self.prefill_step,
                                                                            self.track_mtp))
                return reads + self._step(free, generating)
            try:
                reads += self._admit(group, free)
            except Exception as err:
                log.exception("admitting a request failed")
                for req in group:
                    req.on_event(Failed(f"internal error: {err}"))
            if self.admit_batch > 1 and generating:
                return reads

    def _long(self, req: Request) -> bool:
        """Whether `req` is prefilled in steps (prefill_step) when other rows are generating."""
        return bool(self.prefill_step) and len(req.prompt_ids) - 1 > self.prefill_step

    @property
    def track_mtp(self) -> bool:
        """Whether the requests' prefills feed the MTP block's window (the model tracks it, or drafts need it)."""
        return self.model.track_mtp or bool(self.speculative_tokens)

    def _step(self, free: list[int], generating: bool) -> list:
        """The next step of the prompt being prefilled in steps (all the rest where no row is generating); when it
        is done, the request is admitted into a free row (no other request took one meanwhile) and its first-token
        read returned. A cancelled request is dropped."""
        req, steps = self._stepping
        if req.cancelled:
            self._stepping = None
            return []
        try:
            while True:
                self.stats["prefill_steps"] += 1
                next(steps)
                if generating:
                    return []
        except StopIteration as done:
            logits, prefilled, cached = done.value
        except Exception as err:
            log.exception("prefilling a request failed")
            self._stepping = None
            req.on_event(Failed(f"internal error: {err}"))
            return []
        self._stepping = None
        self.stats["admit_calls"] += 1
        return self._write_rows([req], free, logits, prefilled, cached)

    def _next_group(self, n_free: int) -> list[Request]:
        """The next requests to prefill together, in queue order (cancelled ones dropped): at most n_free and
        admit_batch of them, while the group's rows (a power of two) times its longest prompt stay within
        admit_tokens (the first always goes)."""
        group: list[Request] = []
        with self._lock:
            while self._waiting and len(group) < min(n_free, self.admit_batch):
                req = self._waiting[0]
                if req.cancelled:
                    self._waiting.popleft()
                    continue
                longest = max(len(r.prompt_ids) for r in group + [req])
                if group and (batch_bucket(len(group) + 1, self.admit_batch) * longest > self.admit_tokens
                              or self._long(req)):
                    break
                group.append(self._waiting.popleft())
                if self._long(req):         # prefilled alone (in steps while rows are generating)
                    break
        return group

    def _admit(self, group: list[Request], free: list[int]) -> list:
        """Prefill `group` in one call (its rows padded to a power of two with one-token prompts, whose rows are
        dropped) and write each request into a free row; returns their first-token reads."""
        model = self.model
        prompts = [req.prompt_ids for req in group]
        prompts += [prompts[0][:1]] * (batch_bucket(len(prompts), self.admit_batch) - len(prompts))
        # from the longest prefix an earlier request left in the prefix cache (prefix_cache.py), if any
        logits, prefilled, cached = model.prefill_prompts(prompts, track_mtp=self.track_mtp)
        self.stats["admit_calls"] += 1
        return self._write_rows(group, free, logits, prefilled, cached)

    def _write_rows(self, group: list[Request], free: list[int], logits, prefilled, cached: list[int]) -> list:
        """Write request i of `group`, prefilled in row i of `prefilled` (its last token's logits in row i of
        `logits`), into the shared batch's row free[i] with its first token; returns their first-token reads."""
        reads = []
        for i, (req, slot) in enumerate(zip(group, free)):
            req.cached_tokens = cached[i]
            stops = np.full((1, MAX_STOP_TOKENS), -1, np.int32)
            stops[0, :len(req.stop_token_ids)] = req.stop_token_ids
            row = Sampling(temperature=jnp.full((1,), req.temperature, jnp.float32),
                           top_k=jnp.full((1,), req.top_k, jnp.int32), top_p=jnp.full((1,), req.top_p, jnp.float32),
                           max_new_tokens=jnp.full((1,), req.max_tokens, jnp.int32), stop_tokens=jnp.asarray(stops),
                           key=jnp.zeros((1, 2), jnp.uint32))
            seed = np.array([(req.seed >> 32) & 0xFFFFFFFF, req.seed & 0xFFFFFFFF], np.uint32)
            n_top = device.MAX_TOP_LOGPROBS if req.logprobs else 0
            self._slots, out = device.admit(self._slots, prefilled, logits, jnp.int32(i), jnp.int32(slot),
                                            jnp.asarray(seed), jnp.int32(req.choice), row, n_top=n_top)
            live = _Live(req, self.tokenizer, slot)
            self._owners[slot] = live
            self._fed[slot] = len(req.prompt_ids) + 1
            self.stats["admitted"] += 1
            token, logprob, top_ids, top_logprobs = out                 # one row, one step
            first = ChunkOut(token[:, None], logprob[:, None], top_ids[:, None], top_logprobs[:, None],
                             jnp.zeros((1,), jnp.int32), jnp.zeros((1, 0), jnp.int32))
            reads.append(([(0, live)], first))
        return reads

    def _keep_completion(self, live: _Live) -> None:
        """Keep a finished request's row in the prefix cache (the next turn of its conversation may extend its
        completion), unless the host stopped it. The row is frozen on the device since it finished, so the state
        of the chunk dispatched meanwhile still holds it."""
        cache = self.model.prefix_cache
        consumed = live.consumed_by_device() if cache.enabled else None
        if consumed is not None and len(consumed) > len(live.request.prompt_ids):
            cache.save(consumed, self._slots.decode, live.slot, self.track_mtp)

    def _launch(self, halt: np.ndarray, bound: int, logprobs: bool, n_top: int):
        """Start a decode chunk of the shared batch with the rows `halt` marks done, in the context bucket of
        positions below `bound`; returns its outputs (a generation.ChunkOut, not read yet)."""
        model = self.model
        self._slots, out = generate_chunk(model.params, self._slots, jnp.asarray(halt), cfg=model.config,
                                          ctx=model.context_for(min(bound, model.max_seq_len)),
                                          max_seq_len=model.max_seq_len, chunk=self.chunk, logprobs=logprobs,
                                          n_top=n_top, track_mtp=model.track_mtp,
                                          speculative_tokens=self.speculative_tokens)
        return out

    def compile_decode(self, bound: int, logprobs: bool, n_top: int) -> None:
        """Compile (and run, every row halted: its loop ends at once) the decode chunk of the context bucket of
        positions below `bound` with that logprobs variant. Before the loop's first request only (serve.warm_up):
        it uses the shared batch outside the loop."""
        if self.stats["admitted"] or self._waiting:
            raise RuntimeError("compile_decode runs before the first request only")
        jax.block_until_ready(self._launch(np.ones((self.rows,), bool), bound, logprobs, n_top))

    def _dispatch(self, live: list[_Live]):
        halt = np.array([o is None or o.finished for o in self._owners])
        k = self.speculative_tokens
        for o in live:
            self._fed[o.slot] += self.chunk * (k + 1)
        bound = int(max(self._fed[o.slot] for o in live))
        logprobs = not k and any(o.request.logprobs is not None for o in live)
        n_top = device.MAX_TOP_LOGPROBS if logprobs and any(o.request.logprobs for o in live) else 0
        out = self._launch(halt, bound, logprobs, n_top)
        self.stats["chunks"] += 1
        rows = [(slot, o) for slot, o in enumerate(self._owners) if o is not None and not o.finished]
        return rows, out

    def _deliver(self, rows: list[tuple[int, _Live]], out) -> float:
        """Hand out a read: `rows` are (row of the arrays, the request that held it when they were computed);
        requests that finished since get nothing (their row may already serve another). Returns the seconds spent
        waiting for the device's outputs."""
        start = time.perf_counter()
        out = jax.device_get(out)                                   # a generation.ChunkOut
        waited = time.perf_counter() - start
        arrays = [np.asarray(a) for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)]
        if self.speculative_tokens:
            self.stats["verify_steps"] += int(np.asarray(out.steps).sum())
            self.stats["accepted_drafts"] += int(np.asarray(out.accepted).sum())
        tokens = arrays[0]
        for row, live in rows:
            if live.finished:
                continue
            keep = tokens[row] >= 0
            ids = [int(t) for t in tokens[row][keep]]
            logprobs = None
            if live.request.logprobs is not None:
                lp, top_ids, top_lp = (a[row][keep] for a in arrays[1:])
                n = live.request.logprobs
                logprobs = [TokenLogprob(t, float(lp[i]), [(int(j), float(v)) for j, v in
                                                           zip(top_ids[i][:n], top_lp[i][:n])])
                            for i, t in enumerate(ids)]
            reason = live.take(ids, logprobs)
            if reason is not None:
                self._keep_completion(live)
                self._free(live)
                live.emit(Finished(reason, live.text.flush(), live.generated))
        return waited
