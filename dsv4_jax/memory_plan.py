"""What a model needs per device before any of it is allocated: weights, decode state, and the temporaries of its
compiled programs.

    plan = dsv4_jax.memory_plan(dsv4_jax.presets.flash(), n_devices=2, max_seq_len=65536)
    print(plan.table())

Weights and decode state are counted from the weight description and jax.eval_shape (nothing allocated), per
device under sharding.rules (the routed experts split over the devices, from 4 devices the attention heads and
the shared expert too, the rest replicated). With `compiled=True`
the prefill chunk and the decode step are also compiled for the mesh's devices from abstract arguments, and
their temporary bytes read from XLA's memory analysis (on the CPU backend that is the CPU program's figure).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .config import ModelConfig
from . import engine
from .engine import PREFILL_CHUNK
from .params import init_params, tree_get, weight_specs
from .run_context import DTYPES, RunContext
from .sharding import EXPERT, param_shardings, partition_spec, rules, state_shardings
from .state import init_state, state_bytes

GB = 1e9


@dataclasses.dataclass
class MemoryPlan:
    n_devices: int
    weights: int                   # bytes per device
    decode_state: int              # bytes per device (max_batch x max_seq_len)
    prefill_temp: int | None       # compiled temporaries of one prefill chunk, per device (compiled=True)
    decode_temp: int | None        # compiled temporaries of one decode step, per device (compiled=True)
    device_memory: int | None      # bytes a device has, when known
    prefix_cache: int = 0          # bytes of the prefix cache's snapshot pool (whole rows of its size)

    @property
    def total(self) -> int:
        return (self.weights + self.decode_state + self.prefix_cache
                + max(self.prefill_temp or 0, self.decode_temp or 0))

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    def table(self) -> str:
        def gb(v):
            if v is None:
                return "-"
            return f"{v / GB:.2f} GB" if v >= GB else f"{v / 1e6:.2f} MB"
        rows = [("weights", self.weights), ("decode state", self.decode_state), ("prefix cache", self.prefix_cache),
                ("prefill chunk temporaries", self.prefill_temp), ("decode step temporaries", self.decode_temp),
                ("total", self.total), ("device memory", self.device_memory)]
        lines = [f"per device, {self.n_devices} device(s):"] + [f"  {name:<27} {gb(v):>12}" for name, v in rows]
        if self.fits is not None:
            lines.append("  fits" if self.fits else f"  does NOT fit: {(self.total - self.device_memory) / GB:.2f} GB "
                                                    f"over")
        return "\n".join(lines)


def weight_bytes_per_device(cfg: ModelConfig, n_devices: int, stored=None) -> dict[str, int]:
    """Bytes one of `n_devices` devices along "expert" holds of each weight (official name -> bytes, every stored
    array of the weight counted) under sharding.rules."""
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), stored))
    axis_rules = rules(cfg, n_devices)
    held = {}
    for spec in weight_specs(cfg, stored):
        held[spec.name] = 0
        for leaf in jax.tree.leaves(tree_get(abstract, spec.name)):
            split = n_devices if EXPERT in tuple(partition_spec(spec.axes, leaf.ndim, axis_rules)) else 1
            held[spec.name] += math.prod(leaf.shape) * leaf.dtype.itemsize // split
    return held


def memory_plan(config: ModelConfig, mesh=None, n_devices: int | None = None, max_seq_len: int = 4096,
                max_batch: int = 1, prefill_chunk: int = PREFILL_CHUNK, dtype: str = "bfloat16",
                stored: dict[str, str] | None = None, compiled: bool = False,
                device_memory: int | None = None, kv_cache_dtype: str | None = None,
                prefix_cache: int = 0, kernel_overrides=None) -> MemoryPlan:
    """Per-device bytes on `mesh` (sharding.make_mesh), or on `n_devices` devices of that layout without a mesh
    (weights and state only: nothing to compile for). `device_memory`: a device's bytes (default: the mesh's first
    device's limit where JAX reports it). `kv_cache_dtype`: as Model takes it ("fp8": compact decode state).
    `prefix_cache`: the prefix cache's limit in bytes (its pool holds as many whole one-sequence rows as fit).
    `kernel_overrides`: the compiled programs' kernel plan overrides (RunContext.create), e.g. an opt-in kernel."""
    if mesh is not None:
        n_devices = mesh.devices.size
    n_devices = 1 if n_devices is None else n_devices
    if config.n_routed_experts % n_devices:
        raise ValueError(f"{config.n_routed_experts} routed experts do not split over {n_devices} devices")
    state = state_bytes(config, max_batch, max_seq_len, dtype, kv_cache_dtype)
    row = state_bytes(config, 1, max_seq_len, dtype, kv_cache_dtype)
    pool = prefix_cache // row * row
    prefill_temp = decode_temp = None
    if compiled:
        if mesh is None and n_devices > 1:
            raise ValueError("compiled=True needs the mesh of the devices to compile for")
        prefill_temp, decode_temp = _compiled_temporaries(config, mesh, max_seq_len, max_batch, prefill_chunk,
                                                          dtype, stored, kv_cache_dtype, kernel_overrides)
    if device_memory is None and (mesh is not None or compiled):
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        device_memory = (device.memory_stats() or {}).get("bytes_limit")
    return MemoryPlan(n_devices, sum(weight_bytes_per_device(config, n_devices, stored).values()), state,
                      prefill_temp, decode_temp, device_memory, pool)


def _compiled_temporaries(cfg, mesh, max_seq_len, max_batch, prefill_chunk, dtype, stored, kv_cache_dtype=None,
                          kernel_overrides=None):

    ctx = RunContext.create(dtype=dtype, mesh=mesh, kernel_overrides=kernel_overrides)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), stored))
    state = jax.eval_shape(lambda: init_state(cfg, max_batch, max_seq_len, DTYPES[dtype],
                                              kv_cache_dtype=kv_cache_dtype))
    if mesh is not None:
        with_sharding = lambda tree, sh: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
        params = with_sharding(params, param_shardings(cfg, mesh, params))
        state = with_sharding(state, state_shardings(state, mesh))
    tokens = jax.ShapeDtypeStruct((max_batch, prefill_chunk), jnp.int32)
    n_valid = jax.ShapeDtypeStruct((max_batch,), jnp.int32)
    logits = jax.ShapeDtypeStruct((max_batch, cfg.vocab_size), jnp.float32)
    prefill = engine.prefill_chunk.trace(params, state, tokens, n_valid, logits, cfg=cfg, ctx=ctx).lower().compile()
    step = engine.decode_step.trace(params, state, n_valid, cfg=cfg, ctx=ctx, max_seq_len=max_seq_len).lower().compile()
    return (prefill.memory_analysis().temp_size_in_bytes, step.memory_analysis().temp_size_in_bytes)
