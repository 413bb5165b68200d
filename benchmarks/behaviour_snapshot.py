"""A snapshot of what the model computes, to show that a change of code left it unchanged: float32 logits of forward,
prefill, decode steps and greedy generation on the packaged model and on a checkpoint written by the tests'
writer, on the reference plan and on the "interpret" kernel plan; the decode programs alone (kernel plan) from one
reference-prefilled state; and the CPU time of a decode step.

    python benchmarks/behaviour_snapshot.py capture before.npz        # in a checkout of the code before the change
    python benchmarks/behaviour_snapshot.py capture after.npz         # in the changed checkout
    python benchmarks/behaviour_snapshot.py compare before.npz after.npz
    python benchmarks/behaviour_snapshot.py time                      # ms per decode step (run the two trees in turn)

Each checkout is imported from the current directory (run it from the repository root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax import presets  # noqa: E402

MODELS = {"default": {}, "default_fp8kv": dict(kv_cache_dtype="fp8"), "default_scan": dict(scan_layers=True),
          "default_actfp8": dict(act_quant="fp8")}


def _run(out: dict, tag: str, model, rng, steps: int = 5):
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 37)).astype(np.int32)
    out[f"{tag}/forward"] = np.asarray(model.forward(tokens))
    logits, state = model.prefill(tokens)
    out[f"{tag}/prefill"] = np.asarray(logits)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for i in range(steps):
        logits, state = model.decode(token, state)
        out[f"{tag}/decode{i}"] = np.asarray(logits)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    result = model.generate([list(tokens[0][:20]), list(tokens[1][:9])], max_new_tokens=12)
    out[f"{tag}/generate"] = np.array([list(r) + [-1] * (12 - len(r)) for r in result.tokens])


def _decode_programs(out: dict, tag: str, path, options: dict, rng):
    """Kernel-plan decode steps from a reference-plan prefill: the decode programs alone."""
    ref = dsv4_jax.load(path, dtype="float32", max_seq_len=256, max_batch=2, kernels="reference", **options)
    kernel = dsv4_jax.load(path, dtype="float32", max_seq_len=256, max_batch=2, kernels="interpret", **options)
    logits, state = ref.prefill(rng.integers(0, ref.config.vocab_size, size=(2, 37)).astype(np.int32))
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for i in range(4):
        logits, state = kernel.decode(token, state)
        out[f"{tag}_decode_programs/decode{i}"] = np.asarray(logits)
        token = jnp.argmax(logits, -1).astype(jnp.int32)


def capture(path: str):
    from ckpt_writer import write_checkpoint
    out, rng = {}, np.random.default_rng(0)
    checkpoint = tempfile.mkdtemp()
    write_checkpoint(checkpoint, presets.tiny(), seed=1, num_shards=1)
    for plan in ("reference", "interpret"):
        for tag, options in MODELS.items():
            _run(out, f"{tag}_{plan}", dsv4_jax.load(dtype="float32", max_seq_len=256, max_batch=2, kernels=plan,
                                                     **options), rng)
        _run(out, f"checkpoint_{plan}", dsv4_jax.load(checkpoint, dtype="float32", max_seq_len=256, max_batch=2,
                                                      kernels=plan), rng)
        print(f"{plan} plan captured", flush=True)
    for tag, path_, options in (("default", None, {}), ("default_actfp8", None, dict(act_quant="fp8")),
                                ("checkpoint", checkpoint, {})):
        _decode_programs(out, tag, path_, options, rng)
    np.savez(path, **out)


def compare(before: str, after: str) -> int:
    a, b = np.load(before), np.load(after)
    if sorted(a.files) != sorted(b.files):
        print(f"the snapshots hold different arrays: {sorted(set(a.files) ^ set(b.files))}")
        return 1
    differing = 0
    for name in sorted(a.files):
        same = np.array_equal(a[name], b[name], equal_nan=True)
        differing += not same
        if not same:
            delta = np.nanmax(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64)))
            print(f"differs: {name} (max |delta| {delta:.3g})")
    print(f"{len(a.files) - differing} of {len(a.files)} arrays bit-identical")
    return 0


def time_decode():
    model = dsv4_jax.load()
    logits, state = model.prefill(np.arange(1, 33, dtype=np.int32)[None])
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    times = []
    for i in range(43):
        t0 = time.perf_counter()
        logits, state = model.decode(token, state)
        logits.block_until_ready()
        if i >= 3:                                            # after the compile and two warm-up steps
            times.append(time.perf_counter() - t0)
    print(json.dumps({"tree": os.getcwd(), "ms_per_step_median": 1e3 * statistics.median(times),
                      "ms_per_step_min": 1e3 * min(times)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("capture").add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    sub.add_parser("time")
    args = p.parse_args(argv)
    if args.command == "capture":
        capture(args.out)
    elif args.command == "compare":
        return compare(args.before, args.after)
    else:
        time_decode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
