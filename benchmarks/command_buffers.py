"""How XLA split each compiled program into command buffers (CUDA graphs), read from its compile log.

XLA forms command buffers after HLO, on the thunk sequence (CommandBufferConversionPass): runs of thunks it can
record become one CommandBufferThunk (one graph launch); a thunk it cannot record (a kind that is not enabled, or a
run shorter than --xla_gpu_graph_min_graph_size) runs on its own between them. The pass says what it did at
VLOG 2, so compile with its logging on and read the log:

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 \\
        python3 -m dsv4_jax.bench --preset flash --layers 4 --batches 1 --contexts 4096 --prompts none \\
        --reference none 2> compile.log
    python3 benchmarks/command_buffers.py compile.log --json command_buffers.json

Per program (jit_decode_step, jit_generate_chunk, ...): the command buffers, the thunks inside them, and the
thunks left outside with the pass's reason. Compile on the GPU that will run the program: compiled without one
(a deviceless compile), the CUDA driver version reads 0, and XLA drops the command types that need stream capture
(custom calls, cuBLAS), so the log describes a different split than the GPU's.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_MODULE = re.compile(r"Module (\S+) CommandBufferConfig: enabled_commands: \[([^\]]*)\]")
_SEGMENT = re.compile(r"Creating command buffer thunk.*? with the following thunks: (.*)$")
_OUTSIDE = re.compile(r"Thunk kind (\w+) (is not lowered to command buffer because command size is less than the "
                      r"min graph size|lowering is not enabled by the user for type \w+)")
_UNSUPPORTED = re.compile(r"Unsupported thunk kind: (\w+)")


def parse(lines) -> list[dict]:
    """One record per compiled program, in log order: name, enabled command types, the command buffers (the
    thunks of each) and the thunks outside them (kind, reason)."""
    programs = []
    for line in lines:
        if m := _MODULE.search(line):
            programs.append({"module": m.group(1), "enabled_commands": [c.strip() for c in m.group(2).split(",")
                                                                       if c.strip()],
                             "command_buffers": [], "outside": []})
        elif not programs:
            continue
        elif m := _SEGMENT.search(line):
            programs[-1]["command_buffers"].append([t.strip() for t in m.group(1).split(",")])
        elif m := _OUTSIDE.search(line):
            reason = "shorter than the min graph size" if "min graph size" in m.group(2) else m.group(2)
            programs[-1]["outside"].append({"kind": m.group(1), "reason": reason})
        elif m := _UNSUPPORTED.search(line):
            programs[-1]["outside"].append({"kind": m.group(1), "reason": "kind not supported"})
    return programs


def summary(program: dict) -> dict:
    reasons = collections.Counter(f"{o['kind']}: {o['reason']}" for o in program["outside"])
    return {"module": program["module"], "enabled_commands": program["enabled_commands"],
            "command_buffers": len(program["command_buffers"]),
            "thunks_in_command_buffers": sum(len(c) for c in program["command_buffers"]),
            "thunks_outside": len(program["outside"]), "outside_by_reason": dict(reasons)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="a compile log with TF_CPP_VMODULE=command_buffer_conversion_pass=2")
    p.add_argument("--json", metavar="FILE", help="write the per-program summary and the segments here")
    p.add_argument("--all", action="store_true", help="also list XLA's small helper programs ('Anonymous')")
    args = p.parse_args(argv)
    with open(args.log, errors="replace") as f:
        programs = [r for r in parse(f) if args.all or r["module"] != "Anonymous"]
    if not programs:
        print(f"{args.log}: no CommandBufferConversionPass lines; compile with TF_CPP_MIN_LOG_LEVEL=0 "
              "TF_CPP_VMODULE=command_buffer_conversion_pass=2", file=sys.stderr)
        return 1
    print(f"{'program':<24} {'command buffers':>15} {'thunks inside':>13} {'outside':>8}  enabled")
    for program in programs:
        s = summary(program)
        print(f"{s['module']:<24} {s['command_buffers']:>15} {s['thunks_in_command_buffers']:>13} "
              f"{s['thunks_outside']:>8}  {','.join(s['enabled_commands'])}")
        for reason, n in sorted(s["outside_by_reason"].items(), key=lambda kv: -kv[1]):
            print(f"    {n:>5} outside  {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**summary(r), "segments": r["command_buffers"]} for r in programs], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
