"""python -m dsv4_jax.bench: what a token costs, on this machine, against its memory roofline.

    python -m dsv4_jax.bench --preset flash --layers 8 --out flash8.json --plot figs/
    python -m dsv4_jax.bench --preset tiny --batches 1,8 --contexts 512 --prompts 256   # a quick look on a CPU

Builds a model of the preset's geometry (`--layers N`: its first N layers and the MTP block) with random weights
made on the device in the stored formats (FP8 attention and shared experts, MXFP4 routed experts, bf16 head), and
measures in one process:
- the device: XLA's bf16 GEMV bandwidth and its FP8 / bf16 matmul rates (bench/probes.py);
- decode ms per step for every --batches x --contexts, from the jitted generation loop (bench/cases.py), against
  the step's floor (dsv4_jax.roofline bytes / measured bandwidth);
- time to first token and prefill tokens/s for every --prompts length at batch 1, against the FP8 matmul rate;
- compile time of the decode step and of a generation chunk;
- all of it again on kernels="reference" (XLA only) unless --reference says otherwise.
With `--devices N` the model runs on an N-device mesh (experts split, dsv4_jax.sharding); the floor stays the
one-device figure (all bytes over one device's bandwidth), so "of floor" then understates the fraction per device.
`--profile DIR` adds a per-op table of one decode step (at each `--profile-batches`, default 1) from a jax.profiler
trace, and its launch count; `--profile-prefill DIR` the same for one prefill chunk.
Prints tables, writes `--out` JSON, and `--plot DIR` PNGs (or `--replot JSON --plot DIR` from an earlier run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

from .. import init_random, make_mesh, presets
from ..engine import PREFILL_CHUNK
from ..generate import _int_at_least, _temperature, _top_p   # the command line's checks of these options
from ..roofline import bytes_by_family, prefill_flops, roofline, weight_bytes_by_part
from ..settings import Settings
from ..source_digest import source_digest
from . import cases, op_profile, probes
from .plots import write_plots

DEFAULT_PROBES = {"gpu": (1 << 30, 16384), "cpu": (64 << 20, 512)}   # bandwidth weight bytes, matmul n
PRINTED_SITES = 15      # of the profile's top sites, the ones the printed table lists (the JSON has them all)


def _ints(text: str) -> list[int]:
    if text == "none":
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers (or none), got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsv4_jax.bench", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("tiny", "flash", "pro"), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="first N backbone layers (default: all)")
    p.add_argument("--devices", type=int, default=1, help="devices of the mesh (default 1: no mesh)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=_ints, default=[4096, 65536], help="tokens in each sequence's state")
    p.add_argument("--prompts", type=_ints, default=[1024, 8192, 32768], help="prefill prompt lengths")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    p.add_argument("--calls", type=int, default=3, help="timed calls per decode case (after one warm-up)")
    p.add_argument("--speculative-tokens", type=_ints, default=[], metavar="K,...",
                   help="also time speculative steps with these draft counts (batch x first context), against the "
                        "plain step")
    p.add_argument("--prefill-calls", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK)
    p.add_argument("--reference", choices=("all", "decode", "none"), default="all",
                   help="which cases also run on kernels='reference' (default all)")
    p.add_argument("--kernels", default="auto", help="kernel mode of the main side (default auto)")
    p.add_argument("--kernel-override", action="append", default=[], metavar="OP=CHOICE",
                   help="a per-op override of the main side's kernel plan (ops/choice.py), e.g. "
                        "attention_core=kernel (the opt-in decode attention kernel); repeatable")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--act-quant", choices=("none", "fp8", "nvfp4"), default="none",
                   help="activations quantized before the quantized-weight matmuls (Settings.act_quant; default none)")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="every decode row's temperature (default 0: greedy rows, whose token choice never sorts)")
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="every decode row's top-k (default 0: off)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="every decode row's top-p (default 1: off)")
    p.add_argument("--stats", action="store_true",
                   help="the main side's decode programs also measure every layer's statistics (ops/layer_stats.py): "
                        "what that costs, against a run without")
    p.add_argument("--scan-layers", action="store_true", help="the repeated layer pattern under lax.scan")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="decode-state entries in the activation dtype (auto) or compact (fp8)")
    p.add_argument("--bandwidth-bytes", type=int, default=None, help="bandwidth probe's weight size")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul rate probe's n")
    p.add_argument("--profile", metavar="DIR",
                   help="trace one decode step (at each --profile-batches) into DIR and tabulate it")
    p.add_argument("--profile-batches", type=_ints, default=[1], metavar="B,...",
                   help="the batches --profile traces, rows at random tokens (default 1)")
    p.add_argument("--profile-prefill", metavar="DIR",
                   help="trace one prefill chunk (--prefill-chunk tokens of one sequence) into DIR and tabulate it")
    p.add_argument("--out", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG figures (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON", help="only make --plot figures from an earlier --out file")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.kernels == "reference" and args.reference != "none":
        p.error("--kernels reference is already the reference side: add --reference none")
    if args.replot and not args.plot:
        p.error("--replot needs --plot DIR")
    if not args.replot and not (args.batches and args.contexts):
        p.error("--batches and --contexts need at least one value each")
    if min(args.profile_batches) < 1 or len(set(args.profile_batches)) != len(args.profile_batches):
        p.error(f"--profile-batches must be distinct values >= 1, got {args.profile_batches}")
    if args.profile_batches != [1] and not args.profile:
        p.error("--profile-batches needs --profile DIR")
    for name in ("steps", "calls", "prefill_calls", "prefill_chunk", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _model_config(args):
    return presets.named(args.preset, args.layers)


def _machine() -> dict:
    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": device.device_kind, "n_devices": jax.device_count(),
            "host": platform.node(), "cpu_count": os.cpu_count(), "jax": jax.__version__}


def _save(result: dict, path: str | None) -> None:
    """Write the results so far (a long run that is stopped keeps every case it finished)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def run(args) -> dict:
    cfg = _model_config(args)
    kv_cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    backend = "gpu" if jax.default_backend() == "gpu" else "cpu"
    probe_bytes, probe_n = DEFAULT_PROBES[backend]
    probe_bytes, probe_n = args.bandwidth_bytes or probe_bytes, args.matmul_n or probe_n
    mesh = make_mesh(args.devices) if args.devices > 1 else None
    result = {"date": datetime.date.today().isoformat(),
              "command": " ".join(["python -m dsv4_jax.bench"] + list(args.argv)), "machine": _machine(),
              "source": source_digest()}

    # the decode rows' token choice: the same program for any values, but greedy, unfiltered and filtered rows
    # take different paths through it (sampling.sample_rows)
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    t0 = time.perf_counter()
    try:
        settings = Settings(dtype=args.dtype, act_quant=args.act_quant, kernels=args.kernels,
                            kernel_overrides=args.kernel_override, scan_layers=args.scan_layers)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    model = init_random(cfg, seed=0, mesh=mesh, settings=settings)
    jax.block_until_ready(model.params)
    held = sum(weight_bytes_by_part(cfg).values())
    result["model"] = {"preset": args.preset, "layers": cfg.n_layers, "weights_bytes": held,
                       "init_s": time.perf_counter() - t0, "dtype": args.dtype, "act_quant": args.act_quant,
                       "kernels": args.kernels,
                       "scan_layers": model.scan_layers, "kv_cache_dtype": args.kv_cache_dtype,
                       "kernel_backend": model.context.kernels.backend, "devices": args.devices,
                       "kernel_overrides": dict(model.context.kernels.overrides), "stats": args.stats,
                       "sampling": sampling}
    drawn = "greedy rows" if args.temperature == 0 else (f"rows sampled at temperature {args.temperature}, top-k "
                                                         f"{args.top_k}, top-p {args.top_p}")
    print(f"{args.preset} geometry, {cfg.n_layers} layers: {held / 1e9:.3f} GB of weights on "
          f"{result['machine']['device_kind']} ({model.context.kernels.backend or 'reference'} kernels; decode "
          f"{drawn})", flush=True)

    bandwidth = probes.memory_bandwidth(probe_bytes)
    fp8_rate = probes.matmul_rate(probe_n, jnp.float8_e4m3fn)
    bf16_rate = probes.matmul_rate(probe_n, jnp.bfloat16)
    result["device"] = {"bandwidth_bytes_per_s": bandwidth, "bandwidth_probe_bytes": probe_bytes,
                        "fp8_flops_per_s": fp8_rate, "bf16_flops_per_s": bf16_rate, "matmul_probe_n": probe_n}
    print(f"device: {bandwidth / 1e9:.0f} GB/s (bf16 GEMV), {fp8_rate / 1e12:.1f} TFLOP/s fp8, "
          f"{bf16_rate / 1e12:.1f} TFLOP/s bf16 (XLA matmul n={probe_n})", flush=True)

    main_side = args.kernels            # the label of the main side's cases ("auto" unless --kernels says)
    side_settings = {main_side: settings}
    if args.reference != "none":
        side_settings["reference"] = Settings.of(settings, kernels="reference", kernel_overrides=())
    contexts = {main_side: model.context.replace(stats=args.stats)}
    if args.reference != "none":
        contexts["reference"] = side_settings["reference"].run_context(mesh)
    result["compile"] = {}
    for side, ctx in contexts.items():
        seconds, program, state = cases.decode_step_compile_seconds(model.params, cfg, ctx, 1, args.contexts[0], mesh,
                                                                    kv_cache_dtype)
        result["compile"][f"decode_step_s_{side}"] = seconds
        del program, state
    if args.profile:
        result["profiles"] = []
        for batch in args.profile_batches:
            _, program, state = cases.decode_step_compile_seconds(model.params, cfg, contexts[main_side], batch,
                                                                  args.contexts[0], mesh, kv_cache_dtype)
            # random tokens: rows at one token would all route to the same experts
            tokens = jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, cfg.vocab_size, jnp.int32)
            steps = 5
            directory = os.path.join(args.profile, f"batch{batch}")
            op_profile.trace_steps(program, model.params, state, (tokens,), steps, directory)
            table = op_profile.op_table(directory, program.as_text(), steps)
            table["bytes_by_family"] = bytes_by_family(cfg, batch, args.contexts[0], args.dtype,
                                                       kv_cache_dtype=kv_cache_dtype)
            result["profiles"].append({"batch": batch, "context": args.contexts[0], **table})
            result["profile"] = result["profiles"][0]
            _save(result, args.out)
            del program, state
    if args.profile_prefill:
        steps = 3
        program, state, inputs = cases.prefill_chunk_program(model.params, cfg, model.context, args.prefill_chunk,
                                                             steps + 1, mesh, kv_cache_dtype)
        op_profile.trace_steps(program, model.params, state, inputs, steps, args.profile_prefill)
        table = op_profile.op_table(args.profile_prefill, program.as_text(), steps)
        result["profile_prefill"] = {"chunk": args.prefill_chunk, **table}
        _save(result, args.out)
        del program, state

    result["decode"] = []
    for context in args.contexts:
        for batch in args.batches:
            floor = roofline(cfg, batch, context, args.dtype, kv_cache_dtype=kv_cache_dtype)
            for side, ctx in contexts.items():
                case = cases.time_decode(model.params, cfg, ctx, batch, context, args.steps, args.calls, mesh,
                                         kv_cache_dtype, sampling)
                case["kernels"] = side
                case["floor_bytes"] = floor.total_bytes
                case["floor_ms"] = 1e3 * floor.seconds(bandwidth)
                case["fraction_of_floor"] = case["floor_ms"] / case["ms_per_step"]
                case["tokens_per_s"] = batch * 1e3 / case["ms_per_step"]
                result["decode"].append(case)
                _save(result, args.out)
                print(f"decode  batch {batch:3d}  context {context:7d}  {side:9s}  {case['ms_per_step']:9.3f} ms/step"
                      f"  floor {case['floor_ms']:.3f} ms ({100 * case['fraction_of_floor']:.0f}%)", flush=True)
    result["speculative"] = []
    for k in args.speculative_tokens:
        for batch in args.batches:
            case = cases.time_speculative(model.params, cfg, model.context, batch, args.contexts[0], k, args.steps,
                                          args.calls, mesh, kv_cache_dtype, sampling)
            plain = next(c for c in result["decode"] if c["kernels"] == main_side and c["batch"] == batch
                         and c["context"] == args.contexts[0])
            # tokens a step must yield on average for speculation to beat plain decoding
            case["break_even_tokens_per_step"] = case["ms_per_step"] / plain["ms_per_step"]
            result["speculative"].append(case)
            _save(result, args.out)
            print(f"speculative k {k}  batch {batch:3d}  context {args.contexts[0]:7d}  {case['ms_per_step']:9.3f} "
                  f"ms/step ({case['break_even_tokens_per_step']:.2f}x the plain step)", flush=True)
    first = [c for c in result["decode"] if c["batch"] == args.batches[0] and c["context"] == args.contexts[0]]
    for case in first:
        result["compile"][f"generate_chunk_s_{case['kernels']}"] = case["generate_chunk_compile_s"]

    result["prefill"] = []
    prefill_sides = {k: v for k, v in contexts.items() if k == main_side or args.reference == "all"}
    for tokens in args.prompts:
        flops = prefill_flops(cfg, tokens)
        for side, ctx in prefill_sides.items():
            case = cases.time_prefill(model.params, cfg, side_settings[side], tokens, args.prefill_chunk,
                                      args.prefill_calls, mesh, kv_cache_dtype)
            case["kernels"] = side
            case["flops"] = flops
            case["fraction_of_fp8_rate"] = flops / (case["ttft_ms"] / 1e3) / fp8_rate
            result["prefill"].append(case)
            _save(result, args.out)
            print(f"prefill {tokens:7d} tokens  {side:9s}  ttft {case['ttft_ms']:10.1f} ms  "
                  f"{case['tokens_per_s']:9.0f} tok/s  ({100 * case['fraction_of_fp8_rate']:.1f}% of fp8 rate)",
                  flush=True)
    return result


def _reference_of(cases: list[dict], keys: tuple[str, ...]) -> dict:
    return {tuple(c[k] for k in keys): c for c in cases if c["kernels"] == "reference"}


def tables(result: dict) -> str:
    """The result as the text tables the benchmark prints."""
    model, dev = result["model"], result["device"]
    lines = [f"{model['preset']} geometry, {model['layers']} layers, {result['machine']['device_kind']}, "
             f"{result['date']}",
             f"device: {dev['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s bf16 GEMV, {dev['fp8_flops_per_s'] / 1e12:.1f} "
             f"TFLOP/s fp8, {dev['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s bf16 (XLA)", "",
             f"{'batch':>5} {'context':>8} {'ms/step':>9} {'tok/s':>9} {'floor ms':>9} {'of floor':>8} "
             f"{'ref ms':>9} {'speedup':>8}"]
    main_side = model["kernels"]
    ref = _reference_of(result["decode"], ("batch", "context"))
    for c in result["decode"]:
        if c["kernels"] != main_side:
            continue
        r = ref.get((c["batch"], c["context"]))
        ref_ms, speedup = ("-", "-") if not r else (f"{r['ms_per_step']:.3f}",
                                                     f"{r['ms_per_step'] / c['ms_per_step']:.1f}x")
        lines.append(f"{c['batch']:5d} {c['context']:8d} {c['ms_per_step']:9.3f} {c['tokens_per_s']:9.1f} "
                     f"{c['floor_ms']:9.3f} {100 * c['fraction_of_floor']:7.0f}% {ref_ms:>9} {speedup:>8}")
    lines += ["", f"{'prompt':>7} {'ttft ms':>10} {'tok/s':>9} {'of fp8':>7} {'ref ttft ms':>12} {'speedup':>8}"]
    ref = _reference_of(result["prefill"], ("prompt_tokens",))
    for c in result["prefill"]:
        if c["kernels"] != main_side:
            continue
        r = ref.get((c["prompt_tokens"],))
        ref_ms, speedup = (f"{r['ttft_ms']:.1f}", f"{r['ttft_ms'] / c['ttft_ms']:.1f}x") if r else ("-", "-")
        lines.append(f"{c['prompt_tokens']:7d} {c['ttft_ms']:10.1f} {c['tokens_per_s']:9.0f} "
                     f"{100 * c['fraction_of_fp8_rate']:6.1f}% {ref_ms:>12} {speedup:>8}")
    if result.get("speculative"):
        lines += ["", f"{'k':>2} {'batch':>5} {'ms/step':>9} {'x plain':>8} {'tokens/step':>11}"]
        lines += [f"{c['k']:2d} {c['batch']:5d} {c['ms_per_step']:9.3f} {c['break_even_tokens_per_step']:7.2f}x "
                  f"{c['tokens_per_step']:11.2f}" for c in result["speculative"]]
    lines += ["", "compile: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["compile"].items())]
    decode_profiles = result.get("profiles", [result["profile"]] if "profile" in result else [])
    traced = [("one batch-{batch} decode step", prof) for prof in decode_profiles]
    traced += [("one {chunk}-token prefill chunk", result["profile_prefill"])] if "profile_prefill" in result else []
    for what, prof in traced:
        lines += ["", f"{what.format(**prof)}: {prof['kernel_ms_per_step']:.3f} ms of kernels, "
                      f"{prof['launches']['launches_per_call']} launches"]
        floor = prof.get("bytes_by_family", {})
        for fam, row in prof["by_family"].items():
            line = f"  {fam:<22} {row['ms']:8.3f} ms {row['percent']:5.1f}%"
            if floor.get(fam):        # the bytes the family must read, and the rate its kernels read them at
                line += f"  {floor[fam] / 1e6:9.1f} MB  {floor[fam] / row['ms'] / 1e6:7.0f} GB/s"
            lines.append(line)
        if prof.get("top_sites"):       # absent in results written before the sites were recorded
            lines.append(f"  the {PRINTED_SITES} sites that take the most (an op, summed over the layers of a kind):")
            lines += [f"    {site['ms']:8.3f} ms {site['percent']:5.1f}% {site['kernels']:6.1f} kernels  "
                      f"{site['family']:<20} {site['site']}" for site in prof["top_sites"][:PRINTED_SITES]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            for path in write_plots(json.load(f), args.plot):
                print(path)
        return 0
    result = run(args)
    print()
    print(tables(result))
    if args.out:
        _save(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
