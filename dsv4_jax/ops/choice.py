"""The one choice of how each op runs: its kernel or its pure-jnp reference, decided from the run context.

Every fused op of the model (ops/*.py) declares its kernels as `Kernel` values: the op it belongs to, the phases it
serves and whether GPU plans take it unless told otherwise. At a call the op asks `takes_kernel(kernel, ctx, fits)`
with `fits` its own word on the call's geometry and dtypes (what the kernel accepts), and this function decides:

    1. the plan's backend: None (the reference plan) -> the reference;
    2. the plan's override for the op (KernelPlan.overrides): "reference" -> the reference, "kernel" -> the kernel
       wherever the phase and the geometry allow it (an opt-in kernel switched on);
    3. the phase the engine program declared (RunContext.phase) must be one the kernel serves;
    4. the geometry must fit;
    5. then the "interpret" plan takes every kernel (tests), GPU plans the kernels they take by default.

Phases (declared by the engine program that runs, never inferred from a row count):
    prefill  prompt chunks and teacher-forced forward passes
    decode   one token per sequence (decode steps, generation loops, MTP drafts)
    verify   a few tokens per sequence: a speculative verify chunk and its commit
    train    a training forward pass (run_context.Training): no kernel has derivatives, so none serves it

Every choice is recorded while `record_dispatch()` is open (a trace: nothing runs), so which kernel each op of a
program took can be listed for any device the plan names (dispatch_census.py, `generate --verbose`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

PHASES = ("prefill", "decode", "verify", "train")
STEP_PHASES = frozenset({"decode", "verify"})          # the few-tokens-per-row phases the fused step kernels serve
ALL_PHASES = frozenset(PHASES)

# The ops that choose, and what an override may say of each.
OPS = ("matmul", "act_quantize", "mhc_site", "norm_rope", "attention_core", "indexer_scores", "indexer_top_k",
       "compressor_step", "moe_ffn", "head")
OVERRIDES = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel of `op`: `name` (as recorded), the phases it serves, and whether GPU plans take it without an
    override ("kernel" in the plan's overrides switches an opt-in one on)."""
    op: str
    name: str
    phases: frozenset = STEP_PHASES
    on_gpu_by_default: bool = True

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r} (ops: {OPS})")
        if not self.phases <= ALL_PHASES:
            raise ValueError(f"unknown phases {sorted(self.phases - ALL_PHASES)} (phases: {PHASES})")


class Choice(NamedTuple):
    """One recorded choice: for matmuls `call` ("linear", "group_linear", ...), the weight's format and shape;
    `path` "reference" or the plan's backend ("cuda", "pallas", "interpret"), `kernel` the kernel's name (None on
    the reference), `op` and `phase` as chosen."""
    call: str
    weight: str
    shape: tuple
    path: str
    kernel: str | None
    op: str
    phase: str


_records: list | None = None


@contextlib.contextmanager
def record_dispatch(op: str | None = None):
    """Collect a Choice for every choice made while tracing inside the block (only `op`'s, if given)."""
    global _records
    previous, _records = _records, []
    collected = []
    try:
        yield collected
    finally:
        collected.extend(c for c in _records if op is None or c.op == op)
        _records = previous


def record(op: str, phase: str, path: str, kernel: str | None, call: str | None = None, weight=None) -> None:
    """Record a choice (the matmul dispatch records its own, with the weight)."""
    if _records is not None:
        fmt, shape = ("", ()) if weight is None else (type(weight).__name__, tuple(weight.shape))
        _records.append(Choice(call or op, fmt, shape, path, kernel if path != "reference" else None, op, phase))


def takes_kernel(kernel: Kernel, ctx, fits: bool = True) -> bool:
    """Whether this call of kernel.op runs on `kernel` under the run context `ctx` (module docstring), recorded."""
    plan = ctx.kernels
    override = plan.override(kernel.op)
    if plan.backend is None or override == "reference" or ctx.phase not in kernel.phases or not fits:
        take = False
    else:
        take = override == "kernel" or plan.interpret or kernel.on_gpu_by_default
    record(kernel.op, ctx.phase, plan.backend if take else "reference", kernel.name)
    return take
