"""What choosing a decode step's tokens costs on the device: `sampling.sample_rows` over [batch, vocab] float32 logits
(Flash's vocabulary by default), for greedy rows, temperature-only rows, rows with top-p, top-k or both (the filters
by rejection, without a sort; with both, the k-th value by a radix search too), beside its sorting path forced for
every batch (`sort_path`: each row's vocabulary sorted for its filters, which every batch paid before greedy and
unfiltered batches skipped the sort, and filtering ones tried rejection first). The two must choose the same tokens.

Each case: the GPU kernel time of one call (CUPTI, `jax.experimental.mosaic.gpu.profiler.measure`; launch gaps
excluded) and the wall time of `--calls` back-to-back calls divided by their number (dispatch overlapped), median of
`--repeats`. Prints a table and writes JSON (with the package's source digest).

    PYTHONPATH=. python3 benchmarks/bench_sampling.py --batches 1,32,64,128 --out out/bench_sampling.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import numpy as np

from dsv4_jax import sampling
from dsv4_jax.source_digest import source_digest

FLASH_VOCAB = 129280
CASES = {                                   # name -> (temperature, top_k, top_p) of every row
    "greedy": (0.0, 0, 1.0),
    "temperature": (0.8, 0, 1.0),
    "top_p": (0.6, 0, 0.95),
    "top_k": (0.8, 50, 1.0),
    "top_k_top_p": (0.8, 50, 0.95),
}


def _sort_path(logits, step, rows):
    """sample_rows' third path (the vocabulary sorted for the filters) for any rows."""
    noise = sampling.row_noise(rows, step, logits.shape[-1])
    return sampling._draw(logits, noise, rows.temperature, rows.top_k, rows.top_p, filtered=True)


IMPLS = {"sample_rows": sampling.sample_rows, "sort_path": _sort_path}


def _rejection_rounds(logits, step, rows):
    """The rounds sample_rows' filters without a sort take to decide every row of the batch (None: more than
    sampling.MAX_REJECTION_ROUNDS, so the sort), found by raising the bound on the host."""
    noise = sampling.row_noise(rows, step, logits.shape[-1])
    draw = jax.jit(sampling._draw_by_rejection, static_argnames="max_rounds")
    for rounds in range(1, sampling.MAX_REJECTION_ROUNDS + 1):
        _, decided = draw(logits, noise, rows.temperature, rows.top_k, rows.top_p, max_rounds=rounds)
        if bool(np.all(np.asarray(decided))):
            return rounds
    return None


def _kernel_us(fn, args, iters):
    """Median GPU kernel time of one call (us), or None where CUPTI is not available (e.g. on a CPU)."""
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, t = profiler.measure(fn, iterations=iters)(*args)
        return 1e3 * statistics.median(t)
    except Exception as e:   # noqa: BLE001 - report and go on with wall time
        print(f"  CUPTI: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
        return None


def _wall_us(fn, args, calls, repeats):
    """Median over `repeats` of the wall time of `calls` back-to-back calls / calls (us)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--vocab", type=int, default=FLASH_VOCAB)
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_sampling.json")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; expected some of {list(CASES)}")
    device = jax.devices()[0]
    result = {"date": datetime.date.today().isoformat(), "device": device.device_kind, "jax": jax.__version__,
              "vocab": args.vocab, "calls": args.calls, "repeats": args.repeats,
              "source": source_digest(), "cases": []}
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = jax.device_put((3 * rng.standard_normal((batch, args.vocab))).astype(np.float32))
        step = jax.device_put(np.arange(batch, dtype=np.int32))
        for case in cases:
            temperature, top_k, top_p = CASES[case]
            rows = sampling.Sampling.rows(batch, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
            tokens = {}
            rounds = _rejection_rounds(logits, step, rows) if temperature > 0 and (top_k or top_p < 1) else None
            for impl, fn in IMPLS.items():
                jitted = jax.jit(fn)
                tokens[impl] = np.asarray(jitted(logits, step, rows))
                record = {"batch": batch, "case": case, "impl": impl, "temperature": temperature, "top_k": top_k,
                          "top_p": top_p, "wall_us": _wall_us(jitted, (logits, step, rows), args.calls, args.repeats),
                          "kernel_us": _kernel_us(jitted, (logits, step, rows), args.calls),
                          "rejection_rounds": rounds if impl == "sample_rows" else None}
                result["cases"].append(record)
                print(json.dumps(record), flush=True)
            if not np.array_equal(tokens["sample_rows"], tokens["sort_path"]):
                raise SystemExit(f"batch {batch}, {case}: sample_rows and its sorting path chose different tokens")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{'batch':>5} {'case':>12} {'impl':>15} {'wall us':>9} {'kernel us':>10} {'rounds':>6}")
    for r in result["cases"]:
        kernel = "-" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
        rounds = "-" if r["rejection_rounds"] is None else str(r["rejection_rounds"])
        print(f"{r['batch']:5d} {r['case']:>12} {r['impl']:>15} {r['wall_us']:9.1f} {kernel:>10} {rounds:>6}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
