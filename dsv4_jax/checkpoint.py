"""Official DeepSeek-V4 checkpoints: safetensors reading (our own header parser over mmap), validation against
the weight description, and assembly of the parameter tree with every weight kept in its stored format.

We parse safetensors ourselves because the format is tiny (8-byte header length, JSON header, raw bytes) and the
stock numpy loader has no story for F8_E8M0 or packed FP4; E8M0 bytes stay uint8 and are decoded as 2^(b-127)
only inside the matmul.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import ModelConfig, load_hf_config
from .params import disk_tensor_specs, expert_disk_names, tree_set, weight_specs
from .quant.formats import Fp8BlockWeight, Mxfp4Weight

# safetensors dtype -> numpy dtype of the raw storage
STORAGE_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I8": np.uint8, "U8": np.uint8,  # I8 holds packed FP4 pairs: read bytes
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8,            # E8M0: raw exponent bytes
}


class CheckpointError(ValueError):
    """A checkpoint that does not match what the model expects (one line naming the tensor)."""


class SafetensorsFile:
    """Lazy reader of one .safetensors file: header parsed at open, tensors mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
        self.data_start = 8 + header_len
        header.pop("__metadata__", None)
        self.entries = header
        self._map = None

    def names(self):
        return self.entries.keys()

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        entry = self.entries[name]
        return entry["dtype"], tuple(entry["shape"])

    def read(self, name: str) -> np.ndarray:
        dtype, shape = self.info(name)
        if dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = self.entries[name]["data_offsets"]
        raw = self._map[self.data_start + begin:self.data_start + end]
        return raw.view(STORAGE_DTYPES[dtype]).reshape(shape)


def open_checkpoint(directory: str) -> dict[str, SafetensorsFile]:
    """Map every tensor name to its file (sharded via model.safetensors.index.json, or single files)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (expected an official DeepSeek-V4 checkpoint)")
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {fname: SafetensorsFile(os.path.join(directory, fname)) for fname in sorted(set(weight_map.values()))}
        by_name = {}
        for name, fname in weight_map.items():
            if name not in files[fname].entries:
                raise CheckpointError(f"{fname}: index lists tensor {name} but the file does not hold it")
            by_name[name] = files[fname]
        return by_name
    paths = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    if not paths:
        raise CheckpointError(f"{directory}: no *.safetensors files and no model.safetensors.index.json")
    by_name = {}
    for p in paths:
        sf = SafetensorsFile(os.path.join(directory, p))
        for name in sf.names():
            by_name[name] = sf
    return by_name


def detect_expert_format(names) -> str:
    return "nvfp4" if any(n.endswith(".weight_scale_2") for n in names) else "mxfp4"


def validate(cfg: ModelConfig, tensors: dict[str, SafetensorsFile], expert_format: str) -> None:
    expected = disk_tensor_specs(cfg, expert_format)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]} (expected {expected[missing[0]][0]} "
                              f"{list(expected[missing[0]][1])}; {len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)")
    for name, (dtype, shape) in expected.items():
        found = tensors[name].info(name)
        if found != (dtype, shape):
            raise CheckpointError(f"tensor {name}: expected {dtype} {list(shape)}, found {found[0]} {list(found[1])}")


def load_params(directory: str, progress: Callable[[int, int], None] | None = None):
    """Read an official checkpoint directory. Returns (config, parameter tree with stored formats)."""
    cfg = load_hf_config(directory)
    tensors = open_checkpoint(directory)
    expert_format = detect_expert_format(tensors)
    if expert_format == "nvfp4":
        raise NotImplementedError("NVFP4 expert checkpoints are not supported yet")
    validate(cfg, tensors, expert_format)

    def read(name):
        return tensors[name].read(name)

    specs = weight_specs(cfg)
    tree: dict = {}
    for done, spec in enumerate(specs):
        if spec.fmt in ("bf16", "f32"):
            value = jnp.asarray(read(spec.name))
        elif spec.fmt == "i64":
            ids = read(spec.name)
            if ids.min() < 0 or ids.max() >= cfg.n_routed_experts:
                raise CheckpointError(f"tensor {spec.name}: expert ids outside [0, {cfg.n_routed_experts})")
            value = jnp.asarray(ids.astype(np.int32))
        elif spec.fmt == "fp8":
            value = Fp8BlockWeight(jnp.asarray(read(spec.name)), jnp.asarray(read(spec.name[:-6] + "scale")))
        else:
            names = [expert_disk_names(spec, e) for e in range(spec.shape[0])]
            value = Mxfp4Weight(jnp.asarray(np.stack([read(n) for n in names])),
                                jnp.asarray(np.stack([read(n[:-6] + "scale") for n in names])))
        tree_set(tree, spec.name, value)
        if progress is not None:
            progress(done + 1, len(specs))
    return cfg, tree
