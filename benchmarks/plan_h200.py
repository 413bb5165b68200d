"""The memory plan of a model on 1-8 H200s, compiled without a GPU: `dsv4_jax.memory_plan(..., compiled=True)` on a
mesh of compile-only H200s (a one-host CUDA topology of n GPUs), so the prefill chunk's and the decode step's
temporaries are what XLA:GPU would allocate on those devices, with the GPU kernels planned as on a real H200.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu python benchmarks/plan_h200.py --preset flash --devices 2 4 8 \
        --json plan.json

Needs jax's CUDA build in the environment (`pip install "jax[cuda13]==0.11.2"`; no GPU or driver needed) and nvcc for
the ffi/ kernels, as benchmarks/count_kernels.py. Compiling a full-depth model takes minutes per mesh on a 2-core CPU;
`--layers N` compiles the first N layers instead (temporaries are per-layer peaks: they barely change with depth).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from count_kernels import _pallas_target, add_kernel_override_options, h200_devices, kernel_overrides  # noqa: E402

H200_BYTES = 141e9


def main(argv=None) -> int:
    import dsv4_jax
    from dsv4_jax import presets
    from dsv4_jax.engine import PREFILL_CHUNK

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("tiny", "flash", "pro"), default="flash")
    p.add_argument("--layers", type=int, default=None, help="first N backbone layers (default: all)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-seq-len", type=int, default=65536)
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK)
    p.add_argument("--json", metavar="FILE")
    add_kernel_override_options(p)
    args = p.parse_args(argv)
    overrides = kernel_overrides(args)

    cfg = presets.named(args.preset, args.layers)
    rows = []
    for n in args.devices:
        devices = h200_devices(n)
        mesh = dsv4_jax.make_mesh(devices=devices)
        t0 = time.perf_counter()
        with _pallas_target(devices[0]):
            plan = dsv4_jax.memory_plan(cfg, mesh=mesh, max_seq_len=args.max_seq_len, max_batch=args.max_batch,
                                        prefill_chunk=args.prefill_chunk, compiled=True, device_memory=H200_BYTES,
                                        kernel_overrides=overrides or None)
        seconds = time.perf_counter() - t0
        print(f"{args.preset}, {cfg.n_layers} layers, {n} H200 (compiled in {seconds:.0f} s):\n{plan.table()}",
              flush=True)
        rows.append({"devices": n, "weights": plan.weights, "decode_state": plan.decode_state,
                     "prefill_temp": plan.prefill_temp, "decode_temp": plan.decode_temp, "total": plan.total,
                     "fits": plan.fits, "compile_s": seconds})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": args.preset, "layers": cfg.n_layers, "max_seq_len": args.max_seq_len,
                           "max_batch": args.max_batch, "prefill_chunk": args.prefill_chunk,
                           "kernel_overrides": overrides,
                           "device_bytes": H200_BYTES, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
