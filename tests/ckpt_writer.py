"""Synthetic DeepSeek-V4 checkpoints in the official on-disk format (docs/model.md sections 6.1-6.3, 6.6, 7).

Independent of the `dsv4_jax` implementation: the safetensors files are serialised here with plain numpy + json,
and every quantized tensor is produced by this file's own quantizers.

    logical = write_checkpoint(directory, cfg, seed=0, num_shards=1, expert_format="mxfp4")

writes `config.json` (the official HF dict from `dsv4_jax.config.to_hf_config`) and `model.safetensors` (or
`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`), and returns the LOGICAL weights: name -> float64
array equal to what the stored tensors represent after dequantization (`.weight` keys of FP8/FP4 tensors hold the
dequantized matrix; there are no `.scale` / `.weight_scale*` / `.input_scale` keys), every BF16/F32 tensor as float64
(exactly the stored value) and `tid2eid` as int64.

Stored dtypes (docs/model.md 6.2):
  BF16      embed, head, every RMSNorm weight, ffn.gate.weight, compressor wkv/wgate (main and indexer),
            indexer weights_proj
  F32       attn_sink, compressor ape (main and indexer), ffn.gate.bias, every hc_* tensor
  I64       ffn.gate.tid2eid (hash layers only; those layers have no gate.bias)
  F8_E4M3   wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared experts w1/w2/w3, mtp e_proj/h_proj,
            each with an F8_E8M0 `.scale` of shape [ceil(out/128), ceil(in/128)]
  I8        routed experts (packed FP4 e2m1, low nibble = even element) + F8_E8M0 `.scale` [out, in/32]
            (expert_format="mxfp4"); with expert_format="nvfp4" the backbone routed experts use NVIDIA's layout
            (U8 `weight`, F8_E4M3 `weight_scale` [out, in/16], F32 scalar `weight_scale_2` and `input_scale`), obtained
            with the lossless MXFP4 -> NVFP4 cast of docs/model.md 7.3; MTP experts stay MXFP4.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from dsv4_jax.config import ModelConfig, to_hf_config

# ---------------------------------------------------------------------------------------------------------------
# safetensors (plain numpy + json)
# ---------------------------------------------------------------------------------------------------------------

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}


def _tensor_bytes(dtype: str, arr: np.ndarray) -> bytes:
    """Little-endian raw bytes of `arr` interpreted as safetensors dtype `dtype`."""
    if dtype == "BF16":
        assert arr.dtype == ml_dtypes.bfloat16
        return np.ascontiguousarray(arr).view(np.uint16).astype("<u2").tobytes()
    if dtype == "F32":
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype == "I64":
        return np.ascontiguousarray(arr, dtype="<i8").tobytes()
    if dtype in ("F8_E4M3", "F8_E8M0", "U8", "I8"):
        assert arr.dtype.itemsize == 1, (dtype, arr.dtype)
        return np.ascontiguousarray(arr).view(np.uint8).tobytes()
    raise ValueError(f"unsupported dtype {dtype}")


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None):
    """Write {name: (safetensors_dtype, array)} as one safetensors file: u64 LE header length, JSON header, data."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        raw = _tensor_bytes(dtype, arr)
        assert len(raw) == _ITEMSIZE[dtype] * int(np.prod(arr.shape, dtype=np.int64)), name
        header[name] = {"dtype": dtype, "shape": [int(s) for s in arr.shape], "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-len(hbytes)) % 8)  # pad the header so the data section is 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for raw in blobs:
            f.write(raw)


def read_safetensors_raw(path: str) -> dict[str, tuple[str, list[int], bytes]]:
    """Read a safetensors file without any library: {name: (dtype_str, shape, raw_bytes)} (metadata dropped)."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], list(info["shape"]), data[base + b:base + e])
    return out


def read_checkpoint_raw(directory: str) -> dict[str, tuple[str, list[int], bytes]]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        out.update(read_safetensors_raw(os.path.join(directory, fn)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# formats: decoding (used by the tests and by the writer to produce the logical values)
# ---------------------------------------------------------------------------------------------------------------

FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e8m0_to_float(b: np.ndarray) -> np.ndarray:
    """E8M0 byte b -> 2^(b-127) (0xFF = NaN)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.float64)
    return np.where(b == 255, np.nan, np.exp2(b - 127.0))


def decode_raw(dtype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """Raw bytes -> numpy array: BF16/F32/F8_E4M3 as float64, F8_E8M0/I8/U8 as uint8 bytes, I64 as int64."""
    if dtype == "BF16":
        return np.frombuffer(raw, dtype="<u2").view(ml_dtypes.bfloat16).astype(np.float64).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float64).reshape(shape)
    if dtype == "F8_E4M3":
        return np.frombuffer(raw, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(shape)
    if dtype in ("F8_E8M0", "I8", "U8"):
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape).copy()
    if dtype == "I64":
        return np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(shape)
    raise ValueError(dtype)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """[out, in/2] bytes -> [out, in] e2m1 values (element 2k = low nibble, 2k+1 = high nibble)."""
    packed = np.asarray(packed, dtype=np.uint8)
    lo = FP4_VALUES[packed & 0xF]
    hi = FP4_VALUES[packed >> 4]
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.float64)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


def dequant_fp8_block(w: np.ndarray, scale_bytes: np.ndarray, block: int = 128) -> np.ndarray:
    """W[i,j] = w[i,j] * 2^(scale[i//128, j//128] - 127)."""
    s = e8m0_to_float(scale_bytes)
    s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:w.shape[0], :w.shape[1]]
    return np.asarray(w, dtype=np.float64) * s


def dequant_mxfp4(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    vals = unpack_fp4(packed)
    return vals * np.repeat(e8m0_to_float(scale_bytes), 32, axis=1)


def dequant_nvfp4(packed: np.ndarray, weight_scale: np.ndarray, weight_scale_2: float) -> np.ndarray:
    """weight_scale: float values of the F8_E4M3 block scales [out, in/16]."""
    vals = unpack_fp4(packed)
    return vals * np.repeat(np.asarray(weight_scale, np.float64), 16, axis=1) * float(weight_scale_2)


# ---------------------------------------------------------------------------------------------------------------
# quantizers (power-of-two scales)
# ---------------------------------------------------------------------------------------------------------------

def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Integer k with 2^k = 2^ceil(log2(amax/qmax)) (computed exactly with frexp)."""
    ratio = amax / qmax
    m, e = np.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def quantize_fp8_block(w: np.ndarray, block: int = 128):
    """[out, in] float -> (e4m3 array, E8M0 scale bytes [ceil(out/128), ceil(in/128)], dequantized float64)."""
    out_dim, in_dim = w.shape
    bo, bi = -(-out_dim // block), -(-in_dim // block)
    pad = np.zeros((bo * block, bi * block))
    pad[:out_dim, :in_dim] = np.abs(w)
    amax = pad.reshape(bo, block, bi, block).max(axis=(1, 3))
    amax = np.maximum(amax, 1e-30)
    k = _pow2_exponent(amax, 448.0)
    assert np.all((k + 127 >= 0) & (k + 127 <= 254))
    s_full = np.repeat(np.repeat(np.exp2(k.astype(np.float64)), block, 0), block, 1)[:out_dim, :in_dim]
    q = np.clip(w / s_full, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    scale_bytes = (k + 127).astype(np.uint8)
    deq = q.astype(np.float64) * s_full
    return q, scale_bytes, deq


def fp4_codes(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the e2m1 grid; returns 4-bit codes (bit 3 = sign). |y| > 6 saturates."""
    a = np.minimum(np.abs(y), 6.0)
    thresholds = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    upper_even = (False, True, False, True, False, True, False)  # tie goes up iff the upper code is even
    code = np.zeros(a.shape, dtype=np.uint8)
    for t, ev in zip(thresholds, upper_even):
        code += ((a > t) | ((a == t) & ev)).astype(np.uint8)
    sign = (np.signbit(y) & (code > 0)).astype(np.uint8)  # no -0 codes for exact zeros
    return code | (sign << 3)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def quantize_mxfp4(w: np.ndarray):
    """[out, in] -> (packed uint8 [out, in/2], E8M0 scale bytes [out, in/32], dequantized float64)."""
    out_dim, in_dim = w.shape
    assert in_dim % 32 == 0
    blocks = w.reshape(out_dim, in_dim // 32, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), 6.0 * 2.0 ** -126)
    k = _pow2_exponent(amax, 6.0)
    assert np.all((k + 127 >= 0) & (k + 127 <= 254))
    codes = fp4_codes(blocks / np.exp2(k.astype(np.float64))[..., None]).reshape(out_dim, in_dim)
    packed = pack_fp4(codes)
    scale_bytes = (k + 127).astype(np.uint8)
    return packed, scale_bytes, dequant_mxfp4(packed, scale_bytes)


def mxfp4_to_nvfp4(packed: np.ndarray, scale_bytes: np.ndarray):
    """Lossless cast (docs/model.md 7.3): -> (packed, e4m3 block scales [out, in/16], weight_scale_2 float32
    scalar)."""
    k = scale_bytes.astype(np.int64) - 127
    m = int(k.max()) - 8
    assert int(k.max() - k.min()) <= 17, "MXFP4 -> NVFP4 cast not exact for this tensor"
    bs = np.exp2((k - m).astype(np.float64))
    bs_e4m3 = np.repeat(bs, 2, axis=1).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(bs_e4m3.astype(np.float64), np.repeat(bs, 2, axis=1))
    return packed, bs_e4m3, np.float32(2.0 ** m)


def _bf16(x: np.ndarray):
    q = np.asarray(x, np.float64).astype(ml_dtypes.bfloat16)
    return q, q.astype(np.float64)


def _f32(x: np.ndarray):
    q = np.asarray(x, np.float64).astype(np.float32)
    return q, q.astype(np.float64)


# ---------------------------------------------------------------------------------------------------------------
# tensor inventory
# ---------------------------------------------------------------------------------------------------------------

def _block_specs(cfg: ModelConfig, prefix: str, layer_id: int, is_mtp: bool):
    """[(name, kind, shape, init)] for one Block. kind in {bf16, f32, fp8, fp4, i64}."""
    D, H, hd, n = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.hc_mult
    mix, hc_dim = cfg.hc_mix_dim, cfg.hc_dim
    G, R, ql = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    E, inter = cfg.n_routed_experts, cfg.moe_inter_dim
    shared_inter = cfg.n_shared_experts * inter
    ratio = cfg.compress_ratios[layer_id]
    p = prefix
    s = [
        (p + "attn_norm.weight", "bf16", (D,), "norm"),
        (p + "ffn_norm.weight", "bf16", (D,), "norm"),
    ]
    for site in ("attn", "ffn"):
        s += [(p + f"hc_{site}_fn", "f32", (mix, hc_dim), "hc_fn"),
              (p + f"hc_{site}_base", "f32", (mix,), "hc_base"),
              (p + f"hc_{site}_scale", "f32", (3,), "hc_scale")]
    s += [
        (p + "attn.attn_sink", "f32", (H,), "sink"),
        (p + "attn.q_norm.weight", "bf16", (ql,), "norm"),
        (p + "attn.kv_norm.weight", "bf16", (hd,), "norm"),
        (p + "attn.wq_a.weight", "fp8", (ql, D), "linear"),
        (p + "attn.wq_b.weight", "fp8", (H * hd, ql), "linear"),
        (p + "attn.wkv.weight", "fp8", (hd, D), "linear"),
        (p + "attn.wo_a.weight", "fp8", (G * R, H * hd // G), "linear"),
        (p + "attn.wo_b.weight", "fp8", (D, G * R), "linear"),
    ]
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        s += [(p + "attn.compressor.ape", "f32", (ratio, coff * hd), "ape"),
              (p + "attn.compressor.wkv.weight", "bf16", (coff * hd, D), "linear"),
              (p + "attn.compressor.wgate.weight", "bf16", (coff * hd, D), "linear"),
              (p + "attn.compressor.norm.weight", "bf16", (hd,), "norm")]
        if ratio == 4:
            IH, ID = cfg.index_n_heads, cfg.index_head_dim
            s += [(p + "attn.indexer.wq_b.weight", "fp8", (IH * ID, ql), "linear"),
                  (p + "attn.indexer.weights_proj.weight", "bf16", (IH, D), "linear"),
                  (p + "attn.indexer.compressor.ape", "f32", (4, 2 * ID), "ape"),
                  (p + "attn.indexer.compressor.wkv.weight", "bf16", (2 * ID, D), "linear"),
                  (p + "attn.indexer.compressor.wgate.weight", "bf16", (2 * ID, D), "linear"),
                  (p + "attn.indexer.compressor.norm.weight", "bf16", (ID,), "norm")]
    s.append((p + "ffn.gate.weight", "bf16", (E, D), "linear"))
    if (not is_mtp) and cfg.is_hash_layer(layer_id):
        s.append((p + "ffn.gate.tid2eid", "i64", (cfg.vocab_size, cfg.n_activated_experts), "tid2eid"))
    else:
        s.append((p + "ffn.gate.bias", "f32", (E,), "gate_bias"))
    s += [(p + "ffn.shared_experts.w1.weight", "fp8", (shared_inter, D), "linear"),
          (p + "ffn.shared_experts.w3.weight", "fp8", (shared_inter, D), "linear"),
          (p + "ffn.shared_experts.w2.weight", "fp8", (D, shared_inter), "linear")]
    for e in range(E):
        s += [(p + f"ffn.experts.{e}.w1.weight", "fp4", (inter, D), "linear"),
              (p + f"ffn.experts.{e}.w3.weight", "fp4", (inter, D), "linear"),
              (p + f"ffn.experts.{e}.w2.weight", "fp4", (D, inter), "linear")]
    return s


def tensor_specs(cfg: ModelConfig):
    """Every logical tensor of the checkpoint: [(name, kind, shape, init)]."""
    D, n, V = cfg.dim, cfg.hc_mult, cfg.vocab_size
    specs = [("embed.weight", "bf16", (V, D), "embed"),
             ("head.weight", "bf16", (V, D), "linear"),
             ("norm.weight", "bf16", (D,), "norm"),
             ("hc_head_fn", "f32", (n, cfg.hc_dim), "hc_fn"),
             ("hc_head_base", "f32", (n,), "hc_base"),
             ("hc_head_scale", "f32", (1,), "hc_scale")]
    for layer in range(cfg.n_layers):
        specs += _block_specs(cfg, f"layers.{layer}.", layer, is_mtp=False)
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        specs += _block_specs(cfg, p, cfg.n_layers + k, is_mtp=True)
        specs += [(p + "e_proj.weight", "fp8", (D, D), "linear"),
                  (p + "h_proj.weight", "fp8", (D, D), "linear"),
                  (p + "enorm.weight", "bf16", (D,), "norm"),
                  (p + "hnorm.weight", "bf16", (D,), "norm"),
                  (p + "norm.weight", "bf16", (D,), "norm"),
                  (p + "hc_head_fn", "f32", (n, cfg.hc_dim), "hc_fn"),
                  (p + "hc_head_base", "f32", (n,), "hc_base"),
                  (p + "hc_head_scale", "f32", (1,), "hc_scale")]
    return specs


def _init(rng: np.random.Generator, init: str, shape, cfg: ModelConfig) -> np.ndarray:
    if init == "linear":
        return rng.standard_normal(shape) / math.sqrt(shape[-1])
    if init == "embed":
        return rng.standard_normal(shape)
    if init == "norm":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if init == "hc_fn":
        return 1e-2 * rng.standard_normal(shape)
    if init == "hc_base":
        return 0.5 * rng.standard_normal(shape)
    if init == "hc_scale":
        return rng.uniform(0.5, 1.5, shape)
    if init == "sink":
        return rng.standard_normal(shape)
    if init == "ape":
        return 0.1 * rng.standard_normal(shape)
    if init == "gate_bias":
        return 0.1 * rng.standard_normal(shape)
    if init == "tid2eid":
        V, K = shape
        return np.argsort(rng.random((V, cfg.n_routed_experts)), axis=1)[:, :K].astype(np.int64)
    raise ValueError(init)


# ---------------------------------------------------------------------------------------------------------------
# writer
# ---------------------------------------------------------------------------------------------------------------

def write_checkpoint(directory: str, cfg: ModelConfig, seed: int = 0, num_shards: int = 1,
                     expert_format: str = "mxfp4", write_hf_quant_config: bool = True) -> dict[str, np.ndarray]:
    """Write a random checkpoint of `cfg` in the official format and return its logical (dequantized) weights.

    expert_format: "mxfp4" (official DeepSeek release) or "nvfp4" (NVIDIA re-quantization: backbone routed experts
    as U8 weight + F8_E4M3 weight_scale per 16 + F32 scalar weight_scale_2 / input_scale; MTP experts stay MXFP4).
    With "nvfp4" and write_hf_quant_config, an `hf_quant_config.json` in ModelOpt style is also written (its exact
    schema is not pinned down by the spec; loaders should rely on tensor names/dtypes).
    """
    if expert_format not in ("mxfp4", "nvfp4"):
        raise ValueError(expert_format)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    stored: dict[str, tuple[str, np.ndarray]] = {}
    logical: dict[str, np.ndarray] = {}
    nvfp4_layers = []
    for name, kind, shape, init in tensor_specs(cfg):
        x = _init(rng, init, shape, cfg)
        if kind == "bf16":
            q, logical[name] = _bf16(x)
            stored[name] = ("BF16", q)
        elif kind == "f32":
            q, logical[name] = _f32(x)
            stored[name] = ("F32", q)
        elif kind == "i64":
            stored[name] = ("I64", x)
            logical[name] = x.astype(np.int64)
        elif kind == "fp8":
            q, sb, logical[name] = quantize_fp8_block(x)
            stored[name] = ("F8_E4M3", q)
            stored[name[:-len("weight")] + "scale"] = ("F8_E8M0", sb)
        elif kind == "fp4":
            packed, sb, logical[name] = quantize_mxfp4(x)
            base = name[:-len("weight")]
            if expert_format == "nvfp4" and name.startswith("layers."):
                packed, bs, ws2 = mxfp4_to_nvfp4(packed, sb)
                stored[name] = ("U8", packed)
                stored[base + "weight_scale"] = ("F8_E4M3", bs)
                stored[base + "weight_scale_2"] = ("F32", np.asarray(ws2, np.float32).reshape(()))
                stored[base + "input_scale"] = ("F32", np.asarray(rng.uniform(0.5, 2.0) / (6 * 448), np.float32).reshape(()))
                nvfp4_layers.append(base[:-1])
            else:
                stored[name] = ("I8", packed.view(np.int8))
                stored[base + "scale"] = ("F8_E8M0", sb)
        else:
            raise ValueError(kind)

    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(to_hf_config(cfg), f, indent=2)
    if expert_format == "nvfp4" and write_hf_quant_config:
        qc = {"producer": {"name": "modelopt", "version": "dsv4-nvfp4-experts"},
              "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                               "quantized_layers": {n_: {"quant_algo": "NVFP4", "group_size": 16}
                                                    for n_ in nvfp4_layers}}}
        with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
            json.dump(qc, f, indent=2)

    names = sorted(stored)
    total = sum(len(_tensor_bytes(*stored[n_])) for n_ in names)
    if num_shards <= 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), stored, {"format": "pt"})
    else:
        num_shards = min(num_shards, len(names))
        # contiguous chunks of the sorted names with roughly equal byte counts, every shard non-empty
        sizes = np.array([_ITEMSIZE[stored[n_][0]] * int(np.prod(stored[n_][1].shape, dtype=np.int64)) for n_ in names])
        cum = np.cumsum(sizes)
        bounds = [0]
        for i in range(1, num_shards):
            b = int(np.searchsorted(cum, total * i / num_shards))
            b = max(b, bounds[-1] + 1)
            b = min(b, len(names) - (num_shards - i))
            bounds.append(b)
        bounds.append(len(names))
        weight_map = {}
        for i in range(num_shards):
            fn = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            chunk = {n_: stored[n_] for n_ in names[bounds[i]:bounds[i + 1]]}
            write_safetensors(os.path.join(directory, fn), chunk, {"format": "pt"})
            weight_map.update({n_: fn for n_ in chunk})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return logical
