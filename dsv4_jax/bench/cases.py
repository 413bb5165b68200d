"""The timed cases of the model benchmark: decode steps inside the jitted generation loop, and prefills.

Decode: `generate_chunk` (the on-device loop `Model.generate` runs) is compiled once per (batch, context, kernels)
and called several times; each call runs `steps` decode steps, and a step's time is the median call time divided
by `steps`. The state is built directly at the context under test (caches filled with random values, every
sequence `context - steps * calls` tokens in, so the last step reads `context` tokens): decoding at 64K context
does not need a 64K-token prefill first, and the work of a step does not depend on the cached values. Sampling
is greedy unless the caller passes sampling parameters (`sampling`: temperature, top_k, top_p for every row), and no
stop token can end a sequence early (every call is checked to have produced `steps` tokens per sequence).

Prefill: `Model.prefill` of a random prompt (chunked as users run it) followed by sampling the first token: the time
to first token once compiled; tokens/s is prompt length / that time.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import engine, generation
from ..api import Model
from ..config import ModelConfig
from ..engine import GenerationState
from ..generation import generate_chunk
from ..layer_scan import is_scanned, map_layer_trees
from ..run_context import RunContext
from ..sampling import Sampling
from ..settings import Settings
from ..sharding import state_shardings
from ..state import DecodeState, init_state

CACHE_BUFFERS = ("window_kv", "compressed_kv", "index_keys")


def synthetic_state(cfg: ModelConfig, batch: int, max_seq_len: int, position: int, dtype, mesh=None,
                    seed: int = 0, scan_layers: bool = False, kv_cache_dtype=None) -> DecodeState:
    """A decode state of `batch` sequences each `position` tokens in, its caches random (made on the device);
    with `scan_layers`, laid out for a scanned model; entries stored as `kv_cache_dtype` says (numerics/kv_cache.py)."""
    def make(key):
        state = init_state(cfg, batch, max_seq_len, dtype, scan_layers, kv_cache_dtype)
        keys = iter(jax.random.split(key, 4 * (cfg.n_layers + cfg.n_mtp_layers) + 1))

        def fill(cache):
            filled = {}
            for name in CACHE_BUFFERS:
                stored = getattr(cache, name)
                if stored is not None:
                    entries = jax.eval_shape(lambda stored: stored.decode(dtype), stored)
                    filled[name] = stored.encode(jax.random.normal(next(keys), entries.shape, jnp.float32))
            return cache.replace(**filled)
        return state.replace(layers=map_layer_trees(fill, state.layers), mtp=[fill(c) for c in state.mtp],
                             mtp_hidden=jax.random.normal(next(keys), state.mtp_hidden.shape).astype(dtype),
                             positions=jnp.full((batch,), position, jnp.int32))
    shardings = None
    if mesh is not None:
        shardings = state_shardings(jax.eval_shape(make, jax.random.PRNGKey(seed)), mesh)
    return jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed))


def _generation(state: DecodeState, cfg: ModelConfig, batch: int, sampling: dict | None = None) -> GenerationState:
    """Rows at random tokens, greedy or with `sampling`'s temperature / top_k / top_p, no length limit within the
    benchmark and no stop token."""
    tokens = jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, cfg.vocab_size, jnp.int32)
    sampling = Sampling.rows(batch, max_new_tokens=2 ** 30, seed=3, **(sampling or {}))
    return GenerationState(state, tokens, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), sampling)


def _timed_chunks(params, gen: GenerationState, calls: int, **static):
    """(compile seconds, seconds per call, the tokens of each call) of `calls` + 1 calls of one compiled chunk."""
    halt = jnp.zeros(gen.done.shape, bool)
    t0 = time.perf_counter()
    program = generate_chunk.lower(params, gen, halt, **static).compile()
    compile_s = time.perf_counter() - t0
    times, produced = [], []
    for _ in range(calls + 1):
        t0 = time.perf_counter()
        gen, out = program(params, gen, halt)
        out.tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
        produced.append(out.tokens)
    return compile_s, times, produced


def time_decode(params, cfg: ModelConfig, ctx: RunContext, batch: int, context: int, steps: int, calls: int,
                mesh=None, kv_cache_dtype=None, sampling: dict | None = None) -> dict:
    """ms per decode step at (batch, context) from `calls` timed calls of `steps` steps each (after one warm-up
    call), and the compile time of that generation chunk."""
    start = context - steps * (calls + 1)
    if start < 0:
        raise ValueError(f"context {context} is shorter than the {steps * (calls + 1)} steps the case runs "
                         f"(steps x (calls + 1))")
    state = synthetic_state(cfg, batch, context, start, ctx.jnp_dtype, mesh, scan_layers=is_scanned(params),
                            kv_cache_dtype=kv_cache_dtype)
    compile_s, times, produced = _timed_chunks(params, _generation(state, cfg, batch, sampling), calls, cfg=cfg,
                                               ctx=ctx, max_seq_len=context, chunk=steps)
    produced = np.asarray(jax.device_get(jnp.stack(produced)))
    if (produced < 0).any():
        raise RuntimeError(f"batch {batch}, context {context}: a generation chunk stopped early; the steps were not "
                           f"all timed")
    return {"batch": batch, "context": context, "steps_per_call": steps,
            "calls": calls, "ms_per_step": 1e3 * statistics.median(times[1:]) / steps,
            "first_call_ms": 1e3 * times[0], "generate_chunk_compile_s": compile_s}


def time_speculative(params, cfg: ModelConfig, ctx: RunContext, batch: int, context: int, k: int, steps: int,
                     calls: int, mesh=None, kv_cache_dtype=None, sampling: dict | None = None) -> dict:
    """ms per speculative step (k MTP drafts, a (k+1)-token verify, the commit) at (batch, context), timed as
    time_decode times plain steps, and the tokens each step emitted (random weights accept few drafts)."""
    start = context - steps * (k + 1) * (calls + 1) - k
    if start < 0:
        raise ValueError(f"context {context} is shorter than the {steps * (k + 1) * (calls + 1) + k} positions the "
                         f"speculative case may use")
    state = synthetic_state(cfg, batch, context, start, ctx.jnp_dtype, mesh, scan_layers=is_scanned(params),
                            kv_cache_dtype=kv_cache_dtype)
    compile_s, times, produced = _timed_chunks(params, _generation(state, cfg, batch, sampling), calls, cfg=cfg,
                                               ctx=ctx, max_seq_len=context, chunk=steps, speculative_tokens=k)
    emitted = (np.asarray(jax.device_get(jnp.stack(produced))) >= 0).sum(axis=-1)        # [calls + 1, batch]
    if (emitted < steps).any():
        raise RuntimeError(f"batch {batch}, context {context}, k {k}: a speculative chunk stopped early")
    return {"batch": batch, "context": context, "k": k, "steps_per_call": steps, "calls": calls,
            "ms_per_step": 1e3 * statistics.median(times[1:]) / steps, "tokens_per_step": float(emitted.mean()) / steps,
            "generate_chunk_compile_s": compile_s}


def decode_step_compile_seconds(params, cfg: ModelConfig, ctx: RunContext, batch: int, context: int,
                                mesh=None, kv_cache_dtype=None) -> tuple[float, object, DecodeState]:
    """Seconds to trace, lower and compile one decode step; also returns the compiled step and a state for it."""
    state = synthetic_state(cfg, batch, context, max(context - 8, 0), ctx.jnp_dtype, mesh,
                            scan_layers=is_scanned(params), kv_cache_dtype=kv_cache_dtype)
    tokens = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    program = engine.decode_step.lower(params, state, tokens, cfg=cfg, ctx=ctx, max_seq_len=context).compile()
    return time.perf_counter() - t0, program, state


def prefill_chunk_program(params, cfg: ModelConfig, ctx: RunContext, chunk: int, chunks: int, mesh=None,
                          kv_cache_dtype=None) -> tuple[object, DecodeState, tuple]:
    """The compiled prefill chunk of one sequence (`chunk` tokens, all valid), an empty state with room for `chunks`
    + 1 calls of it (at least 4,096 tokens: the smallest context bucket `Model.prefill` compiles for), and its other
    inputs (tokens, n_valid, last logits): what `Model.prefill` runs per chunk of a prompt's start."""
    max_seq_len = max(4096, chunk * (chunks + 1))

    def make():
        return init_state(cfg, 1, max_seq_len, ctx.jnp_dtype, is_scanned(params), kv_cache_dtype)
    shardings = None if mesh is None else state_shardings(jax.eval_shape(make), mesh)
    state = jax.jit(make, out_shardings=shardings)()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, chunk), dtype=np.int32))
    inputs = (tokens, jnp.full((1,), chunk, jnp.int32), jnp.zeros((1, cfg.vocab_size), jnp.float32))
    program = engine.prefill_chunk.lower(params, state, *inputs, cfg=cfg, ctx=ctx).compile()
    return program, state, inputs


def time_prefill(params, cfg: ModelConfig, settings: Settings, prompt_tokens: int, chunk: int, calls: int,
                 mesh=None, kv_cache_dtype=None) -> dict:
    """Time to first token of a `prompt_tokens`-token prompt at batch 1 (median of `calls` after a warm-up call,
    which compiles; its time is reported as the cold figure), on a Model of `settings` (numerics and kernels)."""
    model = Model(cfg, params, settings, max_seq_len=prompt_tokens + 1, max_batch=1, prefill_chunk=chunk,
                  mesh=mesh, kv_cache_dtype=kv_cache_dtype, scan_layers=False)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_tokens), dtype=np.int32)
    sampling = Sampling.rows(1, max_new_tokens=2 ** 30)
    times = []
    for _ in range(calls + 1):
        t0 = time.perf_counter()
        logits, state = model.prefill(prompt)
        gen, first = generation.start(state, logits, sampling)
        first.block_until_ready()
        times.append(time.perf_counter() - t0)
        del gen, state
    ttft = statistics.median(times[1:])
    return {"prompt_tokens": prompt_tokens, "prefill_chunk": chunk,
            "calls": calls, "ttft_ms": 1e3 * ttft, "tokens_per_s": prompt_tokens / ttft,
            "cold_ttft_s": times[0]}
