"""Config parsing: an official Hugging Face config.json maps onto ModelConfig (docs/model.md 2.1)."""

import json

import pytest

from dsv4_jax import presets
from dsv4_jax.config import from_hf_config, load_hf_config, to_hf_config

# The released Flash config.json, as listed in docs/model.md section 2.1 (HF keys).
FLASH_HF = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def test_flash_config_json_gives_the_flash_preset():
    cfg = from_hf_config(FLASH_HF)
    assert cfg == presets.flash()
    assert len(cfg.compress_ratios) == cfg.n_layers + cfg.n_mtp_layers == 44
    assert cfg.compress_ratios[cfg.n_layers] == 0          # the MTP block is window-only
    assert (cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow) == (16, 65536, 32, 1)


def test_pro_round_trips_through_config_json(tmp_path):
    hf = to_hf_config(presets.pro())
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert load_hf_config(tmp_path) == presets.pro()
    assert len(hf["compress_ratios"]) == 62 and hf["compress_ratios"][:3] == [128, 128, 4]


@pytest.mark.parametrize("change, message", [
    ({"model_type": "deepseek_v3"}, "model_type is 'deepseek_v3'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"num_key_value_heads": 8}, "num_key_value_heads is 8"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
    ({"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling type 'linear'"),
    ({"num_attention_heads": 60}, "divisible by o_groups"),
])
def test_config_errors_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({**FLASH_HF, **change})


def test_missing_keys_and_files(tmp_path):
    with pytest.raises(ValueError, match="missing keys"):
        from_hf_config({"model_type": "deepseek_v4", "vocab_size": 10})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
