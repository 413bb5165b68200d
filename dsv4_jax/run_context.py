"""The run context: how a compiled program runs, as one static value that every model function takes (`ctx`).

    ctx = RunContext.create(dtype="float32", act_quant="fp8", kernels="auto")   # resolves the kernel plan now
    logits = engine.forward(params, tokens, cfg=cfg, ctx=ctx)

It holds the numerics (activation dtype, the trained fake-quant roundings, the `act_quant` mode of ops/matmul.py;
docs/architecture.md "Run context and kernel plan"), the kernel plan resolved for a device (ops/plan.py),
the device mesh the program runs on (sharding.py; None: one device) and, for training, `Training`. Every layer and
every matmul takes it as a required argument, so no call can fall back to a default mode, and a new option is a new
field here, not a new parameter of every function. It is frozen and hashable: a static argument of jit, one
compiled program per distinct context.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from .ops.choice import PHASES
from .ops.matmul import ACT_QUANT_MODES
from .ops.plan import KernelPlan, plan_kernels

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def check_numerics(dtype: str, act_quant: str) -> None:
    """A one-line error unless `dtype` and `act_quant` name modes the model has (RunContext and settings.Settings
    ask it)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")


@dataclasses.dataclass(frozen=True)
class Training:
    """What a training forward pass needs from the model (scripts/train_tiny.py uses it):

    straight_through  the fake-quant roundings (FP8 KV, Hadamard + FP4 indexer q / keys) pass gradients through
                      unchanged (straight-through estimator): the derivative of a cast to float8 / float4 is zero,
                      so otherwise no gradient reaches the KV projections.
    moe_capacity      > 0: the routed experts as one batched matmul over per-expert slots of capacity
                      ceil(factor * tokens * top_k / experts), assignments past it dropped (GShard); on the CPU,
                      ragged_dot runs every expert over every row, so this is what makes training affordable there.

    Under training every layer also returns its statistics (model.block): `expert_load` [E] (how many of the
    chunk's assignments each expert got, score-routed layers) and `indexer_kl` (CSA layers: the KL divergence from
    the main attention's distribution over the compressed entries to the indexer's, on detached inputs, so that it
    trains only the indexer; layers/indexer_loss.py)."""
    straight_through: bool = True
    moe_capacity: float = 0.0

    def __post_init__(self):
        if self.moe_capacity < 0:
            raise ValueError(f"moe_capacity must be >= 0, got {self.moe_capacity}")


@dataclasses.dataclass(frozen=True)
class RunContext:
    """dtype: activations ("bfloat16" | "float32"); simulate_quant: the model's trained fake-quant roundings;
    act_quant: activation quantization into quantized weights ("none" | "fp8" | "nvfp4", ops/matmul.py);
    kernels: the resolved KernelPlan; training: None for inference; mesh: a (data, expert) jax.sharding.Mesh
    (sharding.make_mesh) whose "expert" axis splits the routed experts, or None for one device;
    context_limit: a bound the host knows on the positions of a call (every token at a position below it), so
    attention reads only the compressed entries and indexer keys those positions can see instead of the whole
    max_seq_len buffers (None: the whole buffers). Model picks it from length buckets (api.context_bucket);
    phase: what the program runs, "prefill", "decode", "verify" or "train" (ops/choice.py): declared by each engine
    program (`in_phase`), never inferred from a shape; a context with `training` is in "train";
    stats: every layer also measures its numbers on the device (layer_stats.py) and the engine programs return
    them beside their outputs (off: nothing of it is traced, the same program as without the feature)."""
    dtype: str
    simulate_quant: bool
    act_quant: str
    kernels: KernelPlan
    training: Training | None = None
    mesh: Mesh | None = None
    context_limit: int | None = None
    phase: str = "prefill"
    stats: bool = False

    def __post_init__(self):
        check_numerics(self.dtype, self.act_quant)
        if not isinstance(self.kernels, KernelPlan):
            raise TypeError(f"RunContext.kernels must be a KernelPlan, got {self.kernels!r} (RunContext.create "
                            f"resolves a mode)")
        if self.context_limit is not None and (not isinstance(self.context_limit, int) or self.context_limit < 1):
            raise ValueError(f"context_limit must be a positive integer or None, got {self.context_limit!r}")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"RunContext.mesh must be a jax.sharding.Mesh or None, got {self.mesh!r}")
        if self.training is not None and not isinstance(self.training, Training):
            raise TypeError(f"RunContext.training must be a Training or None, got {self.training!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if not isinstance(self.stats, bool):
            raise ValueError(f"stats must be True or False, got {self.stats!r}")
        if (self.phase == "train") != (self.training is not None):
            raise ValueError(f"phase {self.phase!r} with training={self.training!r}: a context is in 'train' "
                             f"exactly when it has a Training")

    @classmethod
    def create(cls, dtype: str = "bfloat16", simulate_quant: bool = True, act_quant: str = "none",
               kernels: str | KernelPlan = "auto", training: Training | None = None, device=None,
               mesh: Mesh | None = None, kernel_overrides=None) -> RunContext:
        """A context with its kernel plan resolved now for `device` (default: the mesh's first device, else JAX's
        default device; a jax.sharding.AbstractDevice to compile for one that is not attached), unless `kernels`
        is a plan already; `kernel_overrides` (ops/plan.py parse_overrides: {"attention_core": "kernel"}, or
        "op=choice" strings) replace the plan's. In "train" with `training`, else in "prefill" until an engine
        program declares its phase."""
        if device is None and mesh is not None:
            device = mesh.devices.flat[0]
        plan = kernels if isinstance(kernels, KernelPlan) else plan_kernels(kernels, device)
        if kernel_overrides is not None:
            plan = plan.with_overrides(kernel_overrides)
        return cls(dtype, simulate_quant, act_quant, plan, training, mesh,
                   phase="train" if training is not None else "prefill")

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def in_phase(self, phase: str) -> RunContext:
        """This context for an engine program that runs `phase`; a training context stays in "train"."""
        return self if self.training is not None or self.phase == phase else self.replace(phase=phase)

    def replace(self, **changes) -> RunContext:
        if "training" in changes and "phase" not in changes:       # a Training puts the context in "train"
            changes["phase"] = "train" if changes["training"] is not None else "prefill"
        return dataclasses.replace(self, **changes)

    def without_act_quant(self) -> RunContext:
        """This context for a matmul whose input is never quantized (the grouped output projection wo_a, the head)."""
        return self if self.act_quant == "none" else self.replace(act_quant="none")
