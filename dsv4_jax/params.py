"""The one description of every weight: name, logical shape, stored format and logical axes.

`weight_specs` lists the model's weights under their official checkpoint names (docs/model.md 6.3). From it come the
on-disk tensor list used to validate checkpoints (`disk_tensor_specs`), the in-memory parameter tree
(`tree_set`), random initialisation (`init_params`, traceable, so `jax.eval_shape` sizes Flash and Pro
without allocating) and, through each weight's logical axes, where it may be split across devices. Routed experts
appear once per layer as a stacked [E, out, in] weight.

The description is complete before any array exists: a checkpoint's stored formats (MXFP4 or NVFP4 per expert
stack, with or without NVIDIA's `input_scale`; the head bf16 or quantized to NVFP4 at load) are read from its
safetensors headers (checkpoint.stored_formats) and passed as `stored`, so `jax.eval_shape` of `init_params` with
them knows every leaf of the loaded tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layer_scan import StackedLayers
from .numerics.formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight


# Logical axes a weight dimension may carry: what a mesh may split it by (sharding rules map them to mesh axes).
# A dimension without one (None) is never split.
LOGICAL_AXES = {
    "vocab": "the vocabulary rows of the embedding and the head",
    "heads": "attention heads: wq_b's output rows (n_heads x head_dim) and the per-head sink",
    "o_groups": "the output projection's groups: wo_a's rows (o_groups x o_lora_rank), wo_b's inputs",
    "index_heads": "the indexer's heads: its wq_b rows (index_n_heads x index_head_dim) and weights_proj rows",
    "mlp": "the shared expert's hidden units: w1 / w3 rows, w2 inputs",
    "experts": "the routed experts of a stacked [E, out, in] weight",
}


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    name: str                 # official name; for experts "layers.L.ffn.experts.w1.weight" (E folded in)
    shape: tuple[int, ...]    # logical shape (experts: [E, out, in])
    fmt: str                  # "bf16", "f32", "i64", "fp8" (e4m3 + E8M0 128x128), "mxfp4" / "nvfp4" (FP4)
    init_std: float = 0.0     # random init: normal std (0 -> ones for norms, see init_params)
    axes: tuple[str | None, ...] | None = None   # logical axis per dimension (LOGICAL_AXES); None: none split
    input_scale: bool = False  # NVFP4 expert stacks: the checkpoint carries NVIDIA's static input_scale

    def __post_init__(self):
        if self.axes is None:
            object.__setattr__(self, "axes", (None,) * len(self.shape))
        if len(self.axes) != len(self.shape) or not set(self.axes) <= set(LOGICAL_AXES) | {None}:
            raise ValueError(f"{self.name}: axes {self.axes} must name one of {sorted(LOGICAL_AXES)} or None for "
                             f"each of its {len(self.shape)} dims")


def _linear(name, out_dim, in_dim, fmt="fp8", axes=(None, None)):
    return WeightSpec(name, (out_dim, in_dim), fmt, in_dim ** -0.5, axes)


def _block_specs(cfg: ModelConfig, prefix: str, layer: int) -> list[WeightSpec]:
    d, ratio = cfg.dim, cfg.compress_ratios[layer]
    specs = [
        WeightSpec(f"{prefix}attn_norm.weight", (d,), "bf16"),
        WeightSpec(f"{prefix}ffn_norm.weight", (d,), "bf16"),
    ]
    for site in ("attn", "ffn"):
        specs += [WeightSpec(f"{prefix}hc_{site}_fn", (cfg.hc_mix_dim, cfg.hc_dim), "f32", 0.02 * cfg.hc_dim ** -0.5),
                  WeightSpec(f"{prefix}hc_{site}_base", (cfg.hc_mix_dim,), "f32", 0.1),
                  WeightSpec(f"{prefix}hc_{site}_scale", (3,), "f32", 0.5)]
    a = f"{prefix}attn."
    specs += [
        WeightSpec(f"{a}attn_sink", (cfg.n_heads,), "f32", 1.0, ("heads",)),
        WeightSpec(f"{a}q_norm.weight", (cfg.q_lora_rank,), "bf16"),
        WeightSpec(f"{a}kv_norm.weight", (cfg.head_dim,), "bf16"),
        _linear(f"{a}wq_a.weight", cfg.q_lora_rank, d),
        _linear(f"{a}wq_b.weight", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, axes=("heads", None)),
        _linear(f"{a}wkv.weight", cfg.head_dim, d),
        _linear(f"{a}wo_a.weight", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups,
                axes=("o_groups", None)),
        _linear(f"{a}wo_b.weight", d, cfg.o_groups * cfg.o_lora_rank, axes=(None, "o_groups")),
    ]
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        specs += _compressor_specs(f"{a}compressor.", ratio, coff * cfg.head_dim, cfg.head_dim, d)
    if ratio == 4:
        i = f"{a}indexer."
        specs += [_linear(f"{i}wq_b.weight", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank,
                          axes=("index_heads", None)),
                  _linear(f"{i}weights_proj.weight", cfg.index_n_heads, d, "bf16", axes=("index_heads", None))]
        specs += _compressor_specs(f"{i}compressor.", ratio, 2 * cfg.index_head_dim, cfg.index_head_dim, d)
    f = f"{prefix}ffn."
    specs.append(_linear(f"{f}gate.weight", cfg.n_routed_experts, d, "bf16"))
    if layer < cfg.n_hash_layers:
        specs.append(WeightSpec(f"{f}gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "i64"))
    else:
        specs.append(WeightSpec(f"{f}gate.bias", (cfg.n_routed_experts,), "f32", 0.1))
    inter, e = cfg.moe_inter_dim, cfg.n_routed_experts
    experts = ("experts", None, None)
    specs += [_linear(f"{f}shared_experts.w1.weight", inter, d, axes=("mlp", None)),
              _linear(f"{f}shared_experts.w3.weight", inter, d, axes=("mlp", None)),
              _linear(f"{f}shared_experts.w2.weight", d, inter, axes=(None, "mlp")),
              WeightSpec(f"{f}experts.w1.weight", (e, inter, d), "mxfp4", d ** -0.5, experts),
              WeightSpec(f"{f}experts.w3.weight", (e, inter, d), "mxfp4", d ** -0.5, experts),
              WeightSpec(f"{f}experts.w2.weight", (e, d, inter), "mxfp4", inter ** -0.5, experts)]
    return specs


def _compressor_specs(prefix, ratio, width, head_dim, d):
    return [WeightSpec(f"{prefix}ape", (ratio, width), "f32", 0.1),
            _linear(f"{prefix}wkv.weight", width, d, "bf16"),
            _linear(f"{prefix}wgate.weight", width, d, "bf16"),
            WeightSpec(f"{prefix}norm.weight", (head_dim,), "bf16")]


FP4_FORMATS = ("mxfp4", "nvfp4")
# Stored formats a description may give a weight besides its default (`stored` of weight_specs): expert stacks
# "mxfp4" (DeepSeek's release) or "nvfp4" / "nvfp4+input_scale" (NVIDIA's); the head "bf16" or "nvfp4" (quantized
# once at load from the checkpoint's bf16).
STORED_FORMATS = {"experts": ("mxfp4", "nvfp4", "nvfp4+input_scale"), "head": ("bf16", "nvfp4")}


def is_expert_stack(spec: WeightSpec) -> bool:
    return ".experts." in spec.name


def weight_specs(cfg: ModelConfig, stored: dict[str, str] | None = None) -> list[WeightSpec]:
    """Every weight of the model. `stored`: stored formats that differ from the defaults (MXFP4 experts, bf16
    head), by name ('layers.3.ffn.experts.w1.weight' -> 'nvfp4+input_scale', 'head.weight' -> 'nvfp4')."""
    specs = _default_specs(cfg)
    if not stored:
        return specs
    by_name = {spec.name: i for i, spec in enumerate(specs)}
    for name, fmt in stored.items():
        if name not in by_name:
            raise ValueError(f"stored format for {name}: not a weight of this model")
        spec = specs[by_name[name]]
        kind = "experts" if is_expert_stack(spec) else "head" if name == "head.weight" else None
        if kind is None or fmt not in STORED_FORMATS[kind]:
            allowed = STORED_FORMATS[kind] if kind else "none (only expert stacks and the head have a choice)"
            raise ValueError(f"stored format {fmt!r} for {name}: expected one of {allowed}")
        specs[by_name[name]] = dataclasses.replace(spec, fmt=fmt.split("+")[0],
                                                   input_scale=fmt.endswith("+input_scale"))
    return specs


def nvidia_formats(cfg: ModelConfig, input_scale: bool = True) -> dict[str, str]:
    """NVIDIA's re-quantized release: backbone routed experts NVFP4 (with input_scale), the MTP block's MXFP4."""
    fmt = "nvfp4+input_scale" if input_scale else "nvfp4"
    return {spec.name: fmt for spec in _default_specs(cfg) if is_expert_stack(spec) and spec.name.startswith("layers.")}


def _default_specs(cfg: ModelConfig) -> list[WeightSpec]:
    d = cfg.dim
    specs = [WeightSpec("embed.weight", (cfg.vocab_size, d), "bf16", 1.0, ("vocab", None)),
             WeightSpec("head.weight", (cfg.vocab_size, d), "bf16", d ** -0.5, ("vocab", None)),
             WeightSpec("norm.weight", (d,), "bf16"),
             WeightSpec("hc_head_fn", (cfg.hc_mult, cfg.hc_dim), "f32", 0.02 * cfg.hc_dim ** -0.5),
             WeightSpec("hc_head_base", (cfg.hc_mult,), "f32", 0.1),
             WeightSpec("hc_head_scale", (1,), "f32", 0.5)]
    for layer in range(cfg.n_layers):
        specs += _block_specs(cfg, f"layers.{layer}.", layer)
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        specs += _block_specs(cfg, p, cfg.n_layers + k)
        specs += [_linear(f"{p}e_proj.weight", d, d), _linear(f"{p}h_proj.weight", d, d),
                  WeightSpec(f"{p}enorm.weight", (d,), "bf16"), WeightSpec(f"{p}hnorm.weight", (d,), "bf16"),
                  WeightSpec(f"{p}norm.weight", (d,), "bf16"),
                  WeightSpec(f"{p}hc_head_fn", (cfg.hc_mult, cfg.hc_dim), "f32", 0.02 * cfg.hc_dim ** -0.5),
                  WeightSpec(f"{p}hc_head_base", (cfg.hc_mult,), "f32", 0.1),
                  WeightSpec(f"{p}hc_head_scale", (1,), "f32", 0.5)]
    return specs


# ---- on-disk view -----------------------------------------------------------------------------------------

def expert_disk_names(spec: WeightSpec, expert: int) -> str:
    """'layers.L.ffn.experts.w1.weight' -> 'layers.L.ffn.experts.E.w1.weight'."""
    head, proj = spec.name.rsplit(".experts.", 1)
    return f"{head}.experts.{expert}.{proj}"


def disk_tensor_specs(cfg: ModelConfig, stored: dict[str, str] | None = None) -> dict[str, tuple[tuple, tuple]]:
    """Every tensor an official checkpoint with these stored formats holds: name -> (safetensors dtypes it may
    have, the first the canonical one; shape) (docs/model.md 6.2, 6.6). The one on-disk list: loading validates
    against it, the writers produce it."""
    out: dict[str, tuple[tuple, tuple]] = {}
    simple = {"bf16": "BF16", "f32": "F32", "i64": "I64"}
    for spec in weight_specs(cfg, stored):
        if spec.name == "head.weight":                 # an NVFP4 head is quantized at load from the stored bf16
            out[spec.name] = (("BF16",), spec.shape)
        elif spec.fmt in simple:
            out[spec.name] = ((simple[spec.fmt],), spec.shape)
        elif spec.fmt == "fp8":
            rows, cols = spec.shape
            out[spec.name] = (("F8_E4M3",), spec.shape)
            out[spec.name[:-len("weight")] + "scale"] = (("F8_E8M0",), (math.ceil(rows / FP8_BLOCK),
                                                                        math.ceil(cols / FP8_BLOCK)))
        else:
            n_exp, rows, cols = spec.shape
            for e in range(n_exp):
                name = expert_disk_names(spec, e)
                stem = name[:-len("weight")]
                if spec.fmt == "nvfp4":
                    out[name] = (("U8", "I8"), (rows, cols // 2))
                    out[stem + "weight_scale"] = (("F8_E4M3",), (rows, cols // NVFP4_BLOCK))
                    out[stem + "weight_scale_2"] = (("F32",), ())
                    if spec.input_scale:
                        out[stem + "input_scale"] = (("F32",), ())
                else:
                    out[name] = (("I8",), (rows, cols // 2))
                    out[stem + "scale"] = (("F8_E8M0",), (rows, cols // MXFP4_BLOCK))
    return out


# ---- in-memory tree ---------------------------------------------------------------------------------------

def tree_set(tree: dict, name: str, value) -> None:
    """Insert `value` at the dotted official name; numeric components index lists ('layers.3.attn' ...)."""
    parts = name.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        if part.isdigit():
            part = int(part)
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = [] if nxt_is_index else {}
            node = node[part]
        else:
            node = node.setdefault(part, [] if nxt_is_index else {})
    node[parts[-1]] = value


def tree_get(tree, name: str):
    node = tree
    for part in name.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def _random_weight(spec: WeightSpec, key: jax.Array, n_experts: int):
    if spec.fmt in _DTYPES:
        if spec.init_std == 0.0:   # norm weights
            return jnp.ones(spec.shape, _DTYPES[spec.fmt])
        return (spec.init_std * jax.random.normal(key, spec.shape, jnp.float32)).astype(_DTYPES[spec.fmt])
    if spec.fmt == "i64":
        # Distinct experts per token: the first K of a random permutation of the experts, per row.
        ranks = jnp.argsort(jax.random.uniform(key, (spec.shape[0], n_experts)), axis=-1)
        return ranks[:, :spec.shape[1]].astype(jnp.int32)
    if spec.fmt == "fp8":
        rows, cols = spec.shape
        # N(0,1) e4m3 values under one power-of-two scale close to the target std.
        w = jax.random.normal(key, spec.shape, jnp.float32).astype(jnp.float8_e4m3fn)
        exponent = 127 + round(math.log2(spec.init_std))
        scale = jnp.full((math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)), exponent, jnp.uint8)
        return Fp8BlockWeight(w, scale)
    *lead, rows, cols = spec.shape
    packed = jax.random.randint(key, (*lead, rows, cols // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    # Uniform random e2m1 codes have std ~2.9; pick the power-of-two scale nearest init_std / 2.9.
    exponent = round(math.log2(spec.init_std / 2.9))
    if spec.fmt == "mxfp4":
        return Mxfp4Weight(packed, jnp.full((*lead, rows, cols // MXFP4_BLOCK), 127 + exponent, jnp.uint8))
    # NVFP4: block scales 1.0 (e4m3), the power of two in the per-matrix global scale
    block_scales = jnp.ones((*lead, rows, cols // NVFP4_BLOCK), jnp.float8_e4m3fn)
    global_scale = jnp.full(lead, 2.0 ** exponent, jnp.float32)
    return Nvfp4Weight(packed, block_scales, global_scale, jnp.ones(lead, jnp.float32) if spec.input_scale else None)


def init_params(cfg: ModelConfig, key: jax.Array, stored: dict[str, str] | None = None, shardings=None,
                scan_plan=None) -> dict:
    """Random weights in the stored formats (FP8 attention, MXFP4 experts unless `stored` says otherwise, ...),
    as a parameter tree; `shardings` (sharding.param_shardings) places each weight as it is generated.

    Each weight comes from one small jitted generator per distinct (format, shape, std, sharding): the layers
    of a model share a few dozen of them, so the compile cost does not grow with depth (one program for the
    whole tree took ~9 s per Flash layer to compile on an H200). `scan_plan` (layer_scan.ScanPlan, without
    `shardings`): the plan's layers are generated straight into their stacked layout, a layer_scan.StackedLayers
    under "layers" holding what stack_layers would make of the per-layer weights, without a second copy of them."""
    if scan_plan is not None and shardings is not None:
        raise NotImplementedError("init_params: stacked generation with shardings")
    specs = weight_specs(cfg, stored)
    keys = jax.random.split(key, len(specs))
    tree: dict = {}
    scanned: dict[tuple[int, str], list] = {}        # (phase, name inside the layer) -> [(repeat, spec, key)]
    for spec, k in zip(specs, keys):
        place = _scanned_place(spec.name, scan_plan)
        if place is not None:
            repeat, phase, inner = place
            scanned.setdefault((phase, inner), []).append((repeat, spec, k))
            continue
        sharding = None if shardings is None else tree_get(shardings, spec.name)
        generate = _weight_generator(dataclasses.replace(spec, name=""), cfg.n_routed_experts, sharding)
        tree_set(tree, spec.name, generate(k))
    if scan_plan is None:
        return tree
    phases: list[dict] = [{} for _ in range(scan_plan.period)]
    for (phase, inner), group in scanned.items():
        group.sort(key=lambda item: item[0])
        generate = _stacked_weight_generator(dataclasses.replace(group[0][1], name=""), cfg.n_routed_experts)
        tree_set(phases[phase], inner, generate(jnp.stack([k for _, _, k in group])))
    layers = tree["layers"]
    tree["layers"] = StackedLayers(before=layers[:scan_plan.start], phases=phases, after=layers[scan_plan.stop:],
                                   plan=scan_plan)
    return tree


def _scanned_place(name: str, plan) -> tuple[int, int, str] | None:
    """(repeat, phase, name inside the layer) of a weight of a layer the plan scans, else None."""
    parts = name.split(".", 2)
    if plan is None or parts[0] != "layers" or not plan.start <= int(parts[1]) < plan.stop:
        return None
    repeat, phase = divmod(int(parts[1]) - plan.start, plan.period)
    return repeat, phase, parts[2]


@functools.lru_cache(maxsize=None)
def _weight_generator(spec: WeightSpec, n_experts: int, sharding):
    return jax.jit(lambda key: _random_weight(spec, key, n_experts), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _stacked_weight_generator(spec: WeightSpec, n_experts: int):
    """keys [R] -> the weights of R layers stacked; one layer at a time (lax.map), so the random draws' temporaries
    stay one layer's size."""
    return jax.jit(lambda keys: jax.lax.map(lambda key: _random_weight(spec, key, n_experts), keys))


def logical_param_count(cfg: ModelConfig) -> int:
    """Number of model parameters (FP4 and FP8 elements counted one each, block scales excluded)."""
    return sum(math.prod(spec.shape) for spec in weight_specs(cfg) if spec.fmt != "i64")
