"""Official DeepSeek-V4 checkpoints: safetensors reading (our own header parser over mmap), validation against
the weight description, and assembly of the parameter tree with every weight kept in its stored format.

We parse safetensors ourselves because the format is tiny (8-byte header length, JSON header, raw bytes) and the
stock numpy loader has no story for F8_E8M0 or packed FP4; E8M0 bytes stay uint8 and are decoded as 2^(b-127)
only inside the matmul.

Routed experts come in either of two layouts, detected per expert stack (one layer's w1, w2 or w3) from the tensors
present: DeepSeek's MXFP4 (`weight` I8 + `scale` F8_E8M0 per 32) or NVIDIA's NVFP4 (docs/model.md 6.6: `weight` U8,
`weight_scale` F8_E4M3 per 16, `weight_scale_2` F32 scalar, optional `input_scale` F32 scalar). An
`hf_quant_config.json`, when present, is cross-checked against the tensors. Either way the bytes go to the
device as stored (Mxfp4Weight / Nvfp4Weight); nothing is dequantized or requantized.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import ModelConfig, load_hf_config
from .params import (WeightSpec, disk_tensor_specs, expert_disk_names, init_params, is_expert_stack, tree_get,
                     tree_set, weight_specs)
from .numerics.formats import NVFP4_BLOCK, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from .numerics.nvfp4 import quantize_nvfp4
from .sharding import expert_slice, param_shardings
from .ops.matmul_kernels import nvfp4_weights_kernels_approximate

# safetensors dtype -> numpy dtype of the raw storage
STORAGE_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I8": np.uint8, "U8": np.uint8,  # I8 holds packed FP4 pairs: read bytes
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8,            # E8M0: raw exponent bytes
}


MAX_HEADER_BYTES = 100_000_000       # the safetensors format's limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint that does not match what the model expects (one line naming the tensor)."""


class SafetensorsFile:
    """Lazy reader of one .safetensors file: header parsed at open, tensors mapped on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                # checked before reading: a corrupt length would otherwise read a whole multi-GB shard first
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    raise CheckpointError(f"{path}: header length {header_len} exceeds the file ({size} bytes) or "
                                          f"the format's {MAX_HEADER_BYTES} byte limit: not a safetensors file")
                header = json.loads(f.read(header_len))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
        entries = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
        if entries is None or not all(isinstance(v, dict) and {"dtype", "shape", "data_offsets"} <= v.keys()
                                      for v in entries.values()):
            raise CheckpointError(f"{path}: the header is not a JSON object of tensor entries (dtype, shape, "
                                  f"data_offsets): not a safetensors file")
        self.data_start = 8 + header_len
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        self._map = None

    def names(self):
        return self.entries.keys()

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        entry = self.entries[name]
        return entry["dtype"], tuple(entry["shape"])

    def nbytes(self, name: str) -> int:
        begin, end = self.entries[name]["data_offsets"]
        return end - begin

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (uint8, memory-mapped)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = self.entries[name]["data_offsets"]
        return self._map[self.data_start + begin:self.data_start + end]

    def read(self, name: str) -> np.ndarray:
        dtype, shape = self.info(name)
        if dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        raw = self.raw(name)
        expected = math.prod(shape) * np.dtype(STORAGE_DTYPES[dtype]).itemsize
        if raw.size != expected:
            raise CheckpointError(f"{self.path}: tensor {name} holds {raw.size} bytes, {dtype} {list(shape)} "
                                  f"needs {expected}")
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


# ---- expert formats -----------------------------------------------------------------------------------------

QUANT_CONFIG = "hf_quant_config.json"
_EXPERT_MODULE = re.compile(r"^(?:model\.)?((?:layers|mtp)\.\d+\.ffn\.experts)(?:\.(\d+)\.(w[123]))?$")


def _expert_stacks(cfg: ModelConfig) -> list[WeightSpec]:
    return [spec for spec in weight_specs(cfg) if is_expert_stack(spec)]


def _stem(name: str) -> str:
    return name[:-len("weight")]


def _stack_format(spec: WeightSpec, tensors) -> str:
    """'nvfp4' or 'mxfp4' for one stack, uniform over its experts (absent tensors count as MXFP4; validation
    then names what is missing)."""
    formats = []
    for e in range(spec.shape[0]):
        stem = _stem(expert_disk_names(spec, e))
        formats.append("nvfp4" if (stem + "weight_scale_2") in tensors or (stem + "weight_scale") in tensors
                       else "mxfp4")
    if len(set(formats)) > 1:
        odd = formats.index("nvfp4" if formats[0] == "mxfp4" else "mxfp4")
        raise CheckpointError(f"{expert_disk_names(spec, odd)}: {formats[odd].upper()} tensors, but expert 0 of "
                              f"this layer is {formats[0].upper()} (a layer's experts must share one format)")
    return formats[0]


def read_quant_config(directory: str) -> dict | None:
    path = os.path.join(directory, QUANT_CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            qc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return qc


def _declared_nvfp4(qc: dict, directory: str) -> set[str]:
    """Expert stacks ('layers.L.ffn.experts.w1.weight' ...) that hf_quant_config.json declares NVFP4. Rejects
    algorithms and block sizes this loader cannot honour; keys it does not recognise are left to the tensors."""
    where = os.path.join(directory, QUANT_CONFIG)
    top = qc.get("quantization", qc)
    algo = top.get("quant_algo")
    if algo == "NVFP4":
        group = top.get("group_size", NVFP4_BLOCK)
        if group != NVFP4_BLOCK:
            raise CheckpointError(f"{where}: NVFP4 group_size {group}, only {NVFP4_BLOCK} is supported")
        return set()
    if algo not in (None, "MIXED_PRECISION"):
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported (expected NVFP4 routed experts, "
                              f"'MIXED_PRECISION' or 'NVFP4')")
    declared = set()
    for key, entry in (top.get("quantized_layers") or {}).items():
        if not isinstance(entry, dict) or entry.get("quant_algo") != "NVFP4":
            continue
        group = entry.get("group_size", entry.get("awq_block_size", NVFP4_BLOCK))
        if group != NVFP4_BLOCK:
            raise CheckpointError(f"{where}: {key} has NVFP4 group size {group}, only {NVFP4_BLOCK} is supported")
        match = _EXPERT_MODULE.match(key)
        if match is None:
            if re.match(r"^(?:model\.)?(?:layers|mtp)\.\d+\.", key):
                raise CheckpointError(f"{where}: declares {key} NVFP4; only routed experts may be NVFP4")
            continue
        module, _, proj = match.groups()
        for p in ((proj,) if proj else ("w1", "w2", "w3")):
            declared.add(f"{module}.{p}.weight")
    return declared


def detect_expert_formats(cfg: ModelConfig, tensors, directory: str | None = None) -> dict[str, str]:
    """Expert stack name ('layers.L.ffn.experts.wN.weight') -> 'mxfp4' or 'nvfp4', from the tensors present,
    cross-checked against hf_quant_config.json when the directory has one."""
    packed = [n for n in tensors if n.endswith((".weight_packed", ".weight_global_scale"))]
    if packed:
        raise CheckpointError(f"tensor {packed[0]}: compressed-tensors NVFP4 layout is not supported (expected "
                              f"NVIDIA ModelOpt names weight / weight_scale / weight_scale_2)")
    formats = {spec.name: _stack_format(spec, tensors) for spec in _expert_stacks(cfg)}
    qc = read_quant_config(directory) if directory else None
    if qc is not None:
        for name in sorted(_declared_nvfp4(qc, directory)):
            if formats.get(name, "nvfp4") != "nvfp4":
                raise CheckpointError(f"{QUANT_CONFIG} declares {name.rsplit('.', 2)[0]} NVFP4 but the checkpoint "
                                      f"stores MXFP4 tensors ({_stem(name.replace('.experts.', '.experts.0.'))}"
                                      f"scale)")
    return formats


def stored_formats(cfg: ModelConfig, tensors, directory: str | None = None,
                   quantize_head: bool = False) -> dict[str, str]:
    """The stored formats of a checkpoint that differ from the description's defaults, from its safetensors
    headers alone (params.weight_specs' `stored`): NVFP4 expert stacks, with '+input_scale' where expert 0 of the
    stack has one, and the head when it is to be quantized at load."""
    stored = {}
    for name, fmt in detect_expert_formats(cfg, tensors, directory).items():
        if fmt == "nvfp4":
            with_input_scale = (_stem(name.replace(".experts.", ".experts.0.")) + "input_scale") in tensors
            stored[name] = "nvfp4+input_scale" if with_input_scale else "nvfp4"
    if quantize_head:
        stored["head.weight"] = "nvfp4"
    return stored


def abstract_params(directory: str, quantize_head: bool = False):
    """(config, the parameter tree `load_params` would return, as jax.ShapeDtypeStruct leaves), from config.json
    and the safetensors headers only: nothing past the headers is read and nothing is allocated."""
    cfg = load_hf_config(directory)
    stored = stored_formats(cfg, open_checkpoint(directory), directory, quantize_head)
    return cfg, jax.eval_shape(lambda key: init_params(cfg, key, stored), jax.random.PRNGKey(0))


def validate(cfg: ModelConfig, tensors: dict[str, SafetensorsFile], stored: dict[str, str] | None = None) -> None:
    """Every tensor of params.disk_tensor_specs(cfg, stored) present with its dtype and shape, and no other."""
    expected = disk_tensor_specs(cfg, stored)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        dtypes, shape = expected[missing[0]]
        raise CheckpointError(f"missing tensor {missing[0]} (expected {dtypes[0]} {list(shape)}; "
                              f"{len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)")
    for name, (dtypes, shape) in expected.items():
        found_dtype, found_shape = tensors[name].info(name)
        if shape == () and found_shape == (1,):        # a scalar stored as [1] is the same value
            found_shape = ()
        if found_dtype not in dtypes or found_shape != shape:
            raise CheckpointError(f"tensor {name}: expected {dtypes[0]} {list(shape)}, found {found_dtype} "
                                  f"{list(found_shape)}")


def _positive_scalars(names: list[str], read) -> np.ndarray:
    values = np.array([float(read(n).reshape(())) for n in names], np.float32)
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if bad.size:
        raise CheckpointError(f"tensor {names[bad[0]]}: expected a finite positive scale, found {values[bad[0]]}")
    return values


def _place(shape: tuple, sharding, read_slice):
    """A device array of `shape` whose shards come from read_slice(index) (numpy, read from the memory map): on a
    mesh each device's slice only; without one the whole array to the default device."""
    if sharding is None:
        return jnp.asarray(read_slice(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, sharding, read_slice)


def _place_tensor(array: np.ndarray, sharding):
    """One checkpoint tensor (a memory-mapped view) onto its devices."""
    return _place(array.shape, sharding, lambda index: np.ascontiguousarray(array[index]))


def _place_stack(names: list[str], read, sharding, convert=lambda a: a):
    """The stack [E, ...] of one tensor per expert (`names`), each device's shard stacked from its own experts
    only (sharding.expert_slice). The shards of one stack meet on the host while they are transferred: the peak is
    about 1x the stack (benchmarks/load_memory.py), never a second copy of it."""
    first = convert(read(names[0]))
    shape = (len(names), *first.shape)

    def read_slice(index):
        experts = expert_slice(index, len(names))
        rest = tuple(index[1:])
        return np.stack([np.asarray(convert(read(names[e])))[rest] for e in experts])
    return _place(shape, sharding, read_slice)


def _read_experts(spec: WeightSpec, read, shardings=None):
    """An expert stack in its stored format; `shardings`: the NamedShardings of its arrays (same pytree) or None."""
    names = [expert_disk_names(spec, e) for e in range(spec.shape[0])]
    stems = [_stem(n) for n in names]
    sharding = (lambda field: getattr(shardings, field)) if shardings is not None else (lambda field: None)
    packed = _place_stack(names, read, sharding("packed"), lambda a: a.view(np.uint8))
    if spec.fmt == "mxfp4":
        return Mxfp4Weight(packed, _place_stack([s + "scale" for s in stems], read, sharding("scale")))
    input_scale = None
    if spec.input_scale:
        input_scale = _place_tensor(_positive_scalars([s + "input_scale" for s in stems], read),
                                    sharding("input_scale"))
    return Nvfp4Weight(packed, _place_stack([s + "weight_scale" for s in stems], read, sharding("scale")),
                       _place_tensor(_positive_scalars([s + "weight_scale_2" for s in stems], read),
                                     sharding("global_scale")), input_scale)


def quantize_head_to_nvfp4(params: dict) -> dict:
    """Replace the bf16 lm_head by NVFP4 (standard recipe, on device) and free the bf16 copy. The router gate
    and every other weight are left alone. Returns the same tree."""
    head = params["head"]["weight"]
    if not isinstance(head, jax.Array | np.ndarray):
        raise ValueError(f"quantize_head: the head is already {type(head).__name__}, expected a bf16 array")
    head = jnp.asarray(head)
    params["head"]["weight"] = jax.jit(quantize_nvfp4)(head)
    head.delete()
    return params


def load_params(directory: str, progress: Callable[[int, int], None] | None = None, quantize_head: bool = False,
                mesh=None):
    """Read an official checkpoint directory (MXFP4 or NVFP4 experts). Returns (config, parameter tree with
    stored formats). `quantize_head` turns the bf16 lm_head into NVFP4 once, on device. `mesh`: every tensor goes
    from its memory map straight to the devices holding its shards (sharding.param_shardings). `progress(bytes
    read, total bytes)` is called after each weight."""
    cfg = load_hf_config(directory)
    tensors = open_checkpoint(directory)
    stored = stored_formats(cfg, tensors, directory, quantize_head)
    validate(cfg, tensors, stored)

    seen: set[str] = set()
    done = 0

    def read(name):
        nonlocal done
        if name not in seen:
            seen.add(name)
            done += tensors[name].nbytes(name)
        return tensors[name].read(name)

    specs = weight_specs(cfg, stored)
    shardings = None
    if mesh is not None:
        shardings = param_shardings(cfg, mesh, jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0),
                                                                                  stored)))
    total = sum(tensors[n].nbytes(n) for n in disk_tensor_specs(cfg, stored))
    tree: dict = {}
    for spec in specs:
        where = tree_get(shardings, spec.name) if shardings is not None else None
        if spec.name == "head.weight" and spec.fmt == "nvfp4":
            value = quantize_head_to_nvfp4({"head": {"weight": jnp.asarray(read(spec.name))}})["head"]["weight"]
            value = value if where is None else jax.device_put(value, where)
        elif spec.fmt in ("bf16", "f32"):
            value = _place_tensor(read(spec.name), where)
        elif spec.fmt == "i64":
            ids = read(spec.name)
            if ids.min() < 0 or ids.max() >= cfg.n_routed_experts:
                raise CheckpointError(f"tensor {spec.name}: expert ids outside [0, {cfg.n_routed_experts})")
            value = _place_tensor(ids.astype(np.int32), where)
        elif spec.fmt == "fp8":
            value = Fp8BlockWeight(_place_tensor(read(spec.name), where and where.weight),
                                   _place_tensor(read(spec.name[:-6] + "scale"), where and where.scale))
        else:
            value = _read_experts(spec, read, where)
        tree_set(tree, spec.name, value)
        if progress is not None:
            progress(done, total)
    approximate = nvfp4_weights_kernels_approximate(tree)
    if approximate:
        warnings.warn(f"{len(approximate)} NVFP4 weight(s) have subnormal or non-positive block scales (first: "
                      f"{approximate[0]}); the GPU kernels approximate those blocks (kernels='reference' is exact)",
                      stacklevel=2)
    return cfg, tree


# ---- writing ------------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}


def write_safetensors(path: str, tensors: dict[str, tuple], metadata: dict | None = None) -> int:
    """Write one .safetensors file, tensors in the given order, streaming each one's bytes (memory-mapped sources
    are never loaded whole). Values are (safetensors dtype, array) -- the array gives shape and bytes, its itemsize
    must match the dtype -- or (safetensors dtype, shape, raw uint8 bytes) for a byte-for-byte copy.
    Returns the number of data bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    blobs = []
    for name, value in tensors.items():
        dtype = value[0]
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: unknown safetensors dtype {dtype}")
        if len(value) == 3:
            shape, blob = tuple(value[1]), np.ascontiguousarray(value[2]).reshape(-1).view(np.uint8)
        else:
            arr = np.asarray(value[1])       # (np.ascontiguousarray would turn a scalar [] into [1])
            if arr.dtype.itemsize != SAFETENSORS_DTYPES[dtype] or arr.dtype.byteorder == ">":
                raise ValueError(f"tensor {name}: {arr.dtype} items cannot be stored as {dtype}")
            shape, blob = arr.shape, np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if blob.size != SAFETENSORS_DTYPES[dtype] * math.prod(shape):
            raise ValueError(f"tensor {name}: {blob.size} bytes do not hold {dtype} {list(shape)}")
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + blob.size]}
        offset += blob.size
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)        # 8-byte aligned data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob.data)
    return offset
