"""Which path every quantized matmul of a decode or verify step takes (a kernel, or the reference's
dequantize-then-dot), read off a trace: nothing is compiled, allocated or run, so it works for any device the kernel
plan names (a compile-only H200 on a CPU machine included).

    step_dispatch(cfg, ctx, batch=32)                    # the decode step of 32 sequences
    step_dispatch(cfg, ctx, batch=64, tokens_per_row=4)  # a verify step: 64 sequences x (1 + 3 drafts)

Returns {"path:kernel" or "reference": count} of the matmuls' choices (ops.choice.record_dispatch); with op=None,
{"op:path:kernel" or "op:reference": count} of every op's.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

from . import engine
from .config import ModelConfig
from .params import init_params
from .ops import choice
from .run_context import RunContext
from .state import init_state


@functools.partial(jax.jit, static_argnames=("cfg", "ctx"))
def _verify_read(params, state, chunk, n_read, *, cfg, ctx):
    """The model part of a speculative verify step (speculative.speculative_step): every row reads its chunk."""
    return engine.read_chunk(params, cfg, ctx, state, chunk, n_read)[0]


def step_dispatch(cfg: ModelConfig, ctx: RunContext, batch: int, tokens_per_row: int = 1,
                  max_seq_len: int = 4096, op: str | None = "matmul") -> dict[str, int]:
    """Counts of the dispatch choices of one decode step (tokens_per_row == 1) or verify read (more tokens per row)
    of `batch` sequences, traced from abstract parameters and state."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda: init_state(cfg, batch, max_seq_len, jnp.bfloat16))
    jax.clear_caches()          # a program traced before would come from the cache and record nothing
    with choice.record_dispatch(op) as records:
        if tokens_per_row == 1:
            engine.decode_step.trace(params, state, jax.ShapeDtypeStruct((batch,), jnp.int32), cfg=cfg, ctx=ctx,
                                     max_seq_len=max_seq_len)
        else:
            _verify_read.trace(params, state, jax.ShapeDtypeStruct((batch, tokens_per_row), jnp.int32),
                               jax.ShapeDtypeStruct((batch,), jnp.int32), cfg=cfg, ctx=ctx)
    prefix = (lambda c: "") if op else (lambda c: f"{c.op}:")  # noqa: E731
    counts = collections.Counter(prefix(c) + (f"{c.path}:{c.kernel}" if c.kernel else c.path) for c in records)
    return dict(sorted(counts.items()))
