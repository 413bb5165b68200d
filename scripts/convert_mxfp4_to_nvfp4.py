"""Convert a DeepSeek-V4 checkpoint's MXFP4 routed experts to NVFP4, losslessly (docs/model.md 7.3).

    python scripts/convert_mxfp4_to_nvfp4.py SRC DST [--include-mtp] [--input-scale VALUE]

SRC is an official checkpoint directory (or one that is already partly NVFP4). DST is created and receives:
  * the same shards, same file names and tensor order, with every converted expert matrix
    `*.experts.E.wN.weight` I8 -> U8 (the very same bytes: nibbles are unchanged) and its E8M0 `.scale` replaced
    by `.weight_scale` F8_E4M3 [out, in/16] and `.weight_scale_2` F32 scalar (NVIDIA's layout, docs/model.md 6.6);
  * every other tensor copied byte for byte, `model.safetensors.index.json` rewritten for the new names;
  * `hf_quant_config.json` (ModelOpt style, quant_algo MIXED_PRECISION, one NVFP4 entry per converted layer);
  * every other file and folder of SRC (config.json, tokenizer files, inference/, encoding/, ...) byte for byte.

Per matrix with E8M0 exponents k_j: global scale 2^(max k - 8), block scale e4m3(2^(k_j - max k + 8)) for both
16-halves of each 32-block, so the dequantized values are identical bit for bit. A matrix whose exponents span
more than 17 (and whose small blocks are not all zero) cannot be cast exactly: the tool checks every matrix
before writing anything and stops with the tensor's name.

Like nvidia/DeepSeek-V4-Flash-NVFP4, only the backbone's experts are converted unless --include-mtp. No
`input_scale` is written unless --input-scale is given: a converted checkpoint has no calibration, dsv4_jax computes
the NVFP4 activation scale at run time, and a made-up static value would mislead engines that use it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_jax.checkpoint import (QUANT_CONFIG, CheckpointError, open_checkpoint, read_quant_config,  # noqa: E402
                                 stored_formats, validate, write_safetensors)
from dsv4_jax.config import load_hf_config  # noqa: E402

INDEX = "model.safetensors.index.json"
_EXPERT_SCALE = re.compile(r"^((layers|mtp)\.\d+\.ffn\.experts)\.\d+\.w[123]\.scale$")


class ConversionError(ValueError):
    pass


def _scale_caster():
    import jax

    from dsv4_jax.numerics.nvfp4 import mxfp4_to_nvfp4_is_exact, nvfp4_scales_from_e8m0
    from dsv4_jax.numerics.formats import Mxfp4Weight
    cpu = jax.devices("cpu")[0]
    cast = jax.jit(nvfp4_scales_from_e8m0)
    exact = jax.jit(lambda packed, scale: mxfp4_to_nvfp4_is_exact(Mxfp4Weight(packed, scale)))

    def run(scale_bytes, packed_fn):
        with jax.default_device(cpu):
            k = scale_bytes.astype(np.int32)
            # Fast path from the exponents alone; otherwise the nibbles decide (all-zero blocks cast exactly).
            if (k == 255).any() or k.max() - k.min() > 17 or k.max() - 127 - 8 < -126:
                if not bool(exact(np.asarray(packed_fn()), np.asarray(scale_bytes))):
                    return None
            block_scale, global_scale = cast(np.asarray(scale_bytes))
            return np.asarray(block_scale), np.asarray(global_scale, np.float32).reshape(())
    return run


def convert(src: str, dst: str, include_mtp: bool = False, input_scale: float | None = None,
            log=lambda msg: None) -> dict:
    """Convert SRC into DST (see the module docstring). Returns a summary dict."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if src == dst:
        raise ConversionError("destination must differ from the source")
    if os.path.exists(dst) and os.listdir(dst):
        raise ConversionError(f"{dst}: destination exists and is not empty")
    if input_scale is not None and not (np.isfinite(input_scale) and input_scale > 0):
        raise ConversionError(f"--input-scale must be a finite positive number, got {input_scale}")
    cfg = load_hf_config(src)
    tensors = open_checkpoint(src)
    validate(cfg, tensors, stored_formats(cfg, tensors, src))

    # Which expert matrices to convert: MXFP4 stacks of the backbone (and the MTP block on request).
    todo = {}
    for name in tensors:
        match = _EXPERT_SCALE.match(name)
        if match and (match.group(2) == "layers" or include_mtp):
            todo[name[:-len("scale")]] = match.group(1)
    if not todo:
        raise ConversionError(f"{src}: no MXFP4 routed experts to convert")

    # Check every matrix first (cheap: scale bytes; the nibbles only where the exponent span exceeds 17).
    cast = _scale_caster()
    converted = {}
    for i, stem in enumerate(sorted(todo)):
        result = cast(tensors[stem + "scale"].read(stem + "scale"),
                      lambda stem=stem: tensors[stem + "weight"].read(stem + "weight"))
        if result is None:
            raise ConversionError(f"tensor {stem}weight: its E8M0 exponents span more than 17 and cannot be cast "
                                  f"to NVFP4 exactly")
        converted[stem] = result
        if (i + 1) % 1000 == 0:
            log(f"checked {i + 1}/{len(todo)} expert matrices")

    os.makedirs(dst, exist_ok=True)
    files: dict[str, object] = {}
    for sf in tensors.values():
        files[os.path.basename(sf.path)] = sf
    weight_map, total = {}, 0
    for fname in sorted(files):
        sf = files[fname]
        out = {}
        for name in sorted(sf.names(), key=lambda n: sf.entries[n]["data_offsets"][0]):
            dtype, shape = sf.info(name)
            stem = name[:-len("scale")] if name.endswith(".scale") else name[:-len("weight")]
            if name.endswith(".weight") and stem in converted:
                out[name] = ("U8", shape, sf.raw(name))
            elif name.endswith(".scale") and stem in converted:
                block_scale, global_scale = converted[stem]
                out[stem + "weight_scale"] = ("F8_E4M3", block_scale)
                out[stem + "weight_scale_2"] = ("F32", global_scale)
                if input_scale is not None:
                    out[stem + "input_scale"] = ("F32", np.asarray(input_scale, np.float32).reshape(()))
            else:
                out[name] = (dtype, shape, sf.raw(name))
        total += write_safetensors(os.path.join(dst, fname), out, sf.metadata)
        weight_map.update({name: fname for name in out})
        log(f"wrote {fname}")

    if os.path.exists(os.path.join(src, INDEX)):
        with open(os.path.join(src, INDEX)) as f:
            index = json.load(f)
        index["metadata"] = {**index.get("metadata", {}), "total_size": total}
        index["weight_map"] = dict(sorted(weight_map.items()))
        with open(os.path.join(dst, INDEX), "w") as f:
            json.dump(index, f, indent=2)

    qc = read_quant_config(src) or {"producer": {"name": "dsv4_jax", "version": "convert_mxfp4_to_nvfp4"},
                                    "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                                     "quantized_layers": {}}}
    top = qc.setdefault("quantization", {})
    if top.get("quant_algo") != "MIXED_PRECISION":
        raise ConversionError(f"{QUANT_CONFIG} of the source has quant_algo {top.get('quant_algo')!r}; "
                              f"cannot add NVFP4 experts to it")
    layers = top.setdefault("quantized_layers", {})
    for module in sorted(set(todo.values())):
        layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
    with open(os.path.join(dst, QUANT_CONFIG), "w") as f:
        json.dump(qc, f, indent=2)

    skip = {INDEX, QUANT_CONFIG}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry in skip or entry.endswith(".safetensors"):
            continue
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(dst, entry))
        else:
            shutil.copy2(path, os.path.join(dst, entry))
    return {"converted": len(converted), "layers": len(set(todo.values())), "bytes": total}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="official DeepSeek-V4 checkpoint directory (MXFP4 experts)")
    parser.add_argument("dst", help="new directory for the NVFP4-expert checkpoint")
    parser.add_argument("--include-mtp", action="store_true", help="also convert the MTP block's experts")
    parser.add_argument("--input-scale", type=float, default=None,
                        help="static activation scale to write for engines that need one (dsv4_jax ignores it)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    try:
        summary = convert(args.src, args.dst, args.include_mtp, args.input_scale, log)
    except (ConversionError, CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"converted {summary['converted']} expert matrices in {summary['layers']} layers to NVFP4; "
          f"{summary['bytes']} tensor bytes in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
