"""Configurations of the released models and of the tiny test model."""

from .config import ModelConfig


def flash() -> ModelConfig:
    """DeepSeek-V4-Flash (284B total / 13B active), docs/model.md section 2."""
    return ModelConfig(
        vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        index_topk=512, n_routed_experts=256, moe_inter_dim=2048, route_scale=1.5)


def pro() -> ModelConfig:
    """DeepSeek-V4-Pro (1.6T total / 49B active), docs/model.md section 2."""
    return ModelConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, head_dim=512, rope_head_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
        index_topk=1024, n_routed_experts=384, moe_inter_dim=3072, route_scale=2.5)


def tiny(vocab_size: int = 512) -> ModelConfig:
    """A small model with every mechanism of the real one, for tests and the default CLI model.

    Layers: 0 window-only + hash-routed, 1 CSA (ratio 4, indexer top-k 4) + hash-routed, 2 HCA (ratio 128),
    3 CSA, then one window-only MTP block. Window 128, hc_mult 4, shared expert, as in Flash.
    """
    return ModelConfig(
        vocab_size=vocab_size, dim=128, n_layers=4, n_heads=4, head_dim=96, rope_head_dim=32,
        q_lora_rank=64, o_groups=2, o_lora_rank=32,
        compress_ratios=(0, 4, 128, 4, 0),
        index_n_heads=4, index_head_dim=64, index_topk=4,
        n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, route_scale=1.5,
        n_hash_layers=2)


def named(name: str, layers: int | None = None) -> ModelConfig:
    """The preset called `name` ("tiny", "flash", "pro"), truncated to its first `layers` layers when given."""
    presets = {"tiny": tiny, "flash": flash, "pro": pro}
    if name not in presets:
        raise ValueError(f"preset must be one of {sorted(presets)}, got {name!r}")
    cfg = presets[name]()
    return cfg if layers is None else truncated(cfg, layers)


def truncated(cfg: ModelConfig, n_layers: int) -> ModelConfig:
    """The first `n_layers` backbone layers of `cfg` with its MTP block(s): the real geometry of a model too large
    for the devices at hand (benchmarks report the layer count they ran)."""
    if not isinstance(n_layers, int) or not 1 <= n_layers <= cfg.n_layers:
        raise ValueError(f"layers must be an integer in [1, {cfg.n_layers}], got {n_layers!r}")
    ratios = cfg.compress_ratios[:n_layers] + cfg.compress_ratios[cfg.n_layers:cfg.n_layers + cfg.n_mtp_layers]
    return cfg.replace(n_layers=n_layers, compress_ratios=ratios, n_hash_layers=min(cfg.n_hash_layers, n_layers))
