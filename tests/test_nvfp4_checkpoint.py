"""NVFP4 checkpoints: NVIDIA's layout loads as stored (Nvfp4Weight, no requantization), the MXFP4 -> NVFP4 tool is
lossless (dequantized values identical bit for bit, every other byte copied), a model loaded from an MXFP4
checkpoint and from its conversion gives identical logits, lm_head quantization at load, and one-line errors for
inconsistent checkpoints.

Decoding on the test side uses ckpt_writer's numpy helpers (written from the spec), never the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ckpt_writer as cw
import dsv4_jax
from dsv4_jax import presets
from dsv4_jax.checkpoint import (CheckpointError, abstract_params, load_params, quantize_head_to_nvfp4,
                                 write_safetensors)
from dsv4_jax.numerics import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from dsv4_jax.ops import linear
from dsv4_jax.run_context import RunContext
from test_quant_formats import nvfp4_weight_np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "scripts", "convert_mxfp4_to_nvfp4.py")
_spec = importlib.util.spec_from_file_location("convert_mxfp4_to_nvfp4", TOOL)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

EXPERT_RE = r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\."


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(MXFP4 checkpoint dir, its NVFP4 conversion dir, logical float64 weights). The source has 3 shards, a
    tokenizer and an inference/ folder, which must come through byte for byte."""
    cfg = presets.tiny()
    src = str(tmp_path_factory.mktemp("mxfp4"))
    weights = cw.write_checkpoint(src, cfg, seed=5, num_shards=3)
    with open(os.path.join(src, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {}}\n')
    os.makedirs(os.path.join(src, "inference"))
    with open(os.path.join(src, "inference", "config.json"), "w") as f:
        f.write('{"dim": 128}\n')
    dst = str(tmp_path_factory.mktemp("nvfp4") / "out")
    summary = tool.convert(src, dst)
    assert summary["converted"] == cfg.n_layers * cfg.n_routed_experts * 3
    return src, dst, weights


def test_conversion_layout_and_untouched_bytes(converted):
    src, dst, _ = converted
    before, after = cw.read_checkpoint_raw(src), cw.read_checkpoint_raw(dst)
    cfg = presets.tiny()
    import re
    for name, (dtype, shape, raw) in before.items():
        if re.match(EXPERT_RE, name):
            stem = name.rsplit(".", 1)[0] + "."
            if name.endswith(".weight"):
                assert after[name][:2] == ("U8", shape) and after[name][2] == raw, f"{name}: nibbles must not change"
            else:
                assert name not in after, f"{name}: the E8M0 scale must be replaced"
                assert after[stem + "weight_scale"][:2] == ("F8_E4M3", [shape[0], shape[1] * 2])
                assert after[stem + "weight_scale_2"][:2] == ("F32", [])
                assert stem + "input_scale" not in after
        else:
            assert after[name] == (dtype, shape, raw), f"{name} must be copied byte for byte"
    n_new = cfg.n_layers * cfg.n_routed_experts * 3
    assert len(after) == len(before) + n_new
    assert any(n.startswith("mtp.0.ffn.experts.0.w1.scale") for n in after), "MTP experts stay MXFP4"
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(after)
    assert sorted(set(index["weight_map"].values())) == sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in after.values())
    qc = json.load(open(os.path.join(dst, "hf_quant_config.json")))["quantization"]
    assert qc["quant_algo"] == "MIXED_PRECISION"
    assert qc["quantized_layers"] == {f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
                                      for i in range(cfg.n_layers)}
    for rel in ("config.json", "tokenizer.json", os.path.join("inference", "config.json")):
        assert open(os.path.join(src, rel), "rb").read() == open(os.path.join(dst, rel), "rb").read(), rel


def test_conversion_dequantizes_identically_bit_for_bit(converted):
    src, dst, weights = converted
    before, after = cw.read_checkpoint_raw(src), cw.read_checkpoint_raw(dst)
    checked = 0
    for name in before:
        if not (name.startswith("layers.") and ".experts." in name and name.endswith(".weight")):
            continue
        stem = name[:-len("weight")]
        mx = cw.dequant_mxfp4(cw.decode_raw(*before[name]), cw.decode_raw(*before[stem + "scale"]))
        nv = cw.dequant_nvfp4(cw.decode_raw(*after[name]), cw.decode_raw(*after[stem + "weight_scale"]),
                              cw.decode_raw(*after[stem + "weight_scale_2"]))
        np.testing.assert_array_equal(nv.view(np.uint64), mx.view(np.uint64), err_msg=name)
        np.testing.assert_array_equal(nv, weights[name], err_msg=name)
        checked += 1
    assert checked == 4 * 8 * 3


def test_mxfp4_and_converted_checkpoints_give_identical_logits(converted):
    """Default numerics (bf16, act_quant none), both with the lm_head quantized to NVFP4 at load."""
    src, dst, _ = converted
    tokens = np.random.default_rng(61).integers(0, presets.tiny().vocab_size, (2, 40)).astype(np.int32)
    mx = dsv4_jax.load(src, quantize_head=True)
    nv = dsv4_jax.load(dst, quantize_head=True)
    experts_mx = mx.params["layers"][2]["ffn"]["experts"]["w1"]["weight"]
    experts_nv = nv.params["layers"][2]["ffn"]["experts"]["w1"]["weight"]
    assert isinstance(experts_mx, Mxfp4Weight) and isinstance(experts_nv, Nvfp4Weight)
    assert experts_nv.input_scale is None
    assert isinstance(nv.params["mtp"][0]["ffn"]["experts"]["w1"]["weight"], Mxfp4Weight)
    a, b = np.asarray(mx.forward(tokens)), np.asarray(nv.forward(tokens))
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_nvidia_layout_loads_as_stored(tmp_path):
    """ckpt_writer's NVIDIA-layout checkpoint (with input_scale and hf_quant_config.json): experts become
    Nvfp4Weight holding exactly the stored bytes; their values equal the logical weights."""
    cfg = presets.tiny()
    weights = cw.write_checkpoint(str(tmp_path), cfg, seed=9, num_shards=2, expert_format="nvfp4")
    raw = cw.read_checkpoint_raw(str(tmp_path))
    _, params = load_params(str(tmp_path))
    w = params["layers"][1]["ffn"]["experts"]["w3"]["weight"]
    assert isinstance(w, Nvfp4Weight)
    assert w.packed.dtype == jnp.uint8 and w.scale.dtype == jnp.float8_e4m3fn and w.global_scale.shape == (8,)
    for e in (0, 5):
        stem = f"layers.1.ffn.experts.{e}.w3."
        assert np.asarray(w.packed[e]).tobytes() == raw[stem + "weight"][2]
        assert np.asarray(w.scale[e]).tobytes() == raw[stem + "weight_scale"][2]
        assert np.asarray(w.global_scale[e]).tobytes() == raw[stem + "weight_scale_2"][2]
        assert np.asarray(w.input_scale[e]).tobytes() == raw[stem + "input_scale"][2]
        np.testing.assert_array_equal(np.asarray(w.dequantize()[e], np.float64), weights[stem + "weight"])
    assert isinstance(params["layers"][1]["ffn"]["shared_experts"]["w1"]["weight"], Fp8BlockWeight)
    assert params["layers"][0]["ffn"]["gate"]["weight"].dtype == jnp.bfloat16          # the router stays bf16
    assert params["layers"][0]["ffn"]["gate"]["tid2eid"].dtype == jnp.int32


@pytest.mark.parametrize("which, quantize_head", [("mxfp4", False), ("mxfp4", True), ("converted", False),
                                                 ("nvidia", False)])
def test_description_knows_every_leaf_before_loading(converted, nvidia_single, which, quantize_head):
    """The stored formats read from the headers alone (MXFP4 / NVFP4 per stack, input_scale or not, the head
    quantized at load or not) give the loaded tree exactly: structure, shapes and dtypes of every leaf."""
    directory = {"mxfp4": converted[0], "converted": converted[1], "nvidia": nvidia_single}[which]
    _, abstract = abstract_params(directory, quantize_head=quantize_head)
    _, params = load_params(directory, quantize_head=quantize_head)
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(params)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype), jax.tree_util.keystr(path)
    head = params["head"]["weight"]
    assert isinstance(head, Nvfp4Weight) == quantize_head


def test_quantize_head_standard_recipe_and_frees_bf16(converted):
    src, _, weights = converted
    cfg = presets.tiny()
    _, params = load_params(src)
    bf16_head = params["head"]["weight"]
    assert bf16_head.dtype == jnp.bfloat16
    head_np = np.asarray(bf16_head)
    quantize_head_to_nvfp4(params)
    head = params["head"]["weight"]
    assert bf16_head.is_deleted(), "the bf16 head must be freed"
    assert isinstance(head, Nvfp4Weight) and head.global_scale.shape == ()
    packed, scale, gs = nvfp4_weight_np(head_np)
    np.testing.assert_array_equal(np.asarray(head.packed), packed)
    np.testing.assert_array_equal(np.asarray(head.scale).view(np.uint8), scale.view(np.uint8))
    assert np.asarray(head.global_scale).tobytes() == gs.tobytes()
    assert params["layers"][3]["ffn"]["gate"]["weight"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="quantize_head: the head is already Nvfp4Weight"):
        quantize_head_to_nvfp4(params)
    # Effect on logits. For isotropic hidden states h, E|(W' - W) h|^2 = |W' - W|_F^2: the logits' relative error
    # is the weights' relative rms quantization error, which for e2m1 with e4m3 block scales on Gaussian rows is
    # ~9.5% (measured: weights 0.095, logits 0.095, top-1 agreement over 512 random logits 0.82).
    dequantized = np.asarray(head.dequantize(), np.float64)
    rel_w = np.linalg.norm(dequantized - weights["head.weight"]) / np.linalg.norm(weights["head.weight"])
    h = np.random.default_rng(62).standard_normal((256, cfg.dim)).astype(np.float32)
    exact = h.astype(np.float64) @ weights["head.weight"].T
    got = np.asarray(jax.jit(lambda x, w: linear(x, w, jnp.float32, ctx=RunContext.create()))(jnp.asarray(h), head))
    np.testing.assert_allclose(got, h.astype(np.float64) @ dequantized.T, rtol=0, atol=1e-5 * np.abs(exact).max())
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    top1 = np.mean(got.argmax(-1) == exact.argmax(-1))
    print(f"NVFP4 head: weights rel rms error {rel_w:.3f}, logits rel L2 {rel:.3f}, top-1 {top1:.3f}")
    assert rel_w < 0.11 and abs(rel - rel_w) < 0.1 * rel_w and top1 > 0.7


# ---------------------------------------------------------------------------------------------------------------
# inconsistent checkpoints: one-line errors
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvidia_single(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("nvidia_single"))
    cw.write_checkpoint(directory, presets.tiny(), seed=11, num_shards=1, expert_format="nvfp4")
    return directory


def _edit(src, dst, edit=None, quant_config=None):
    """Copy checkpoint `src` to `dst`, rewriting its single shard with edit(tensors) where tensors is
    {name: (dtype, shape, raw bytes)}, and optionally replacing hf_quant_config.json."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = cw.read_safetensors_raw(path)
    if edit is not None:
        edit(tensors)
        write_safetensors(path, {n: (d, s, np.frombuffer(b, np.uint8)) for n, (d, s, b) in tensors.items()})
    if quant_config is not None:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(quant_config, f)
    return str(dst)


def _f32(value):
    return ("F32", [], np.float32(value).tobytes())


def _error(directory) -> str:
    with pytest.raises(CheckpointError) as info:
        dsv4_jax.load(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_mixed_expert_formats_in_one_layer(nvidia_single, tmp_path):
    def edit(t):
        stem = "layers.2.ffn.experts.3.w1."
        for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            del t[stem + suffix]
        t[stem + "scale"] = ("F8_E8M0", [64, 4], bytes([120]) * 256)
    message = _error(_edit(nvidia_single, tmp_path / "c", edit))
    assert message == ("layers.2.ffn.experts.3.w1.weight: MXFP4 tensors, but expert 0 of this layer is NVFP4 "
                       "(a layer's experts must share one format)")


def test_error_bad_global_scale(nvidia_single, tmp_path):
    def edit(t):
        t["layers.1.ffn.experts.6.w2.weight_scale_2"] = _f32(0.0)
    assert _error(_edit(nvidia_single, tmp_path / "c", edit)) == (
        "tensor layers.1.ffn.experts.6.w2.weight_scale_2: expected a finite positive scale, found 0.0")


def test_error_input_scale_on_some_experts_only(nvidia_single, tmp_path):
    def edit(t):
        del t["layers.0.ffn.experts.4.w3.input_scale"]
    assert _error(_edit(nvidia_single, tmp_path / "c", edit)).startswith(
        "missing tensor layers.0.ffn.experts.4.w3.input_scale (expected F32 []")


def test_error_misshaped_block_scales(nvidia_single, tmp_path):
    def edit(t):
        d, s, b = t["layers.3.ffn.experts.0.w2.weight_scale"]
        t["layers.3.ffn.experts.0.w2.weight_scale"] = (d, [s[0], s[1] // 2], b[:len(b) // 2])
    assert _error(_edit(nvidia_single, tmp_path / "c", edit)) == (
        "tensor layers.3.ffn.experts.0.w2.weight_scale: expected F8_E4M3 [128, 4], found F8_E4M3 [128, 2]")


def test_error_quant_config_disagrees_with_tensors(nvidia_single, tmp_path):
    qc = {"quantization": {"quant_algo": "MIXED_PRECISION",
                           "quantized_layers": {"mtp.0.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}}}}
    assert _error(_edit(nvidia_single, tmp_path / "a", quant_config=qc)) == (
        "hf_quant_config.json declares mtp.0.ffn.experts NVFP4 but the checkpoint stores MXFP4 tensors "
        "(mtp.0.ffn.experts.0.w1.scale)")
    qc["quantization"]["quantized_layers"] = {"layers.0.ffn.experts": {"quant_algo": "NVFP4", "group_size": 32}}
    assert "layers.0.ffn.experts has NVFP4 group size 32, only 16 is supported" in _error(
        _edit(nvidia_single, tmp_path / "b", quant_config=qc))
    qc = {"quantization": {"quant_algo": "W4A8_AWQ"}}
    assert "quant_algo 'W4A8_AWQ' is not supported" in _error(_edit(nvidia_single, tmp_path / "c", quant_config=qc))


def test_error_compressed_tensors_layout(nvidia_single, tmp_path):
    def edit(t):
        t["layers.0.ffn.experts.0.w1.weight_packed"] = t.pop("layers.0.ffn.experts.0.w1.weight")
    assert "compressed-tensors NVFP4 layout is not supported" in _error(_edit(nvidia_single, tmp_path / "c", edit))


# ---------------------------------------------------------------------------------------------------------------
# the tool's own errors, and the package writer
# ---------------------------------------------------------------------------------------------------------------

def test_tool_refuses_a_cast_that_is_not_exact(converted, tmp_path):
    src, _, _ = converted
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    index = json.load(open(bad / "model.safetensors.index.json"))
    name = "layers.1.ffn.experts.2.w2.scale"
    shard = str(bad / index["weight_map"][name])
    tensors = cw.read_safetensors_raw(shard)
    d, s, b = tensors[name]
    scale = np.frombuffer(b, np.uint8).copy()
    scale[0] = scale.max() - 20                             # an exponent span of 20 > 17
    tensors[name] = (d, s, scale.tobytes())
    write_safetensors(shard, {n: (d, s, np.frombuffer(b, np.uint8)) for n, (d, s, b) in tensors.items()})
    with pytest.raises(tool.ConversionError, match=r"tensor layers\.1\.ffn\.experts\.2\.w2\.weight: its E8M0 "
                                                   r"exponents span more than 17"):
        tool.convert(str(bad), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out"), "nothing may be written when a matrix cannot be cast"


def test_tool_cli_errors_are_one_line(converted, tmp_path):
    src, dst, _ = converted
    for args, expected in (([str(tmp_path / "missing"), str(tmp_path / "o")], "error: "),
                           ([src, dst], "destination exists and is not empty")):
        run = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)
        assert run.returncode == 2
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ") and expected in run.stderr
        assert "Traceback" not in run.stderr


def test_package_safetensors_writer_round_trips(tmp_path):
    rng = np.random.default_rng(63)
    tensors = {"b": ("BF16", rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)),
               "a": ("F8_E4M3", rng.standard_normal((7,)).astype(ml_dtypes.float8_e4m3fn)),
               "s": ("F32", np.float32(2.5).reshape(())),
               "raw": ("F8_E8M0", [2, 2], np.array([1, 2, 3, 4], np.uint8))}
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors, {"format": "pt"})
    back = cw.read_safetensors_raw(path)
    assert list(back) == ["b", "a", "s", "raw"]
    assert back["b"] == ("BF16", [3, 5], tensors["b"][1].tobytes())
    assert back["a"] == ("F8_E4M3", [7], tensors["a"][1].tobytes())
    assert back["s"] == ("F32", [], np.float32(2.5).tobytes())
    assert back["raw"] == ("F8_E8M0", [2, 2], bytes([1, 2, 3, 4]))
    header_len = int.from_bytes(open(path, "rb").read(8), "little")
    assert (8 + header_len) % 8 == 0
    with pytest.raises(ValueError, match="tensor w: float32 items cannot be stored as BF16"):
        write_safetensors(path, {"w": ("BF16", np.zeros(2, np.float32))})


@pytest.mark.parametrize("header, message", [
    (None, "header length 4611686018427387904 exceeds the file"),          # 2^62: was a MemoryError
    (b"[1, 2, 3]", "not a JSON object of tensor entries"),                  # was a TypeError
    (b'{"w": {"dtype": "F32"}}', "not a JSON object of tensor entries"),
    (b"{not json", "not a readable safetensors file"),
])
def test_corrupt_safetensors_headers_are_one_line_checkpoint_errors(tmp_path, header, message):
    """The header is checked before anything past it is read, and a bad one names the file."""
    from dsv4_jax.checkpoint import SafetensorsFile
    path = tmp_path / "bad.safetensors"
    length = 2 ** 62 if header is None else len(header)
    path.write_bytes(length.to_bytes(8, "little") + (header or b"{}") + bytes(64))
    with pytest.raises(CheckpointError, match=message) as err:
        SafetensorsFile(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)
