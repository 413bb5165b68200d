"""Model hyperparameters: one frozen dataclass, the presets, and parsing of an official `config.json`.

Field names follow DeepSeek's reference `ModelArgs` (docs/model.md section 2.1); `from_hf_config` maps the Hugging Face
`config.json` keys onto them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    # One entry per backbone layer followed by one per MTP layer (0 = window only, 4 = CSA, other = HCA).
    compress_ratios: tuple[int, ...]
    n_mtp_layers: int = 1
    window_size: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    n_hash_layers: int = 3
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        problems = []
        if len(self.compress_ratios) < self.n_layers + self.n_mtp_layers:
            problems.append(f"compress_ratios has {len(self.compress_ratios)} entries, expected at least "
                            f"n_layers + n_mtp_layers = {self.n_layers + self.n_mtp_layers}")
        if any(r < 0 for r in self.compress_ratios):
            problems.append(f"compress_ratios must be >= 0, got {self.compress_ratios}")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            problems.append(f"rope_head_dim {self.rope_head_dim} must be even and smaller than head_dim {self.head_dim}")
        if (self.head_dim - self.rope_head_dim) % 64:
            problems.append(f"nope dims head_dim - rope_head_dim = {self.head_dim - self.rope_head_dim} must be a "
                            "multiple of 64 (the FP8 fake-quant block)")
        if self.index_head_dim <= self.rope_head_dim or self.index_head_dim & (self.index_head_dim - 1) \
                or self.index_head_dim % 32:
            problems.append(f"index_head_dim {self.index_head_dim} must be a power of two >= 32 (Hadamard, FP4 "
                            f"block 32) and larger than rope_head_dim {self.rope_head_dim}")
        if self.n_heads % self.o_groups:
            problems.append(f"n_heads {self.n_heads} must be divisible by o_groups {self.o_groups}")
        if self.n_activated_experts > self.n_routed_experts:
            problems.append("n_activated_experts exceeds n_routed_experts")
        if self.n_hash_layers > self.n_layers:
            problems.append("n_hash_layers exceeds n_layers")
        if self.dim % 32 or self.moe_inter_dim % 32:
            problems.append("dim and moe_inter_dim must be multiples of 32 (MXFP4 block)")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    # ---- derived quantities -------------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.dim

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def layer_ratio(self, layer: int) -> int:
        """Compression ratio of backbone layer `layer` (0..n_layers-1) or MTP layer n_layers + k."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Hugging Face config.json key -> ModelConfig field (docs/model.md section 2.1).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta",
    "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "num_hash_layers": "n_hash_layers",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rms_norm_eps": "norm_eps",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "max_position_embeddings": "max_position_embeddings",
}
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "compress_ratios")


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of an official DeepSeek-V4 `config.json`."""
    model_type = hf.get("model_type")
    if model_type is not None and model_type != "deepseek_v4":
        raise ValueError(f"{source}: model_type is {model_type!r}, expected 'deepseek_v4' (DeepSeek-V4 Flash/Pro)")
    missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
    if missing:
        raise ValueError(f"{source}: not a DeepSeek-V4 config, missing keys {missing}")
    fields = {field: hf[key] for key, field in _HF_KEYS.items() if key in hf}
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"{source}: scoring_func {scoring!r} is not supported, expected 'sqrtsoftplus'")
    rope_scaling = hf.get("rope_scaling") or {}
    if rope_scaling:
        kind = rope_scaling.get("type", rope_scaling.get("rope_type"))
        if kind != "yarn":
            raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported, expected 'yarn'")
        fields["rope_factor"] = rope_scaling.get("factor", 16.0)
        fields["original_seq_len"] = rope_scaling.get("original_max_position_embeddings", 65536)
        fields["beta_fast"] = rope_scaling.get("beta_fast", 32.0)
        fields["beta_slow"] = rope_scaling.get("beta_slow", 1.0)
    if "num_key_value_heads" in hf and hf["num_key_value_heads"] != 1:
        raise ValueError(f"{source}: num_key_value_heads is {hf['num_key_value_heads']}, DeepSeek-V4 has 1")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json (expected an official DeepSeek-V4 checkpoint)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return from_hf_config(hf, source=path)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The official `config.json` dict for `cfg` (used by checkpoint writers)."""
    inverse = {field: key for key, field in _HF_KEYS.items()}
    hf: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_key_value_heads": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
    }
    for field in dataclasses.fields(cfg):
        if field.name in inverse:
            value = getattr(cfg, field.name)
            hf[inverse[field.name]] = list(value) if isinstance(value, tuple) else value
    return hf
