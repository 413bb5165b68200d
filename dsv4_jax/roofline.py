"""The floor of a decode step and the work of a prefill: bytes a step must read, FLOPs a prompt must do.

    r = dsv4_jax.roofline(dsv4_jax.presets.flash(), batch=1, context=4096)
    print(r.table()); r.seconds(bandwidth=4.0e12)

A decode step at batch B must read, at least once: every attention, compressor, indexer, mHC, router and shared
expert weight of the backbone; the head; B embedding rows; of each layer's routed expert stack the experts its
B tokens pick (expected fraction of distinct experts 1 - (1 - k/E)^B for k of E experts picked per token, uniform
routing); and the part of the decode state its attention reads at that context (the window ring, the compressed
entries an HCA layer attends to, a CSA layer's indexer keys and its top-k selected entries, the compressors'
pending tokens). Writes (one new entry per layer) are negligible and not counted. The MTP block is counted only
with `mtp=True` (it runs when drafting).

Bytes come from the weight description (params.weight_specs) in the stored formats, never from arrays, so Flash
and Pro are counted without allocating anything.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from .config import ModelConfig
from .numerics.kv_cache import entry_bytes
from .ops.compressor_step import init_compressor_state
from .params import WeightSpec, weight_specs
from .numerics.formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK

# Parts of the model a decode step reads, in table order.
WEIGHT_PARTS = ("attention", "compressor", "indexer", "mhc", "norms", "router", "shared_experts", "routed_experts",
                "embed", "head", "mtp")
STATE_PARTS = ("window_kv", "compressed_kv", "index_keys", "compressor_state")
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def spec_bytes(spec: WeightSpec) -> int:
    """Bytes of one weight as stored in device memory (block scales and global scales included)."""
    n = math.prod(spec.shape)
    if spec.fmt == "bf16":
        return 2 * n
    if spec.fmt in ("f32", "i64"):          # hash-routing tables are kept as int32
        return 4 * n
    if spec.fmt == "fp8":
        rows, cols = spec.shape
        return n + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    lead = math.prod(spec.shape[:-2])
    if spec.fmt == "mxfp4":
        return n // 2 + n // MXFP4_BLOCK
    if spec.fmt == "nvfp4":
        return n // 2 + n // NVFP4_BLOCK + 4 * lead + (4 * lead if spec.input_scale else 0)
    raise ValueError(f"{spec.name}: unknown format {spec.fmt!r}")


def weight_part(name: str) -> str:
    """Which part of the model (WEIGHT_PARTS) an official weight name belongs to."""
    if name.startswith("mtp."):
        return "mtp"
    if name in ("embed.weight", "head.weight"):
        return name.split(".")[0]
    leaf = name.split(".")[-1]
    if ".attn.indexer." in name:
        return "indexer"
    if ".attn.compressor." in name:
        return "compressor"
    if ".attn." in name and not name.endswith("_norm.weight"):
        return "attention"
    if ".ffn.gate." in name:
        return "router"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".ffn.experts." in name:
        return "routed_experts"
    if leaf.startswith("hc_") or name.startswith("hc_"):
        return "mhc"
    return "norms"


def weight_bytes_by_part(cfg: ModelConfig, stored: dict[str, str] | None = None) -> dict[str, int]:
    """Bytes of every weight, summed per part (everything the model holds; no batch involved)."""
    out = dict.fromkeys(WEIGHT_PARTS, 0)
    for spec in weight_specs(cfg, stored):
        out[weight_part(spec.name)] += spec_bytes(spec)
    return out


def distinct_expert_fraction(batch: int, k: int, n_experts: int) -> float:
    """Expected fraction of E experts picked by at least one of `batch` tokens that each pick k distinct experts
    uniformly: 1 - (1 - k/E)^B."""
    return 1.0 - (1.0 - k / n_experts) ** batch


@dataclasses.dataclass
class DecodeRoofline:
    batch: int
    context: int
    weights: dict[str, float]      # bytes read per step, by part (routed experts: expected)
    state: dict[str, float]        # bytes of decode state read per step, by buffer kind

    @property
    def total_bytes(self) -> float:
        return sum(self.weights.values()) + sum(self.state.values())

    def seconds(self, bandwidth: float) -> float:
        """The step's floor at `bandwidth` bytes/s."""
        return self.total_bytes / bandwidth

    def table(self) -> str:
        lines = [f"decode step floor, batch {self.batch}, context {self.context}: {self.total_bytes / 1e9:.3f} GB"]
        for part, v in list(self.weights.items()) + list(self.state.items()):
            if v:
                lines.append(f"  {part:<17} {v / 1e6:12.2f} MB  {100 * v / self.total_bytes:5.1f}%")
        return "\n".join(lines)


def _state_read(cfg: ModelConfig, ratio: int, batch: int, context: int, item: int,
                kv_cache_dtype=None) -> dict[str, float]:
    read = dict.fromkeys(STATE_PARTS, 0.0)
    kv_entry = entry_bytes(cfg.head_dim, cfg.rope_head_dim, item, "kv", kv_cache_dtype)
    index_entry = entry_bytes(cfg.index_head_dim, cfg.rope_head_dim, item, "index", kv_cache_dtype)
    read["window_kv"] = batch * min(context, cfg.window_size) * kv_entry
    if ratio == 0:
        return read
    entries = context // ratio
    pending = [init_compressor_state(1, ratio, cfg.head_dim)]
    if ratio == 4:
        pending.append(init_compressor_state(1, ratio, cfg.index_head_dim))
        read["index_keys"] = batch * entries * index_entry
        read["compressed_kv"] = batch * min(cfg.index_topk, entries) * kv_entry
    else:
        read["compressed_kv"] = batch * entries * kv_entry
    leaves = jax.tree_util.tree_leaves(pending)
    read["compressor_state"] = batch * sum(x.size * x.dtype.itemsize for x in leaves)
    return read


def _weight_reads(cfg: ModelConfig, batch: int, stored, mtp: bool):
    """(spec, its part, bytes a batch-`batch` step reads of it) for every weight a decode step reads."""
    fraction = distinct_expert_fraction(batch, cfg.n_activated_experts, cfg.n_routed_experts)
    for spec in weight_specs(cfg, stored):
        part = weight_part(spec.name)
        size = spec_bytes(spec)
        if part == "mtp" and not mtp:
            continue
        if ".experts." in spec.name:
            size *= fraction
        elif spec.name == "embed.weight":
            size = min(size, batch * cfg.dim * 2)
        elif spec.name.endswith("gate.tid2eid"):
            size = min(size, batch * cfg.n_activated_experts * 4)
        yield spec, part, size


def _state_reads(cfg: ModelConfig, batch: int, context: int, dtype: str, mtp: bool, kv_cache_dtype):
    """(buffer kind, bytes) of the decode state a step reads, layer by layer."""
    layers = list(range(cfg.n_layers)) + ([cfg.n_layers + k for k in range(cfg.n_mtp_layers)] if mtp else [])
    for layer in layers:
        yield from _state_read(cfg, cfg.compress_ratios[layer], batch, context, _DTYPE_BYTES[dtype],
                               kv_cache_dtype).items()


def _check(batch: int, context: int) -> None:
    if batch < 1 or context < 0:
        raise ValueError(f"batch must be >= 1 and context >= 0, got {batch} and {context}")


def roofline(cfg: ModelConfig, batch: int, context: int, dtype: str = "bfloat16",
             stored: dict[str, str] | None = None, mtp: bool = False, kv_cache_dtype=None) -> DecodeRoofline:
    """Bytes a batch-`batch` decode step must read with `context` tokens already in each sequence's state
    (`dtype`: the decode state's element type; `kv_cache_dtype` "fp8": its entries stored compact)."""
    _check(batch, context)
    weights = dict.fromkeys(WEIGHT_PARTS, 0.0)
    for _, part, size in _weight_reads(cfg, batch, stored, mtp):
        weights[part] += size
    state = dict.fromkeys(STATE_PARTS, 0.0)
    for kind, v in _state_reads(cfg, batch, context, dtype, mtp, kv_cache_dtype):
        state[kind] += v
    return DecodeRoofline(batch, context, weights, state)


# The op family (hlo_census.FAMILIES: what a profile reports kernel time under) whose kernels read each part.
_FAMILY_OF_PART = {"attention": "attention", "compressor": "compressor", "indexer": "indexer", "mhc": "mhc",
                   "norms": "norm/rope", "router": "router", "embed": "embed", "head": "bf16 matmul",
                   "shared_experts": "fp8 matmul", "routed_experts": "fp4 matmul", "mtp": "other"}
_FAMILY_OF_STATE = {"window_kv": "attention", "compressed_kv": "attention", "index_keys": "indexer",
                    "compressor_state": "compressor"}


def bytes_by_family(cfg: ModelConfig, batch: int, context: int, dtype: str = "bfloat16",
                    stored: dict[str, str] | None = None, kv_cache_dtype=None) -> dict[str, float]:
    """The floor's bytes (`roofline`, without the MTP block) by the op family whose kernels read them: a quantized
    weight under its matmul kind ("fp8 matmul", "fp4 matmul"), a bf16 matrix multiplied through ops/matmul.linear
    (the head, the compressors' and the indexer's projections) under "bf16 matmul", the router's gate under
    "router", the rest under its part's family; the decode state under the family that reads it. Beside a profile's
    kernel time by family (bench --profile) it says how far each family is from its bytes."""
    _check(batch, context)
    out: dict[str, float] = {}
    for spec, part, size in _weight_reads(cfg, batch, stored, False):
        if spec.fmt == "fp8":
            family = "fp8 matmul"
        elif spec.fmt in ("mxfp4", "nvfp4"):
            family = "fp4 matmul"
        elif spec.fmt == "bf16" and len(spec.shape) == 2 and part in ("compressor", "indexer", "head"):
            family = "bf16 matmul"
        else:
            family = _FAMILY_OF_PART[part]
        out[family] = out.get(family, 0.0) + size
    for kind, v in _state_reads(cfg, batch, context, dtype, False, kv_cache_dtype):
        out[_FAMILY_OF_STATE[kind]] = out.get(_FAMILY_OF_STATE[kind], 0.0) + v
    return out


def _matmul_macs_per_token(cfg: ModelConfig) -> float:
    """Multiply-accumulates of every weight a token passes through in the backbone (k routed experts of each
    layer, every other projection once; embeddings are gathers, the head is counted separately)."""
    macs = 0.0
    for spec in weight_specs(cfg):
        part = weight_part(spec.name)
        if part in ("mtp", "embed", "head", "norms") or len(spec.shape) < 2 or spec.fmt == "i64":
            continue
        n = math.prod(spec.shape)
        if part == "routed_experts":
            n = n // cfg.n_routed_experts * cfg.n_activated_experts
        macs += n
    return macs


def attention_flops(cfg: ModelConfig, positions: np.ndarray) -> float:
    """FLOPs of the attention score and value products (and the indexer's scores) of query tokens at `positions`
    (each sees itself and everything before it), summed over the backbone layers."""
    seen = np.asarray(positions, np.int64) + 1
    heads, hd = cfg.n_heads, cfg.head_dim
    total = 0.0
    for layer in range(cfg.n_layers):
        ratio = cfg.compress_ratios[layer]
        keys = np.minimum(seen, cfg.window_size).astype(np.float64)
        if ratio == 4:
            entries = (seen // 4).astype(np.float64)
            total += float(np.sum(2.0 * cfg.index_n_heads * cfg.index_head_dim * entries))
            keys = keys + np.minimum(entries, cfg.index_topk)
        elif ratio > 0:
            keys = keys + seen // ratio
        total += float(np.sum(4.0 * heads * hd * keys))     # q.k and p.v
    return total


def prefill_flops(cfg: ModelConfig, tokens: int, batch: int = 1, start: int = 0) -> float:
    """FLOPs of consuming `tokens` tokens per sequence from position `start`: every projection and expert matmul,
    the attention products, and the head for each sequence's last token."""
    positions = np.arange(start, start + tokens)
    matmul = 2.0 * _matmul_macs_per_token(cfg) * tokens
    head = 2.0 * cfg.vocab_size * cfg.dim
    return batch * (matmul + attention_flops(cfg, positions) + head)
