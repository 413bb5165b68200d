"""The repeated layer pattern under `lax.scan`: one traced copy of the pattern instead of one per layer.

DeepSeek-V4's backbone repeats a short pattern of compression ratios after its hash-routed layers (Flash: layers
3..42 are (128, 4) twenty times; Pro: layers 3..60, the same pair twenty-nine times). Unrolled, a decode step holds one copy of the
layer code per layer, and its compile time grows with depth (70.9 s for 24 Flash layers on an H200, 2026-12-02).
Under `lax.scan` the program holds the pattern once and compiles in about the time of the layers outside it plus
one period.

Scanning needs the weights and caches of the repeated layers stacked along a leading axis, once, at model
construction (`stack_layers`; stacking inside the program would copy every weight on every call). A stacked
`params["layers"]` or `DecodeState.layers` is a `StackedLayers`: the layers before the pattern and after it as
lists, and per phase of the pattern one tree whose every leaf has a leading [repeats] axis.

What it costs at run time: the scan carries the stacked caches and writes each layer's caches back whole, so a
step moves each scanned layer's cache once more than the unrolled step does (negligible at 4K context, a
measurable fraction at long context and large batch), and a GPU while loop adds a small fixed cost per iteration.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """Layers start + j * period + p, for j < repeats and p < period, run as `repeats` scan iterations of the
    `period` layers of one pattern; layer start + p's compression ratio is phase p's."""
    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layer(self, repeat: int, phase: int) -> int:
        return self.start + repeat * self.period + phase


def scan_plan(cfg: ModelConfig) -> ScanPlan | None:
    """The longest run of backbone layers after the hash-routed ones that repeats a pattern of 1 or 2 layers at
    least twice (ties: the shorter period), or None when nothing repeats."""
    ratios = cfg.compress_ratios[:cfg.n_layers]
    best = None
    for start in range(cfg.n_hash_layers, cfg.n_layers):
        for period in (1, 2):
            repeats = 0
            while (start + (repeats + 1) * period <= cfg.n_layers and
                   all(ratios[start + repeats * period + p] == ratios[start + p] for p in range(period))):
                repeats += 1
            if repeats >= 2 and (best is None or period * repeats > best.period * best.repeats):
                best = ScanPlan(start, period, repeats)
    return best


@flax.struct.dataclass
class StackedLayers:
    """Per-layer trees (params or caches) with the scanned layers stacked: `before` (layers < plan.start),
    `phases` (per phase p, the trees of layers plan.layer(j, p) stacked over j), `after` (layers >= plan.stop)."""
    before: list
    phases: list
    after: list
    plan: ScanPlan = flax.struct.field(pytree_node=False)

    def __len__(self) -> int:
        return len(self.before) + self.plan.period * self.plan.repeats + len(self.after)


def is_scanned(params) -> bool:
    """Whether a parameter tree holds its layers stacked for the scan."""
    return isinstance(params["layers"], StackedLayers)


def _stacked_sharding(leaf):
    """The sharding of a stack of arrays laid out like `leaf`: its own, the new leading axis not split."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return None


def stack_layers(layers: list, plan: ScanPlan, consume: bool = False) -> StackedLayers:
    """Stack per-layer trees for `plan`. Stacking goes leaf by leaf; with `consume` each leaf's per-layer arrays
    are deleted once stacked, so peak memory stays one weight's worth above the model's (the caller must hold
    no other use of them)."""
    if not isinstance(layers, list):
        raise TypeError(f"stack_layers takes a list of per-layer trees, got {type(layers).__name__}")
    phases = []
    for phase in range(plan.period):
        group = [layers[plan.layer(j, phase)] for j in range(plan.repeats)]
        structure = jax.tree.structure(group[0])
        columns = zip(*(jax.tree.leaves(tree) for tree in group))
        stacked = []
        for column in columns:
            sharding = _stacked_sharding(column[0])
            array = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*column)
            if consume:
                # Wait for the stack before deleting its inputs: deleted buffers are freed only once the program
                # reading them is done, and without the wait the loop queues every leaf's stack at once (a
                # 24-layer Flash model ran out of an H200's memory that way).
                array.block_until_ready()
                for x in column:
                    if isinstance(x, jax.Array):
                        x.delete()
            stacked.append(array)
        phases.append(jax.tree.unflatten(structure, stacked))
    return StackedLayers(before=list(layers[:plan.start]), phases=phases, after=list(layers[plan.stop:]),
                         plan=plan)


def unstack_layers(layers: StackedLayers) -> list:
    """The per-layer list back (each scanned layer's leaves sliced out: copies)."""
    plan = layers.plan
    out = list(layers.before)
    for j in range(plan.repeats):
        out += [jax.tree.map(lambda a, j=j: a[j], layers.phases[p]) for p in range(plan.period)]
    return out + list(layers.after)


def map_layer_trees(fn, layers):
    """`fn` applied to each per-layer tree of a list, or to each tree (per-layer or stacked) of a StackedLayers."""
    if isinstance(layers, StackedLayers):
        return layers.replace(before=[fn(t) for t in layers.before], phases=[fn(t) for t in layers.phases],
                              after=[fn(t) for t in layers.after])
    return [fn(t) for t in layers]
