"""DeepSeek-V4 as a Flax NNX module: `DeepseekV4` holds every weight in its stored format, under the official
checkpoint names, built from the one weight description (params.weight_specs).

    module = dsv4_jax.DeepseekV4(dsv4_jax.presets.tiny(), rngs=nnx.Rngs(0))     # random, stored formats
    module.layers[3].attn.wq_a.weight, module.layers[3].attn.wq_a.scale          # = layers.3.attn.wq_a.weight / .scale
    logits = module(tokens)                                                      # teacher-forced forward
    graphdef, state = nnx.split(module)                                          # state -> engine_params(cfg, state)

A weight of the description becomes the module at its name (without the trailing `.weight`) with one variable per
stored array, named as the checkpoint names them: `weight` and `scale` for FP8 (e4m3 + E8M0 128x128 blocks);
`weight` (packed e2m1 pairs) and `scale` for an MXFP4 expert stack; `weight`, `weight_scale`, `weight_scale_2` and,
when the checkpoint has it, `input_scale` for NVFP4. Routed experts are one stack per projection
(`layers.L.ffn.experts.w1`, the experts' tensors `layers.L.ffn.experts.E.w1.*` stacked on the first axis). Every
variable carries its logical axes (`out_sharding`, from the description; not applied eagerly) for
`nnx.get_partition_spec`.

The compute stays in the pure jitted programs of `engine.py`: `engine_params` lays the module's arrays (the same
arrays, no copies) out as the parameter tree those programs take.
"""

from __future__ import annotations

import jax
from flax import nnx

from . import engine
from .config import ModelConfig
from .run_context import RunContext
from .params import FP4_FORMATS, WeightSpec, init_params, is_expert_stack, tree_get, tree_set, weight_specs
from .numerics.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight


class Weights(nnx.Module):
    """A group of weights named as in the checkpoint; attributes are sub-groups, lists of them or variables."""


class Block(Weights):
    """One transformer block: attention and MoE, each behind its hyper-connection site (hc_attn_*, hc_ffn_*)."""


class MTPBlock(Block):
    """The multi-token-prediction block: a block plus its embedding / hidden projections, norms and hc head."""


class Attention(Weights):
    """Hybrid attention: low-rank query, the shared KV head, the sink, the grouped output projection."""


class Compressor(Weights):
    """A KV compressor (main or the indexer's)."""


class Indexer(Weights):
    """The Lightning indexer of a CSA layer."""


class MoE(Weights):
    """Router (gate), shared expert and routed experts."""


class Router(Weights):
    """The sqrt-softplus router: its gate, and the selection bias or the hash table."""


class SharedExpert(Weights):
    """The shared expert's clamped SwiGLU."""


class RoutedExperts(Weights):
    """The routed experts, one stack [E, out, in] per projection."""


_GROUPS = {"attn": Attention, "compressor": Compressor, "indexer": Indexer, "ffn": MoE, "gate": Router,
           "shared_experts": SharedExpert, "experts": RoutedExperts}


def stored_arrays(spec: WeightSpec, value) -> dict[str, tuple[jax.Array, tuple]]:
    """The checkpoint-named arrays of one weight of the parameter tree, each with its logical axes."""
    if isinstance(value, Fp8BlockWeight):
        return {"weight": (value.weight, spec.axes), "scale": (value.scale, spec.axes)}
    if isinstance(value, Mxfp4Weight):
        return {"weight": (value.packed, spec.axes), "scale": (value.scale, spec.axes)}
    if isinstance(value, Nvfp4Weight):
        lead = spec.axes[:-2]               # the per-matrix scalars of a stack: one per expert
        arrays = {"weight": (value.packed, spec.axes), "weight_scale": (value.scale, spec.axes),
                  "weight_scale_2": (value.global_scale, lead)}
        if value.input_scale is not None:
            arrays["input_scale"] = (value.input_scale, lead)
        return arrays
    return {spec.name.rsplit(".", 1)[-1]: (value, spec.axes)}


def _engine_value(spec: WeightSpec, node: dict) -> object:
    """The parameter-tree value of one weight from the arrays of its module (for a plain array: of the module
    above it). Expert stacks and the head are NVFP4 when their module holds NVIDIA's `weight_scale`."""
    if spec.fmt == "fp8":
        return Fp8BlockWeight(node["weight"], node["scale"])
    if (is_expert_stack(spec) or spec.name == "head.weight") and "weight_scale" in node:
        return Nvfp4Weight(node["weight"], node["weight_scale"], node["weight_scale_2"], node.get("input_scale"))
    if is_expert_stack(spec):
        return Mxfp4Weight(node["weight"], node["scale"])
    return node[spec.name.rsplit(".", 1)[-1]]


def _module_path(spec: WeightSpec) -> str:
    """Where a weight's variables live: quantized weights get a module of their own at their name (less the
    trailing 'weight'); a plain array is a variable of the module above it."""
    if spec.fmt == "fp8" or spec.fmt in FP4_FORMATS:
        return spec.name.rsplit(".", 1)[0]
    if spec.name == "head.weight":           # bf16 or NVFP4: its own module either way
        return "head"
    return spec.name.rsplit(".", 1)[0] if "." in spec.name else ""


def engine_params(cfg: ModelConfig, state) -> dict:
    """The parameter tree the engine's programs take (params.init_params' layout) from a module's state
    (`nnx.split(module)[1]`, `nnx.state(module)`) or its pure dict: the same arrays, regrouped. Traceable, so a
    jitted function of the state regroups at trace time only."""
    pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    tree: dict = {}
    for spec in weight_specs(cfg):
        path = _module_path(spec)
        node = tree_get(pure, path) if path else pure
        tree_set(tree, spec.name, _engine_value(spec, node))
    return tree


def stored_formats_of(module) -> dict[str, str]:
    """The stored formats of a module's weights that differ from the description's defaults (params.weight_specs'
    `stored`): NVFP4 expert stacks ('+input_scale' when they carry it) and an NVFP4 head."""
    pure = nnx.to_pure_dict(nnx.state(module))
    stored = {}
    for spec in weight_specs(module.config):
        if is_expert_stack(spec) or spec.name == "head.weight":
            node = tree_get(pure, _module_path(spec))
            if "weight_scale" in node:
                stored[spec.name] = "nvfp4+input_scale" if "input_scale" in node else "nvfp4"
    return stored


class DeepseekV4(nnx.Module):
    """DeepSeek-V4 (any configuration). With `rngs`: random weights in the stored formats (`stored`: per-weight
    formats other than the defaults, as params.weight_specs takes them); with `params`: that parameter tree's
    arrays (e.g. a loaded checkpoint's), nothing random built first. `context`: how `module(tokens)` runs
    (default: RunContext.create(), resolved here, once)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None, params: dict | None = None,
                 stored: dict[str, str] | None = None, context: RunContext | None = None):
        if (rngs is None) == (params is None):
            raise ValueError("DeepseekV4: give either rngs (random weights) or params (existing arrays)")
        if params is None:
            params = init_params(config, rngs.params(), stored)
        self.config = config
        self.context = RunContext.create() if context is None else context
        for spec in weight_specs(config):
            path = _module_path(spec)
            owner = self._group(path) if path else self
            for name, (array, axes) in stored_arrays(spec, tree_get(params, spec.name)).items():
                setattr(owner, name, nnx.Param(array, out_sharding=axes, eager_sharding=False))

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict, context: RunContext | None = None) -> DeepseekV4:
        """The module holding an existing parameter tree's arrays."""
        return cls(config, params=params, context=context)

    def _group(self, dotted: str) -> Weights:
        """The module at a dotted path, creating it (and any list of blocks on the way) on first use."""
        node = self
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                index = int(part)
                while len(node) <= index:
                    node.append((MTPBlock if parts[i - 1] == "mtp" else Block)())
                node = node[index]
            elif parts[i + 1:i + 2] and parts[i + 1].isdigit():
                if not hasattr(node, part):
                    setattr(node, part, nnx.List([]))
                node = getattr(node, part)
            else:
                if not hasattr(node, part):
                    setattr(node, part, _GROUPS.get(part, Weights)())
                node = getattr(node, part)
        return node

    def params(self) -> dict:
        """The engine's parameter tree of this module's arrays (no copies)."""
        return engine_params(self.config, nnx.state(self))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Teacher-forced logits float32 [B, S, V] of tokens [B, S] from position 0 (engine.forward)."""
        return engine.forward(self.params(), tokens, cfg=self.config, ctx=self.context)
