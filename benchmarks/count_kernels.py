"""Count the kernel launches of the model's GPU programs without a GPU: compile them for a compile-only H200.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/count_kernels.py --preset flash --layers 4 --batch 1 \
        --json counts.json

Needs jax's CUDA build in the environment (`pip install "jax[cuda13]==0.11.2"`; no GPU or driver needed) and nvcc
for the ffi/ kernels (built for sm_90a). The decode step, a prefill chunk and a generation chunk are compiled for an
H200 described by `h200_target_config.txtpb` (next to this script) with `kernels="auto"` planned for that device;
each program's optimized HLO is counted by dsv4_jax.hlo_census: top-level kernels, launches per call (loop bodies
times their trip counts), custom calls, while loops, collectives, compile time, launches per layer kind and per op
family, the bytes of the kernels' operands and results by family and by site (an upper bound on what they move),
gathers that read one element per memory sector, and dynamic slices of 64 MiB or more copied out (e.g. a scanned
layer's expert weights, per iteration). `--dispatch` also traces the decode step at batch 1, 8, 16, 32
and 64 and a verify step of 64 x 4 rows (dsv4_jax.dispatch_census) and reports which path (kernel or reference
dequantize-then-dot) each quantized matmul takes. `--device-memory-gib 256` compiles for an H200 with more memory:
all of Flash does not fit 141 GiB, and XLA then adds rematerialized launches that a device holding its share of the
model does not make.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TARGET_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200_target_config.txtpb")


def h200_devices(n: int = 1, memory_gib: float | None = None) -> list:
    """The compile-only H200s of a one-host CUDA topology of n GPUs (`memory_gib`: with that much device memory
    instead of the H200's 141 GiB)."""
    import re

    from jax.experimental import topologies
    with open(TARGET_CONFIG) as f:
        target_config = f.read()
    if memory_gib is not None:
        target_config = re.sub(r"device_memory_size: \d+", f"device_memory_size: {int(memory_gib * 2 ** 30)}",
                               target_config)
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=target_config)
    except Exception as err:       # no CUDA plugin in this environment, or its checks refused to load
        raise SystemExit(f"this script needs jax's CUDA build (pip install 'jax[cuda13]==0.11.2'; no GPU "
                         f"needed) and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1: {str(err).splitlines()[0]}") from None
    return list(topology.devices)


def h200_device(memory_gib: float | None = None):
    """The compile-only H200 of a one-device CUDA topology."""
    return h200_devices(1, memory_gib)[0]


def _pallas_target(device):
    """Pallas's Triton lowering asks for a GPU: on a machine without one it takes the abstract device of an
    abstract mesh."""
    import jax
    abstract = jax.sharding.AbstractDevice(device_kind=device.device_kind, platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=abstract))


def abstract_inputs(cfg, batch: int, max_seq_len: int, device, scan_layers: bool = False):
    """Parameters, decode state and generation inputs as shapes placed on the compile-only device (with
    `scan_layers`, the repeated layers stacked as a scanned Model holds them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv4_jax import engine
    from dsv4_jax.params import init_params
    from dsv4_jax.sampling import Sampling
    from dsv4_jax.state import init_state

    sharding = NamedSharding(jax.sharding.Mesh([device], ("x",)), PartitionSpec())
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)
    from dsv4_jax.layer_scan import scan_plan, stack_layers

    plan = scan_plan(cfg) if scan_layers else None

    def make_params():
        params = init_params(cfg, jax.random.PRNGKey(0))
        return params if plan is None else {**params, "layers": stack_layers(params["layers"], plan)}
    params = place(jax.eval_shape(make_params))
    state = place(jax.eval_shape(lambda: init_state(cfg, batch, max_seq_len, jnp.bfloat16, plan is not None)))
    vec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    sampling = Sampling(vec(jnp.float32, batch), vec(jnp.int32, batch), vec(jnp.float32, batch),
                        vec(jnp.int32, batch), vec(jnp.int32, batch, 2), vec(jnp.uint32, batch, 2))
    gen = engine.GenerationState(state, vec(jnp.int32, batch), vec(jnp.int32, batch), vec(jnp.bool_, batch), sampling)
    return params, state, gen, vec(jnp.bool_, batch), vec


PROGRAMS = ("decode_step", "prefill_chunk", "generate_chunk")
DISPATCH_STEPS = ((1, 1), (8, 1), (16, 1), (32, 1), (64, 1), (64, 4))     # (batch, tokens per sequence)


def add_kernel_override_options(parser) -> None:
    parser.add_argument("--kernel-override", action="append", default=[], metavar="OP=CHOICE",
                        help="a per-op override of the kernel plan (ops/choice.py), e.g. attention_core=kernel; "
                             "repeatable")
    parser.add_argument("--decode-attention", action="store_true",
                        help="with the decode attention kernel (opt-in on GPUs): --kernel-override "
                             "attention_core=kernel")


def kernel_overrides(args) -> list[str]:
    """The kernel plan's overrides the options ask for (RunContext.create's kernel_overrides)."""
    return args.kernel_override + (["attention_core=kernel"] if args.decode_attention else [])


def count_programs(cfg, ctx, batch: int, max_seq_len: int, prefill_chunk: int, gen_chunk: int, device,
                   names=PROGRAMS, scan_layers: bool = False, hlo_dir: str | None = None) -> dict:
    import jax.numpy as jnp

    from dsv4_jax import engine
    from dsv4_jax.generation import generate_chunk
    from dsv4_jax.hlo_census import census, kernel_bytes, slice_copies, strided_gathers

    params, state, gen, halt, vec = abstract_inputs(cfg, batch, max_seq_len, device, scan_layers)
    programs = {
        "decode_step": lambda: engine.decode_step.trace(params, state, vec(jnp.int32, batch), cfg=cfg, ctx=ctx,
                                                        max_seq_len=max_seq_len),
        "prefill_chunk": lambda: engine.prefill_chunk.trace(params, state, vec(jnp.int32, batch, prefill_chunk),
                                                            vec(jnp.int32, batch),
                                                            vec(jnp.float32, batch, cfg.vocab_size), cfg=cfg,
                                                            ctx=ctx),
        "generate_chunk": lambda: generate_chunk.trace(params, gen, halt, cfg=cfg, ctx=ctx, max_seq_len=max_seq_len,
                                                       chunk=gen_chunk),
    }
    out = {}
    for name in names:
        trace = programs[name]
        t0 = time.perf_counter()
        with _pallas_target(device):
            compiled = trace().lower().compile()
        seconds = time.perf_counter() - t0
        text = compiled.as_text()
        if hlo_dir:                     # for hlo_census by hand, e.g. kernel_bytes(text, top=500) for every site
            os.makedirs(hlo_dir, exist_ok=True)
            with open(os.path.join(hlo_dir, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        strided = strided_gathers(text)
        copies = slice_copies(text)
        traffic = kernel_bytes(text)
        out[name] = {**census(text).as_dict(), "compile_s": seconds, "strided_gathers": strided,
                     "slice_copies": copies, "kernel_bytes": traffic}
        if copies:
            print(f"{name}: {len(copies)} dynamic slices of >= 64 MiB copied out, "
                  f"{sum(c['bytes'] for c in copies) / 2**20:.0f} MiB each time their computations run "
                  f"(hlo_census.slice_copies)", flush=True)
        if strided:
            print(f"{name}: {len(strided)} strided gathers read {sum(g['bytes_used'] for g in strided) / 2**20:.0f} "
                  f"MiB as up to {sum(g['bytes_read'] for g in strided) / 2**20:.0f} MiB of memory sectors "
                  f"(hlo_census.strided_gathers)", flush=True)
        print(f"{name}: {out[name]['launches_per_call']} launches per call ({out[name]['top_level_kernels']} "
              f"top-level kernels, {out[name]['while_loops']} while loops, {out[name]['custom_calls']} custom "
              f"calls), their operands and results {traffic['total'] / 2**30:.2f} GiB (hlo_census.kernel_bytes), "
              f"compiled in {seconds:.1f} s", flush=True)
    return out


def dispatch_table(cfg, ctx, max_seq_len: int, device) -> dict:
    """Per decode step of batch 1, 8, 16, 32, 64 and verify step of batch 64 x (1 + 3 drafts): how many quantized
    matmuls take each (path, kernel)."""
    from dsv4_jax.dispatch_census import step_dispatch

    table = {}
    for batch, tokens in DISPATCH_STEPS:
        name = str(batch) if tokens == 1 else f"{batch}x{tokens}"
        with _pallas_target(device):
            table[name] = step_dispatch(cfg, ctx, batch, tokens, max_seq_len)
        print(f"dispatch at batch {name}: {table[name]}", flush=True)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("tiny", "flash", "pro"), default="flash")
    p.add_argument("--layers", type=int, default=None, help="first N backbone layers (default: all)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--gen-chunk", type=int, default=16)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated subset of {PROGRAMS}, or none")
    p.add_argument("--dispatch", action="store_true",
                   help="also the dispatch table of the decode step at batch 1, 8, 16, 32, 64 and of a verify step "
                        "at batch 64 with 3 drafts")
    p.add_argument("--scan-layers", action="store_true", help="the repeated layer pattern under lax.scan")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="compile for an H200 with this much memory: all of Flash (156 GB of arguments) exceeds the "
                        "H200's 141 GiB, and XLA then rematerializes small kernels per layer to save memory, "
                        "launches a model that fits its devices (sharded) does not make; e.g. 256")
    add_kernel_override_options(p)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--hlo-dir", metavar="DIR", help="also write each compiled program's HLO text, DIR/<program>.hlo.txt")
    args = p.parse_args(argv)
    names = [] if args.programs == "none" else [n for n in args.programs.split(",") if n]
    if (not names and args.programs != "none") or set(names) - set(PROGRAMS):
        p.error(f"--programs: expected names from {PROGRAMS}, got {args.programs!r}")

    from dsv4_jax import presets
    from dsv4_jax.run_context import RunContext

    cfg = presets.named(args.preset, args.layers)
    device = h200_device(args.device_memory_gib)
    ctx = RunContext.create(kernels=args.kernels, device=device, kernel_overrides=kernel_overrides(args))
    print(f"{args.preset} geometry, {cfg.n_layers} layers, batch {args.batch}, compiled for {device.device_kind} "
          f"(kernel backend {ctx.kernels.backend}, ffi {ctx.kernels.ffi})", flush=True)
    result = {"preset": args.preset, "layers": cfg.n_layers, "batch": args.batch, "max_seq_len": args.max_seq_len,
              "decode_attention_kernel": ctx.kernels.override("attention_core") == "kernel",
              "kernel_overrides": dict(ctx.kernels.overrides), "device": device.device_kind,
              "device_memory_gib": args.device_memory_gib,
              "kernels": args.kernels, "scan_layers": args.scan_layers, "kernel_backend": ctx.kernels.backend,
              "ffi": ctx.kernels.ffi,
              "programs": count_programs(cfg, ctx, args.batch, args.max_seq_len, args.prefill_chunk, args.gen_chunk,
                                         device, names, args.scan_layers, args.hlo_dir)}
    if args.dispatch:
        result["dispatch"] = dispatch_table(cfg, ctx, args.max_seq_len, device)
    if names:
        print(json.dumps(result["programs"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
