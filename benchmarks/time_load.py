"""Load time of a checkpoint from its safetensors and from an Orbax copy of it (dsv4_jax.save), best of N.

    python benchmarks/time_load.py                       # the packaged default model
    python benchmarks/time_load.py --checkpoint DIR --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import dsv4_jax  # noqa: E402


def best_load_time(path: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(dsv4_jax.load(path).params)
        best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(os.path.dirname(dsv4_jax.__file__), "default_model"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    safetensors = best_load_time(args.checkpoint, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "orbax")
        dsv4_jax.save(dsv4_jax.load(args.checkpoint), copy)
        orbax = best_load_time(copy, args.repeats)
    print(f"{args.checkpoint}: load (best of {args.repeats}) safetensors {safetensors:.3f} s, orbax {orbax:.3f} s")


if __name__ == "__main__":
    main()
