"""What a decode step's attention reads, from the optimized HLO XLA:GPU compiles for an H200 (no GPU needed).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/attention_reads.py --json reads.json

Compiles the batch-1 decode step of a 2-layer Flash-geometry model (one CSA layer, ratio 4 with the indexer, and
one HCA layer, ratio 128) for a compile-only H200 (benchmarks/count_kernels.py's device) at --max-seq-len, with the
whole buffers live (no context bucket), for the caches in the activation dtype and in "fp8" (numerics/kv_cache.py).
Every top-level instruction of the entry computation (and of the decode loop's body, if any) whose operands include
one of the attention caches (window ring, compressed entries, indexer keys; recognised by their shapes) is listed
with what it is (a gather, a dot, an elementwise fusion, ...), the cache bytes it takes and the bytes it writes. A
gather reads only the rows it selects; a scatter fusion updates its buffer in place; anything else that takes a
whole cache reads all of it, except the decode attention kernel (pallas_kernels/decode_attention.py), which takes
the whole buffers and loads only the rows it attends: the ring, the chunk, and the picked (CSA) or visible (HCA)
entries ("reads": "attended rows"). Instructions that take a cache only through a bitcast (the indexer's score dot)
are not listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DTYPE_BYTES = {"bf16": 2, "f32": 4, "f16": 2, "f8e4m3fn": 1, "u8": 1, "s32": 4, "pred": 1, "s8": 1, "u32": 4}
SHAPE = re.compile(r"(bf16|f32|f16|f8e4m3fn|u8|s32|pred|s8|u32)\[([0-9,]*)\]")


def _bytes(dtype: str, dims: str) -> int:
    return DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)


def cache_shapes(cfg, max_seq_len: int, kv_cache_dtype) -> dict:
    """{(dtype, dims): name} of every stored cache leaf of the CSA and HCA layers."""
    import jax
    import jax.numpy as jnp

    from dsv4_jax.state import init_layer_cache
    names = {}
    for ratio in (4, 128):
        cache = jax.eval_shape(lambda r=ratio: init_layer_cache(cfg, r, 1, max_seq_len, jnp.bfloat16, kv_cache_dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
            name = jax.tree_util.keystr(path)
            if "compressor" in name.split("]")[0]:
                continue                                  # pending tokens: small, not attention entries
            dtype = {"bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn", "uint8": "u8", "float32": "f32"}[str(leaf.dtype)]
            # the two layers' rings have one shape: a ring is named as such, not by its layer
            key = (dtype, ",".join(str(d) for d in leaf.shape))
            names[key] = "window ring" + name.replace("['window_kv']", "") if "window_kv" in name else \
                f"ratio {ratio} {name}"
    return names


def attention_reads(hlo: str, caches: dict) -> list[dict]:
    """Instructions of the entry computation that take a cache buffer as an operand."""
    rows = []
    fused = {}                                            # fused computation name -> its text
    for block in re.split(r"\n(?=\S)", hlo):
        head = block.split("\n", 1)[0]
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", head)
        if m:
            fused[m.group(1)] = block
    entry = next(b for b in re.split(r"\n(?=\S)", hlo) if b.startswith("ENTRY"))
    shapes = {}                                           # instruction name -> its result's (dtype, dims) leaves
    for line in entry.split("\n")[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
        if m:
            shapes[m.group(1)] = SHAPE.findall(m.group(2))
    for line in entry.split("\n")[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(, |$)", line)
        if not m or m.group(3) in ("parameter", "tuple", "get-tuple-element", "bitcast"):
            continue
        name, result, op, args = m.group(1), m.group(2), m.group(3), m.group(4)
        operands = [leaf for arg in re.findall(r"%([\w.\-]+)", args) for leaf in shapes.get(arg, [])]
        taken = [caches[leaf] for leaf in operands if leaf in caches]
        if not taken:
            continue
        called = re.search(r"calls=%([\w.\-]+)", line)
        body = fused.get(called.group(1), "") if called else ""
        kinds = sorted({k for k in ("gather", "dot", "convert", "dynamic-slice", "slice", "scatter", "concatenate",
                                    "dynamic-update-slice", "reduce", "custom-call", "copy", "exponential")
                        if re.search(rf"\b{k}\(", body or f"{op}(")})
        cache_bytes = sum(_bytes(*leaf) for leaf in operands if leaf in caches)
        written = sum(_bytes(*leaf) for leaf in SHAPE.findall(result))
        scope = re.search(r'op_name="([^"]*)"', line)
        op_name = scope.group(1).replace("jit(decode_step)/", "") if scope else ""
        reads = "attended rows" if "decode_attention" in op_name else ""     # see the docstring for the others
        rows.append({"instruction": name, "op": op, "contains": kinds, "caches": taken, "cache_bytes": cache_bytes,
                     "reads": reads, "result": result[:100], "result_bytes": written, "op_name": op_name})
    return rows


def main(argv=None) -> int:
    from count_kernels import (_pallas_target, abstract_inputs, add_kernel_override_options, h200_device,
                               kernel_overrides)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq-len", type=int, default=65536)
    add_kernel_override_options(p)
    p.add_argument("--json")
    p.add_argument("--hlo-dir", help="also write each program's optimized HLO text here")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from dsv4_jax import engine, presets
    from dsv4_jax.run_context import RunContext

    device = h200_device()
    cfg = presets.flash().replace(n_layers=2, compress_ratios=(4, 128, 0), n_hash_layers=1)
    ctx = RunContext.create("bfloat16", True, "none", "auto", device=device, kernel_overrides=kernel_overrides(args))
    result = {"max_seq_len": args.max_seq_len, "programs": {}}
    for kv in (None, "fp8"):
        params, state, _, _, vec = abstract_inputs(cfg, 1, args.max_seq_len, device)
        if kv:
            from dsv4_jax.state import init_state
            import jax
            from jax.sharding import NamedSharding, PartitionSpec
            sharding = NamedSharding(jax.sharding.Mesh([device], ("x",)), PartitionSpec())
            state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                 jax.eval_shape(lambda: init_state(cfg, 1, args.max_seq_len, jnp.bfloat16,
                                                                   kv_cache_dtype=kv)))
        with _pallas_target(device):
            compiled = engine.decode_step.trace(params, state, vec(jnp.int32, 1), cfg=cfg, ctx=ctx,
                                                max_seq_len=args.max_seq_len).lower().compile()
        hlo = compiled.as_text()
        label = kv or "bf16"
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"decode_step_{label}.hlo"), "w") as f:
                f.write(hlo)
        rows = attention_reads(hlo, cache_shapes(cfg, args.max_seq_len, kv))
        result["programs"][label] = rows
        print(f"\ncaches {label}, max_seq_len {args.max_seq_len}: instructions taking a cache")
        for r in rows:
            reads = f" ({r['reads']})" if r["reads"] else ""
            print(f"  {r['instruction']:<28} {r['op']:<14} {'+'.join(r['contains']):<30} "
                  f"{r['cache_bytes'] / 2**20:8.2f} MiB of {', '.join(r['caches'])}{reads} -> "
                  f"{r['result_bytes'] / 2**20:8.3f} MiB  {r['op_name'][:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
