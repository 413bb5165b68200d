"""Peak host memory of loading onto a mesh, against the largest per-layer expert stack.

    python benchmarks/load_memory.py --devices 4 --json out.json

In a process of its own with N fake CPU devices (--devices), measured with tracemalloc (numpy's host copies: the
memory-mapped checkpoint pages themselves are the page cache's, not the process's):
  1. a Flash-geometry expert stack (one layer's routed w1: 256 experts x [2048, 4096] MXFP4, 1.1 GB) written to a
     temporary safetensors file, then placed on an N-device expert mesh the way checkpoint.load_params places
     every stack (each device's shard stacked from its own experts);
  2. the whole tiny synthetic checkpoint loaded with dsv4_jax.load(mesh=...).
Prints a table and writes JSON: peak host bytes / the largest expert stack's bytes (the target is below 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    import dsv4_jax
    from dsv4_jax import checkpoint, presets
    from jax.sharding import NamedSharding

    from dsv4_jax.params import weight_specs
    from dsv4_jax.numerics.formats import Mxfp4Weight
    from dsv4_jax.sharding import partition_spec

    mesh = dsv4_jax.make_mesh(args.devices)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # 1. one Flash-geometry expert stack
        cfg = presets.flash()
        spec = next(s for s in weight_specs(cfg) if s.name.endswith(".ffn.experts.w1.weight"))
        n_exp, out_dim, in_dim = spec.shape
        rng = np.random.default_rng(0)
        tensors = {}
        for e in range(n_exp):
            stem = f"layers.0.ffn.experts.{e}.w1."
            tensors[stem + "weight"] = ("I8", rng.integers(0, 256, (out_dim, in_dim // 2), dtype=np.uint8))
            tensors[stem + "scale"] = ("F8_E8M0", rng.integers(118, 130, (out_dim, in_dim // 32), dtype=np.uint8))
        path = os.path.join(tmp, "stack.safetensors")
        checkpoint.write_safetensors(path, tensors)
        stack_bytes = sum(v[1].nbytes for v in tensors.values())
        del tensors
        file = checkpoint.SafetensorsFile(path)
        abstract = jax.eval_shape(lambda: Mxfp4Weight(
            jax.ShapeDtypeStruct((n_exp, out_dim, in_dim // 2), np.uint8),
            jax.ShapeDtypeStruct((n_exp, out_dim, in_dim // 32), np.uint8)))
        shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, partition_spec(spec.axes, leaf.ndim)), abstract)
        tracemalloc.start()
        t = time.perf_counter()
        placed = checkpoint._read_experts(spec, file.read, shardings)
        jax.block_until_ready(placed)
        seconds = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rows.append(dict(what="Flash expert stack (w1 of one layer)", devices=args.devices, stack_bytes=stack_bytes,
                         peak_host_bytes=peak, ratio=peak / stack_bytes, seconds=seconds,
                         shard_experts=placed.packed.addressable_shards[0].data.shape[0]))
        del placed

        # 2. the tiny synthetic checkpoint, whole
        from ckpt_writer import write_checkpoint
        tiny = presets.tiny()
        write_checkpoint(os.path.join(tmp, "tiny"), tiny, seed=1)
        tracemalloc.start()
        t = time.perf_counter()
        model = dsv4_jax.load(os.path.join(tmp, "tiny"), mesh=mesh)
        jax.block_until_ready(model.params)
        seconds = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        tiny_stack = max(sum(leaf.nbytes for leaf in jax.tree.leaves(stack))
                         for layer in model.params["layers"] + model.params["mtp"]
                         for stack in layer["ffn"]["experts"].values())
        rows.append(dict(what="tiny checkpoint, whole load", devices=args.devices, stack_bytes=tiny_stack,
                         peak_host_bytes=peak, ratio=peak / tiny_stack, seconds=seconds))
    print(f"{'what':<40} {'devices':>7} {'stack MB':>9} {'peak MB':>8} {'peak/stack':>10} {'s':>6}")
    for r in rows:
        print(f"{r['what']:<40} {r['devices']:>7} {r['stack_bytes'] / 1e6:>9.1f} {r['peak_host_bytes'] / 1e6:>8.1f} "
              f"{r['ratio']:>10.2f} {r['seconds']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
