"""Where a decode step's (or a prefill chunk's) time goes: a `jax.profiler` trace of a few calls of the compiled
program, each kernel's time attributed to an op family (hlo_census.FAMILY_OF_SCOPE) through the HLO op the trace
names.

The trace is written with its Perfetto JSON (`perfetto_trace.json.gz`, kept under the profile directory). Kernel
events carry `hlo_module` / `hlo_op` arguments; on a GPU only device-side events are summed (each kernel once), on
the CPU the thunk events. Kernels that run inside a CUDA graph may not carry their HLO op: profile with command
buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=) for a complete table; unattributed time is reported as
such, never spread over the families.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

import jax

from ..hlo_census import census, op_sites


TOP_SITES = 40          # the sites (an op of the model in each layer of one kind) listed with their time


def trace_steps(program, params, state, inputs: tuple, steps: int, directory: str):
    """Run a compiled program (params, state, *inputs) -> (output, state), the decode step or a prefill chunk,
    `steps` times under the profiler after one untraced call, each call taking the state the last one returned.
    Returns the state."""
    _, state = program(params, state, *inputs)
    jax.block_until_ready(state)
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            out, state = program(params, state, *inputs)
        jax.block_until_ready((out, state))
    return state


def _trace_events(directory: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def op_table(directory: str, hlo_text: str, steps: int) -> dict:
    """Per-family kernel time of one call (ms and % of the kernels' total) from the trace under `directory` and the
    traced program's HLO text, the TOP_SITES sites that take the most (hlo_census.op_sites: one op of the model,
    summed over the layers of a kind, with its kernels per call), and the program's launch census."""
    module = hlo_text.split(None, 2)[1].rstrip(",")          # "HloModule jit_decode_step, ..."
    events = _trace_events(directory)
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    sites = op_sites(hlo_text)
    per_family = collections.Counter()
    per_site, site_kernels = collections.Counter(), collections.Counter()
    kernels = 0
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or args.get("hlo_module", module) != module or e["name"].startswith("end: "):
            continue
        on_device = e["pid"] in device_pids
        if device_pids and not on_device:
            continue
        if not device_pids and "hlo_op" not in args:
            continue
        op = args.get("hlo_op", e["name"])
        fam, site = sites.get(op, ("unattributed", op))
        per_family[fam] += e.get("dur", 0.0)
        per_site[(fam, site)] += e.get("dur", 0.0)
        site_kernels[(fam, site)] += 1
        kernels += 1
    total_us = sum(per_family.values())
    if not total_us:
        raise RuntimeError(f"the trace under {directory} has no kernel events of module {module}")
    rows = {fam: {"ms": us / steps / 1e3, "percent": 100.0 * us / total_us}
            for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1])}
    top = [{"family": fam, "site": site, "ms": us / steps / 1e3, "percent": 100.0 * us / total_us,
            "kernels": site_kernels[(fam, site)] / steps}
           for (fam, site), us in per_site.most_common(TOP_SITES)]
    return {"kernel_ms_per_step": total_us / steps / 1e3, "kernels_traced_per_step": kernels / steps,
            "by_family": rows, "top_sites": top, "launches": census(hlo_text).as_dict()}
