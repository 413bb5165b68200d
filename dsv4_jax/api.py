"""`Model`: the user-facing object returned by `dsv4_jax.load` and `dsv4_jax.init_random`.

It holds the config, the weights as a Flax NNX module (`model.module`, dsv4_jax.DeepseekV4) and the run context
(`model.context`: numerics and the kernel plan, resolved once here), validates inputs eagerly on the host, and
calls the jitted programs of `engine` (each compiled once per shape) on `model.params`, the engine's parameter tree
of the module's arrays (the same arrays, regrouped once).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import engine, generation, stats_report
from .config import ModelConfig
from .layer_scan import is_scanned, scan_plan, stack_layers, unstack_layers
from .module import DeepseekV4
from .ops import layer_stats
from .prefix_cache import PrefixCache
from .sampling import Sampling
from .settings import Settings
from .sharding import check_mesh, param_shardings, state_shardings
from .state import DecodeState, init_state, state_bytes
from .text import complete
from .tokenizer import load_tokenizer


@functools.cache
def _state_maker(cfg: ModelConfig, batch: int, max_seq_len: int, dtype, scan_layers: bool, kv_cache_dtype, mesh):
    """One jitted program that makes a fresh state (instead of many small ops), on the mesh's devices with each
    buffer's batch rows on the "data" axis when there is a mesh."""
    make = lambda: init_state(cfg, batch, max_seq_len, dtype, scan_layers, kv_cache_dtype)  # noqa: E731
    if mesh is None:
        return jax.jit(make)
    return jax.jit(make, out_shardings=state_shardings(jax.eval_shape(make), mesh))


MIN_CONTEXT_BUCKET = 4096     # the smallest context bucket: below it the whole buffers are cheap anyway


# Two statistics summaries as one, on the device (one small program instead of an op per leaf).
_merge_summaries = jax.jit(layer_stats.merge)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _finish(steps):
    """The return value of a generator run to its end."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def _merged(summary, part: list):
    """A statistics summary (or None) merged with a prefill's optional one (`part`: [] or [summary])."""
    if not part:
        return summary
    return part[0] if summary is None else _merge_summaries(summary, part[0])


def _padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists (some may be empty) as (tokens [B, S] zero-padded, lengths [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), max(1, int(lengths.max()))), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    return tokens, lengths


def context_bucket(positions: int, max_seq_len: int) -> int | None:
    """The context limit of a call whose tokens all lie below `positions`: the smallest power of two >=
    max(positions, MIN_CONTEXT_BUCKET), or None (the whole buffers) once that reaches max_seq_len. Each bucket is
    one compiled program, so a 1M-token context meets at most ~9 of them."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < positions:
        bucket *= 2
    return None if bucket >= max_seq_len else bucket


def prefill_chunk_size(tokens: int, prefill_chunk: int) -> int:
    """The chunk `tokens` prompt tokens are prefilled in: the next power of two, at most `prefill_chunk`. Chunks are
    padded to a power of two so that prompts of many lengths share a few compiled programs."""
    return min(prefill_chunk, 1 << max(tokens - 1, 0).bit_length())


def batch_bucket(batch: int, max_batch: int) -> int:
    """The rows a generation of `batch` prompts runs with: the next power of two, at most max_batch."""
    return min(1 << max(batch - 1, 0).bit_length(), max_batch)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]          # generated ids per prompt (stop token included when hit)
    finish_reasons: list[str]        # "stop" (EOS / stop token) or "length"
    # Speculative decoding only (speculative_tokens > 0), over the batch: tokens produced per main-model step
    # (1 + the mean accepted drafts), and per draft position j the share of steps whose draft j was accepted.
    acceptance: float | None = None
    acceptance_rates: list[float] | None = None
    # Prompt tokens per prompt continued from the prefix cache instead of prefilled (Settings.prefix_cache).
    cached_tokens: list[int] | None = None
    # With stats=True: the layers' statistics over the generated tokens' steps and over the prompt's prefill
    # (stats_report.StatsReport: a table, flags, JSON).
    stats: stats_report.StatsReport | None = None
    prompt_stats: stats_report.StatsReport | None = None


class Model:
    def __init__(self, cfg: ModelConfig, params, settings: Settings | None = None, *, mesh=None, tokenizer=None,
                 consume_params: bool = False, **options):
        """`settings` (settings.Settings) and / or its options as keywords (dtype, simulate_quant, act_quant,
        kernels, kernel_overrides, target, max_seq_len, max_batch, prefill_chunk, track_mtp, scan_layers,
        kv_cache_dtype; Settings says what each does), validated there once. `mesh` (sharding.make_mesh): the
        devices the model runs on; parameters not yet placed on it are placed by sharding.rules, and decode states
        are made on it. `tokenizer`: the checkpoint's, a dsv4_jax.tokenizer.Tokenizer or the path of its
        tokenizer.json (read on first use of `model.tokenizer`). With `scan_layers` (layer_scan.py: a deep model's
        programs compile in a fraction of the time; a step moves each scanned cache once more) the weights are
        stacked once, here, and with `consume_params` the given per-layer arrays are deleted as they are stacked
        (load and init_random pass it: nothing else holds them); params already stacked (another scanned Model's)
        are taken as they are. `model.module` of a scanned model is built on first use, from copies."""
        settings = Settings.of(settings, **options)
        settings.check_context(cfg)
        self.settings = settings
        self.kv_cache_dtype = settings.kv_cache_dtype
        max_batch = settings.max_batch
        self.config = cfg
        self._tokenizer = tokenizer
        self.mesh = mesh
        stacked = is_scanned(params)                    # another scanned Model's params
        if mesh is not None:
            check_mesh(cfg, mesh, max_batch)
            if stacked:
                raise NotImplementedError("Model(mesh=...) from already stacked params: pass the per-layer tree "
                                          "with scan_layers=True")
            params = jax.device_put(params, param_shardings(cfg, mesh, params))    # no copy where already placed
        self.context = settings.run_context(mesh)
        plan = params["layers"].plan if stacked else scan_plan(cfg) if settings.scan_layers else None
        self.scan_layers = plan is not None        # a model without a repeated pattern runs unrolled
        if plan is None:
            self._module = DeepseekV4(cfg, params=params, context=self.context)
        else:
            self._module = None
            if not stacked:
                params = {**params, "layers": stack_layers(params["layers"], plan, consume=consume_params)}
        # Regrouped once, not per call: a step's jitted program takes this tree (no Python walk of the module).
        # After replacing a variable of `module`, build a new Model from `module.params()`.
        self.params = params
        self.max_seq_len = settings.max_seq_len
        self.max_batch = max_batch
        self.prefill_chunk = settings.prefill_chunk
        # Keep the MTP block's window current during prefill/decode (one extra block per step), for drafts.
        self.track_mtp = settings.track_mtp and cfg.n_mtp_layers > 0
        if settings.prefix_cache and mesh is not None:
            raise NotImplementedError("prefix_cache on a mesh (the snapshot pool is one device's)")
        self.prefix_cache = PrefixCache(settings.prefix_cache, self.state_bytes(1), self.init_pool)

    @property
    def module(self) -> DeepseekV4:
        """The weights as a Flax NNX module (dsv4_jax.DeepseekV4)."""
        if self._module is None:
            layers = unstack_layers(self.params["layers"])
            self._module = DeepseekV4(self.config, params={**self.params, "layers": layers}, context=self.context)
        return self._module

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (dsv4_jax.tokenizer.Tokenizer), or None when it came without one."""
        if isinstance(self._tokenizer, (str, os.PathLike)):
            self._tokenizer = load_tokenizer(self._tokenizer)
        return self._tokenizer

    # ---- validation ---------------------------------------------------------------------------------------
    def _check_tokens(self, tokens, ndim: int, what: str) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must be an integer array of rank {ndim}, got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
            raise ValueError(f"{what} must be token ids in [0, {self.config.vocab_size}), got "
                             f"[{arr.min()}, {arr.max()}]")
        return arr.astype(np.int32)

    def _check_batch(self, batch: int):
        if batch > self.max_batch:
            raise ValueError(f"batch of {batch} sequences exceeds max_batch={self.max_batch}")

    # ---- forward --------------------------------------------------------------------------------------------
    def forward(self, tokens, stats: bool = False):
        """int32 [B, S] -> float32 logits [B, S, V], teacher-forced from position 0. `stats`: (logits, the layers'
        statistics), a device summary (ops/layer_stats.py) that dsv4_jax.stats_report.report turns into a table."""
        tokens = self._check_tokens(tokens, 2, "tokens")
        return engine.forward(self.params, jax.device_put(tokens), cfg=self.config, ctx=self._stats_context(stats))

    def _stats_context(self, stats: bool, ctx=None):
        """The run context (default: the model's) with the layer statistics on or off (a one-line error for a
        `stats` that is not a bool)."""
        if not isinstance(stats, bool):
            raise ValueError(f"stats must be True or False, got {stats!r}")
        ctx = self.context if ctx is None else ctx
        return ctx.replace(stats=True) if stats else ctx

    def forward_mtp(self, tokens, next_tokens) -> jax.Array:
        """MTP logits [B, S, V]: position i uses the main model's streams at i and next_tokens[:, i]."""
        tokens = self._check_tokens(tokens, 2, "tokens")
        next_tokens = self._check_tokens(next_tokens, 2, "next_tokens")
        if tokens.shape != next_tokens.shape:
            raise ValueError(f"next_tokens shape {next_tokens.shape} must equal tokens shape {tokens.shape}")
        return engine.forward_mtp(self.params, jnp.asarray(tokens), jnp.asarray(next_tokens), cfg=self.config,
                                  ctx=self.context)

    # ---- decoding -------------------------------------------------------------------------------------------
    def init_state(self, batch: int | None = None) -> DecodeState:
        batch = self.max_batch if batch is None else batch
        self._check_batch(batch)
        return _state_maker(self.config, batch, self.max_seq_len, self.context.jnp_dtype, self.scan_layers,
                            self.kv_cache_dtype, self.mesh)()

    def init_pool(self, rows: int) -> DecodeState:
        """A fresh state of `rows` rows of this model's layout, whatever max_batch is (the prefix cache's pool)."""
        return _state_maker(self.config, rows, self.max_seq_len, self.context.jnp_dtype, self.scan_layers,
                            self.kv_cache_dtype, self.mesh)()

    def state_bytes(self, batch: int | None = None) -> int:
        return state_bytes(self.config, self.max_batch if batch is None else batch, self.max_seq_len,
                           self.context.dtype, self.kv_cache_dtype)

    def prefill(self, tokens, lengths=None, state: DecodeState | None = None, track_mtp: bool | None = None,
                stats: bool = False, positions: Sequence[int] | None = None):
        """Consume prompts tokens [B, S] (row b's first lengths[b] tokens are real). Without `state` a fresh one
        is made; with one, the tokens continue each sequence (chunked prefill). Returns (logits [B, V] of each
        row's last consumed token, state). `track_mtp` (default: the model's) also feeds the MTP block's window.
        `stats`: (logits, state, the layers' statistics summed up over the chunks, on the device). `positions`:
        `state`'s positions as the caller knows them on the host, so they are not read back from the device (a
        read waits for every computation queued before it, e.g. a server's decode chunk in flight)."""
        tokens = self._check_tokens(tokens, 2, "tokens")
        batch, seq = tokens.shape
        self._check_batch(batch)
        lengths = np.full((batch,), seq, np.int32) if lengths is None else np.asarray(lengths)
        if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be {batch} integers, got {lengths.dtype} {lengths.shape}")
        if lengths.min() < 0 or lengths.max() > seq:
            raise ValueError(f"lengths must lie in [0, {seq}], got {lengths.tolist()}")
        if state is None:
            state = self.init_state(batch)
            consumed = np.zeros(batch, np.int64)
        else:
            if state.positions.shape[0] != batch:
                raise ValueError(f"state holds {state.positions.shape[0]} sequences, tokens have {batch}")
            known = jax.device_get(state.positions) if positions is None else positions
            consumed = np.asarray(known).astype(np.int64)
            if consumed.shape != (batch,):
                raise ValueError(f"positions must be {batch} integers, got shape {consumed.shape}")
        too_long = consumed + lengths > self.max_seq_len
        if too_long.any():
            b = int(np.argmax(too_long))
            raise ValueError(f"sequence {b}: {int(consumed[b] + lengths[b])} tokens exceed max_seq_len="
                             f"{self.max_seq_len}")
        ctx = self._stats_context(stats, self.context_for(int((consumed + lengths).max())))
        chunk = prefill_chunk_size(seq, self.prefill_chunk)
        n_chunks = max(1, -(-seq // chunk))
        padded = np.zeros((batch, n_chunks * chunk), np.int32)
        padded[:, :seq] = tokens
        # host arrays go over explicitly (jax.device_put): a prefill runs under jax.transfer_guard("disallow")
        logits = jax.device_put(np.zeros((batch, self.config.vocab_size), np.float32))
        summary = None
        for k in range(n_chunks):
            n_valid = np.clip(lengths - k * chunk, 0, chunk).astype(np.int32)
            logits, state, *chunk_summary = engine.prefill_chunk(
                self.params, state, jax.device_put(padded[:, k * chunk:(k + 1) * chunk]), jax.device_put(n_valid),
                logits, cfg=self.config, ctx=ctx, track_mtp=self.track_mtp if track_mtp is None else track_mtp)
            summary = _merged(summary, chunk_summary)
        return (logits, state, summary) if stats else (logits, state)

    def prefill_prompts(self, prompts: Sequence[Sequence[int]], track_mtp: bool | None = None, stats: bool = False):
        """Prefill a batch of prompts (lists of token ids; one row each). With the prefix cache (Settings.prefix_cache;
        prefix_cache.py) each row continues from the longest cached prefix of its prompt, and each prompt but its
        last token is kept for later prompts (the last token is prefilled on its own). Returns (logits [B, V] of
        each prompt's last token, state, cached [B]: the tokens each row took from the cache[, the statistics
        summary of what was prefilled, with `stats`])."""
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        rows = len(prompts)
        track = self.track_mtp if track_mtp is None else track_mtp
        cache = self.prefix_cache
        if not cache.enabled:
            logits, state, *summary = self.prefill(*_padded(prompts), track_mtp=track, stats=stats)
            return (logits, state, [0] * rows, *summary)
        logits, state, cached, summary = _finish(self._prefill_continuing(prompts, track, stats))
        return (logits, state, cached, summary) if stats else (logits, state, cached)

    def prefill_prompt_steps(self, prompt: Sequence[int], step: int, track_mtp: bool | None = None):
        """prefill_prompts([prompt]) with the prompt's head (all but its last token, after the longest prefix the
        prefix cache holds) prefilled `step` tokens per call: a generator that yields after each step but the last
        and returns what prefill_prompts returns, (logits [1, V], state, cached [1]). The server runs one step per
        turn of its loop, so a long prompt holds up the rows that are generating for one step at a time instead of
        its whole prefill. The prefix cache keeps the head, as prefill_prompts does."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        if step < 1:
            raise ValueError(f"step must be positive, got {step}")
        track = self.track_mtp if track_mtp is None else track_mtp
        logits, state, cached, _ = yield from self._prefill_continuing([prompt], track, False, step)
        return logits, state, cached

    def _prefill_continuing(self, prompts: list[list[int]], track: bool, stats: bool, step: int | None = None):
        """Each row continues from the longest prefix of its prompt the prefix cache holds (none with the cache
        off), its head (all but the last token) is prefilled `step` tokens per call (None: in one) and kept by the
        cache, then every row's last token alone. A generator: yields after each call of the heads but the last,
        returns (logits [B, V], state, cached [B], the statistics summary or None). Every call's positions are known
        on the host (Model.prefill's `positions`), so nothing is read back from the device."""
        rows, cache = len(prompts), self.prefix_cache
        state, cached = self.init_state(rows), [0] * rows
        if cache.enabled:
            for b, p in enumerate(prompts):
                entry, cached[b] = cache.lookup(p, track)
                if entry is not None:
                    state = cache.restore(entry, state, b)
        heads = [p[n:-1] for p, n in zip(prompts, cached, strict=True)]
        longest = max(len(h) for h in heads)
        step = step or max(longest, 1)
        summary = None
        for start in range(0, longest, step):
            _, state, *part = self.prefill(*_padded([h[start:start + step] for h in heads]), state=state,
                                           track_mtp=track, stats=stats,
                                           positions=[n + min(start, len(h)) for n, h in zip(cached, heads)])
            summary = _merged(summary, part)
            if start + step < longest:
                yield
        for b, p in enumerate(prompts):
            if cached[b] < len(p) - 1:                  # its head was prefilled (save: nothing with the cache off)
                cache.save(p[:-1], state, b, track)
        # (each row's position: its whole prompt but the last token)
        logits, state, *part = self.prefill(*_padded([p[-1:] for p in prompts]), state=state, track_mtp=track,
                                            stats=stats, positions=[len(p) - 1 for p in prompts])
        return logits, state, cached, _merged(summary, part)

    def context_for(self, positions: int):
        """The run context of a call whose tokens all lie below `positions` (known on the host: no device read)."""
        return self.context.replace(context_limit=context_bucket(positions, self.max_seq_len))

    def decode(self, tokens, state: DecodeState, stats: bool = False):
        """One step: tokens [B] -> (logits [B, V], state). The state is donated (do not reuse the old one). Host
        token ids are checked here; device arrays are not read back: a row whose id lies outside the vocabulary,
        or whose sequence is past max_seq_len, gets NaN logits (and its state row is no longer meaningful).
        `stats`: (logits, state, the step's layer statistics, on the device)."""
        if not isinstance(tokens, jax.Array):
            tokens = jax.device_put(self._check_tokens(tokens, 1, "tokens"))
        return engine.decode_step(self.params, state, tokens, cfg=self.config, ctx=self._stats_context(stats),
                                  max_seq_len=self.max_seq_len, track_mtp=self.track_mtp)

    def mtp_draft(self, next_tokens, state: DecodeState) -> jax.Array:
        """MTP draft logits [B, V] for the token after `next_tokens` [B] (the tokens following each sequence's last
        consumed position); the state is not changed. Needs a model made with track_mtp=True."""
        if not self.track_mtp:
            raise ValueError("mtp_draft needs a model created with track_mtp=True (and a config with an MTP block)")
        if not isinstance(next_tokens, jax.Array):
            next_tokens = jnp.asarray(self._check_tokens(next_tokens, 1, "next_tokens"))
        return engine.mtp_draft(self.params, state, next_tokens, cfg=self.config, ctx=self.context)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
                 stream: Callable[[list[list[int]]], object] | None = None, chunk: int = 16,
                 speculative_tokens: int = 0, stats: bool = False) -> GenerationResult:
        """Generate continuations of a batch of prompts (lists of token ids) with an on-device loop.

        Sampling: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. Each sequence stops at
        EOS or a stop token (included in its output) or after max_new_tokens. `stream(new_tokens_per_prompt)`
        receives each chunk's tokens while the device already runs the next chunk; it may return the indices of
        prompts it wants stopped (a stop decided on the host, e.g. a stop string): they get no more tokens and
        finish with "stop". The batch is padded to a power of two (at most max_batch) with one-token rows that
        stop at once, so a handful of compiled programs serve every batch size.

        `speculative_tokens` k > 0: each step the MTP block drafts k tokens and the model verifies them in one
        chunk (dsv4_jax.speculative); greedy output is the same as without, sampled output has the same
        distribution. Needs a config with an MTP block and k spare positions (prompt + max_new_tokens + k <=
        max_seq_len); the result reports the acceptance.

        `stats`: every layer also measures its numbers on the device (ops/layer_stats.py); the result's `stats`
        (the generated tokens' steps) and `prompt_stats` (the prompt's prefill) are stats_report.StatsReport
        tables with anomalous layers flagged. They are read with the last chunk's tokens: no read more than
        without. Not with speculative_tokens.
        """
        self._stats_context(stats)                                     # (checks it)
        if stats and speculative_tokens:
            raise ValueError("stats=True needs speculative_tokens=0 (speculative steps have no layer statistics)")
        prompts = [list(p) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not _is_int(seed) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if not _is_int(chunk) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        if stop_tokens is not None and not all(_is_int(t) and 0 <= t < self.config.vocab_size for t in stop_tokens):
            raise ValueError(f"stop_tokens must be token ids in [0, {self.config.vocab_size}), got {stop_tokens!r:.80}")
        if not (np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (np.isfinite(top_p) and 0 < top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
        if not _is_int(top_k) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
        k = speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"speculative_tokens must be an integer >= 0, got {k!r}")
        if k and not self.config.n_mtp_layers:
            raise ValueError("speculative_tokens needs a model with an MTP block (its config has n_mtp_layers=0)")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens + k > self.max_seq_len:
            spare = f" plus {k} speculative positions" if k else ""
            raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens}{spare} exceeds "
                             f"max_seq_len={self.max_seq_len}")
        stops = [self.config.eos_token_id] + list(stop_tokens or [])
        batch = len(prompts)
        self._check_batch(batch)
        rows = batch_bucket(batch, self.max_batch)
        track = self.track_mtp or k > 0
        # padding rows: one token 0, done after one sample (a plain prefill where the prefix cache is off)
        logits, state, cached, *prompt_summary = self.prefill_prompts(prompts + [[0]] * (rows - batch),
                                                                      track_mtp=track, stats=stats)
        cached = cached[:batch]
        cache = self.prefix_cache if self.prefix_cache.enabled else None
        budget = np.ones((rows,), np.int32)
        budget[:batch] = max_new_tokens
        # row b samples with the key of `seed` folded with b (sampling.Sampling), as the server's choice b would
        sampling = Sampling.rows(rows, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=budget,
                                 stop_tokens=stops, seed=seed)
        gen, first = generation.start(state, logits, sampling)
        outputs: list[list[int]] = [[] for _ in prompts]
        finished = [False] * batch
        stopped_here: set[int] = set()                        # rows the caller stopped
        steps, accepted = 0, np.zeros((k,), np.int64)

        def drain(chunk_tokens):
            new = [[int(t) for t in row if t >= 0] if not finished[b] else []
                   for b, row in enumerate(chunk_tokens[:batch])]
            for b, toks in enumerate(new):
                outputs[b].extend(toks)
                finished[b] = finished[b] or any(t in stops for t in toks) or len(outputs[b]) >= max_new_tokens
            if stream is not None:
                for b in stream(new) or ():
                    finished[b] = True
                    stopped_here.add(b)

        # The host reads chunk k-1 while the device runs chunk k, so the device never waits for the host; the
        # stopping decision uses only tokens already read (a finished batch costs one empty chunk at most). Rows
        # the host finished (the caller's stops) are halted on the device at the next chunk.
        # Each chunk's outputs come back in one jax.device_get; with `stats` the chunks' statistics are summed up
        # on the device and read with the last chunk's tokens.
        pending = generation.ChunkOut(first[:, None], *(None,) * 5)
        fed = longest          # a bound on every sequence's position, known here without reading the device
        summary = stats_read = None
        while pending is not None:
            out = None
            if not all(finished):
                fed += chunk * (k + 1)
                halt = np.zeros((rows,), bool)
                halt[sorted(stopped_here)] = True
                gen, out = generation.generate_chunk(self.params, gen, jax.device_put(halt), cfg=self.config,
                                                     ctx=self._stats_context(stats, self.context_for(fed)),
                                                     max_seq_len=self.max_seq_len, chunk=chunk,
                                                     track_mtp=self.track_mtp, speculative_tokens=k)
                if stats:
                    summary = out.stats if summary is None else _merge_summaries(summary, out.stats)
            final = out is None
            host = jax.device_get((pending.tokens, pending.steps, pending.accepted,
                                   (prompt_summary[0], summary) if stats and final else None,
                                   gen.decode.positions if cache is not None and final else None))
            drain(host[0])
            if k and host[1] is not None:
                steps += int(host[1][:batch].sum())
                accepted += host[2][:batch].sum(axis=0)
            if stats and final:
                stats_read = host[3]
            if cache is not None and final:
                # a completion the device finished itself: its row consumed the prompt and all but the last token
                for b in range(batch):
                    consumed = int(host[4][b])
                    if b not in stopped_here and len(prompts[b]) < consumed <= len(prompts[b]) + len(outputs[b]):
                        cache.save((prompts[b] + outputs[b])[:consumed], gen.decode, b, track)
            pending = out
        reasons = ["stop" if (b in stopped_here or (o and o[-1] in stops)) else "length"
                   for b, o in enumerate(outputs)]
        result = GenerationResult(tokens=outputs, finish_reasons=reasons, cached_tokens=cached)
        if stats:
            result.prompt_stats = stats_report.report(stats_read[0], self.config)
            if stats_read[1] is not None:                     # (None: every row finished with its first token)
                result.stats = stats_report.report(stats_read[1], self.config)
        if k:
            result.acceptance = 1.0 + float(accepted.sum()) / max(steps, 1)
            result.acceptance_rates = [float(a) / max(steps, 1) for a in accepted]
        return result

    def complete(self, prompts, **options):
        """Strings in, strings out: `prompts` is a string, a list of chat messages, or a list of either (a batch);
        returns a dsv4_jax.text.Completion (text, token_ids, finish_reason, prompt_token_ids), or a list of them
        for a batch. Options: chat, system, thinking, reasoning_effort, stop (strings), stream(index, text),
        special_tokens, and the sampling options of `generate` with the command line's defaults
        (text.SAMPLING_DEFAULTS: temperature 0.6, top_p 0.95, max_new_tokens 100, top_k 0, seed 0)."""
        return complete(self, prompts, **options)
