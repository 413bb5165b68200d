"""Time the decode attention kernel (pallas_kernels/decode_attention.py) against XLA's path for one layer's
attention at Flash geometry (64 heads of 512, window 128; CSA: 512 picks of 1,024 entries; HCA: 32 entries), batch 1,
one token, and sweep the kernel's schedule (heads per program, keys per step, splits, warps, stages).

    python benchmarks/bench_decode_attention.py --out decode_attention.json
    python benchmarks/bench_decode_attention.py --prefill 8192 --out prefill_attention.json   # a prefill chunk

Each case runs 50 times chained in one jitted program (each call's query depends on the previous output, so
the calls cannot overlap), on the attached GPU; the table gives microseconds per call. XLA's path is what the
model runs without the kernel: the query's per-head norm and RoPE (norm_rope kernel), window + compressed keys in
one array, one softmax (attention._attend_one_token) and the inverse RoPE. The kernel's rows run what the model
runs with it: norm_rope's query kernel, then the kernel (and its merge) with the inverse RoPE; at the default
schedule also the kernel making the query itself in every program, and the kernel on a ready query without the
inverse RoPE.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ITERS = 50


def inputs(ratio: int, batch: int = 1):
    """One layer's decode inputs at Flash geometry (random; position 4,000)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)   # noqa: E731
    n_entries = 1024 if ratio == 4 else 32
    start = jnp.full((batch,), 4000, jnp.int32)
    picks = jnp.asarray(np.stack([rng.permutation(1000)[:512] for _ in range(batch)])[:, None], jnp.int32)
    return dict(q=jnp.asarray(rng.standard_normal((batch, 1, 64, 512)), jnp.float32), ring=bf(batch, 128, 512),
                kv=bf(batch, 1, 512), start=start, sink=jnp.asarray(rng.standard_normal(64), jnp.float32),
                compressed=bf(batch, n_entries, 512), picks=picks if ratio == 4 else None)


def prefill_inputs(ratio: int, tokens: int):
    """One layer's inputs for a prefill chunk of `tokens` tokens at Flash geometry, the second chunk of a prompt
    (positions tokens .. 2 tokens - 1: the ring full, CSA's 512 picks per token among its visible entries): the
    query normalised and rotated in bf16, as XLA's fusions hand it to the attention core."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)   # noqa: E731
    n_entries = 2 * tokens // ratio if ratio else 0
    picks = None
    if ratio == 4:
        visible = (tokens + np.arange(tokens) + 1) // 4
        picks = np.full((tokens, 512), -1, np.int32)          # (fewer visible than 512: -1, none, after them)
        for i, v in enumerate(visible):
            picks[i, :min(v, 512)] = rng.choice(v, min(v, 512), replace=False)
        picks = jnp.asarray(picks[None])
    return dict(q=bf(1, tokens, 64, 512), ring=bf(1, 128, 512), kv=bf(1, tokens, 512),
                start=jnp.full((1,), tokens, jnp.int32), sink=jnp.asarray(rng.standard_normal(64), jnp.float32),
                compressed=bf(1, n_entries, 512) if ratio else None, picks=picks)


def xla_prefill_path(q, ring, kv, start, sink, compressed, picks, *, ratio):
    """What the model runs for a prefill chunk without the kernel: attention_core._attend (the window in blocks of
    128 queries, the picked or visible entries) and the inverse RoPE."""
    import jax.numpy as jnp

    from dsv4_jax.numerics.kv_cache import PlainEntries
    from dsv4_jax.ops import attention_core as attention
    from dsv4_jax.ops.norm_rope import apply_rope

    positions = start[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    sel = None if picks is None else (picks, (picks >= 0) & (picks < (positions[:, :, None] + 1) // 4))
    out = attention._attend(q, PlainEntries(ring), kv, start, positions, sink, 512 ** -0.5, 128, ratio,
                            None if compressed is None else PlainEntries(compressed), sel)
    return apply_rope(out, positions[:, :, None], _inv_freq(), inverse=True)


def kernel_prefill_path(q, ring, kv, start, sink, compressed, picks, *, ratio):
    """The kernel on a prefill chunk as ops/attention_core.py calls it (query ready, inverse RoPE in the kernel);
    in interpret mode without a GPU (a check of this script, not a timing)."""
    import jax

    from dsv4_jax.pallas_kernels import decode_attention as da
    return da.decode_attention(q, ring, kv, start, sink, scale=512 ** -0.5, compressed=compressed, picks=picks,
                               ratio=ratio, rope=(_inv_freq(), 1e-6), query_ready=True,
                               interpret=jax.default_backend() != "gpu")


def _inv_freq():
    import numpy as np
    return (10000.0 ** (-np.arange(0, 64, 2) / 64)).astype(np.float32)


def xla_path(q, ring, kv, start, sink, compressed, picks, *, ratio):
    """What the model runs without the kernel: norm_rope's query kernel, then XLA's attention and inverse RoPE."""
    import jax.numpy as jnp

    from dsv4_jax.ops import attention_core as attention
    from dsv4_jax.ops.norm_rope import apply_rope
    from dsv4_jax.pallas_kernels import norm_rope

    inv_freq = _inv_freq()
    positions = start[:, None]
    qn = norm_rope.rms_norm_rows(q, None, eps=1e-6, in_dtype=jnp.bfloat16, rope=(positions, inv_freq))
    keys = jnp.concatenate([ring, kv], axis=1)
    key_pos = jnp.concatenate([attention.ring_positions(start, 128), start[:, None]], axis=1)
    sel = None if picks is None else (picks, picks < (start[:, None, None] + 1) // 4)
    out = attention._attend_one_token(qn, keys, key_pos, positions, sink, 512 ** -0.5, 128, ratio, compressed, sel)
    return apply_rope(out, positions[:, :, None], inv_freq, inverse=True)


def kernel_path(q, ring, kv, start, sink, compressed, picks, *, ratio, ready: bool = True):
    """The decode attention kernel with its schedule as the module's constants set it. `ready`: as the model calls
    it, on the query of norm_rope's kernel (one launch per token), the kernel doing the inverse RoPE; else the
    kernel also makes the query (norm, RoPE) from wq_b's float32 output, in every program."""
    import jax.numpy as jnp

    from dsv4_jax.pallas_kernels import decode_attention as da
    from dsv4_jax.pallas_kernels import norm_rope

    if ready:
        q = norm_rope.rms_norm_rows(q, None, eps=1e-6, in_dtype=jnp.bfloat16, rope=(start[:, None], _inv_freq()))
    return da.decode_attention(q, ring, kv, start, sink, scale=512 ** -0.5, compressed=compressed, picks=picks,
                               ratio=ratio, rope=(_inv_freq(), 1e-6), query_ready=ready)


def kernel_without_rope(q, ring, kv, start, sink, compressed, picks, *, ratio):
    """The kernel on a query already normalised and rotated (rope=None: no query prologue, no inverse RoPE), to
    time what the prologue and the output's rotation cost."""
    import jax.numpy as jnp

    from dsv4_jax.pallas_kernels import decode_attention as da
    return da.decode_attention(q.astype(jnp.bfloat16), ring, kv, start, sink, scale=512 ** -0.5,
                               compressed=compressed, picks=picks, ratio=ratio)


def _timed(fn, args, iters: int = ITERS) -> float:
    """Microseconds per call of fn, from `iters` calls chained in one program (unrolled: a loop on the GPU would add
    its per-iteration condition check to every call), best of three runs."""
    import jax
    import jax.numpy as jnp

    def chain(q, *rest):
        for _ in range(iters):
            q = (q + fn(q, *rest).astype(jnp.float32) * 1e-30).astype(q.dtype)
        return q

    run = jax.jit(chain)
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def _save(path: str, iters: int, rows: list[dict]) -> None:
    """The rows as JSON at path, with the device and this run's arguments."""
    import jax
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "argv": sys.argv[1:], "iters": iters, "rows": rows}, f,
                  indent=1)


PREFILL_ITERS = 3     # chained calls per timed program (XLA compiles each unrolled copy of its path)


def sweep_prefill(tokens: int, heads: list[int], warps: list[int], stages: list[int], out: str | None) -> list[dict]:
    """A prefill chunk of `tokens` tokens per layer kind: XLA's path, then the kernel at each (heads per program,
    warps, stages); the kernel's output checked against XLA's first (bf16: within 2e-2 of the largest value). The
    rows so far go to `out` after each case (a run stopped by its time limit keeps them)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4_jax.pallas_kernels import decode_attention as da

    rows = []

    def emit(row):
        rows.append(row)
        print(row, flush=True)
        if out:
            _save(out, PREFILL_ITERS, rows)

    for ratio in (4, 0, 128):              # CSA first: the layer kind the kernel should help most
        x = prefill_inputs(ratio, tokens)
        args_ = (x["q"], x["ring"], x["kv"], x["start"], x["sink"], x["compressed"], x["picks"])
        want = np.asarray(jax.jit(functools.partial(xla_prefill_path, ratio=ratio))(*args_).astype(jnp.float32))
        emit({"ratio": ratio, "tokens": tokens, "path": "xla",
              "us": _timed(functools.partial(xla_prefill_path, ratio=ratio), args_, PREFILL_ITERS)})
        defaults = (da.PREFILL_BLOCK_HEADS, da.PREFILL_NUM_WARPS, da.NUM_STAGES)
        for block_heads, num_warps, num_stages in itertools.product(heads, warps, stages):
            da.PREFILL_BLOCK_HEADS, da.PREFILL_NUM_WARPS, da.NUM_STAGES = block_heads, num_warps, num_stages
            row = {"ratio": ratio, "tokens": tokens, "path": "kernel", "block_heads": block_heads,
                   "num_warps": num_warps, "num_stages": num_stages}
            try:
                got = np.asarray(jax.jit(functools.partial(kernel_prefill_path, ratio=ratio))(*args_)
                                 .astype(jnp.float32))
                row["max_diff"] = float(np.abs(got - want).max() / np.abs(want).max())
                if not row["max_diff"] < 2e-2:
                    raise RuntimeError(f"differs from XLA's path: {row['max_diff']:.3g} of the largest value")
                row["us"] = _timed(functools.partial(kernel_prefill_path, ratio=ratio), args_, PREFILL_ITERS)
            except Exception as err:       # a schedule Triton cannot compile (registers, shared memory), or wrong
                row["us"] = None
                row["error"] = str(err).splitlines()[0][:200]
            emit(row)
        da.PREFILL_BLOCK_HEADS, da.PREFILL_NUM_WARPS, da.NUM_STAGES = defaults
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", metavar="FILE")
    p.add_argument("--keys", default="32,64", help="keys per step to sweep (comma-separated)")
    p.add_argument("--splits", default="1,4,8,16", help="MAX_SPLITS values to sweep")
    p.add_argument("--warps", default="4,8", help="warps per program to sweep")
    p.add_argument("--stages", default="2", help="Triton pipeline stages to sweep")
    p.add_argument("--prefill", type=int, metavar="TOKENS",
                   help="a prefill chunk of TOKENS tokens instead of a decode token (sweeps --heads, --warps, "
                        "--stages)")
    p.add_argument("--heads", default="16,32,64", help="query heads per program to sweep (--prefill)")
    args = p.parse_args(argv)
    ints = lambda text: [int(v) for v in text.split(",")]   # noqa: E731
    if args.prefill:
        rows = sweep_prefill(args.prefill, ints(args.heads), ints(args.warps), ints(args.stages), args.out)
        print(f"\n{'ratio':>5} {'path':>6} {'heads':>5} {'warps':>5} {'stages':>6} {'ms':>8}")
        for r in rows:
            print(f"{r['ratio']:>5} {r['path']:>6} {r.get('block_heads', ''):>5} {r.get('num_warps', ''):>5} "
                  f"{r.get('num_stages', ''):>6} {'-' if r['us'] is None else format(r['us'] / 1e3, '.3f'):>8}")
        return 0
    import functools

    from dsv4_jax.pallas_kernels import decode_attention as da

    rows = []
    for ratio in (4, 128):
        x = inputs(ratio)
        args_ = (x["q"], x["ring"], x["kv"], x["start"], x["sink"], x["compressed"], x["picks"])
        rows.append({"ratio": ratio, "path": "xla", "us": _timed(functools.partial(xla_path, ratio=ratio), args_)})
        print(rows[-1], flush=True)
        defaults = (da.BLOCK_HEADS, da.BLOCK_KEYS, da.MAX_SPLITS, da.NUM_WARPS, da.NUM_STAGES)
        for heads, keys, splits, warps, stages in itertools.product((16,), ints(args.keys), ints(args.splits),
                                                                    ints(args.warps), ints(args.stages)):
            da.BLOCK_HEADS, da.BLOCK_KEYS, da.MAX_SPLITS, da.NUM_WARPS, da.NUM_STAGES = (heads, keys, splits, warps,
                                                                                      stages)
            try:
                us = _timed(functools.partial(kernel_path, ratio=ratio), args_)
            except Exception as err:       # a schedule Triton cannot compile (registers, shared memory)
                us = None
                print(f"  {heads} {keys} {splits} {warps} {stages}: {str(err).splitlines()[0][:120]}", flush=True)
            rows.append({"ratio": ratio, "path": "kernel", "block_heads": heads, "block_keys": keys,
                         "max_splits": splits, "num_warps": warps, "num_stages": stages, "us": us})
            print(rows[-1], flush=True)
        da.BLOCK_HEADS, da.BLOCK_KEYS, da.MAX_SPLITS, da.NUM_WARPS, da.NUM_STAGES = defaults
        rows.append({"ratio": ratio, "path": "kernel without rope", "max_splits": da.MAX_SPLITS,
                     "us": _timed(functools.partial(kernel_without_rope, ratio=ratio), args_)})
        print(rows[-1], flush=True)
        rows.append({"ratio": ratio, "path": "kernel making the query", "max_splits": da.MAX_SPLITS,
                     "us": _timed(functools.partial(kernel_path, ratio=ratio, ready=False), args_)})
        print(rows[-1], flush=True)
    print(f"\n{'ratio':>5} {'path':>6} {'heads':>5} {'keys':>4} {'splits':>6} {'warps':>5} {'stages':>6} {'us':>8}")
    for r in sorted(rows, key=lambda r: (r["ratio"], r["us"] is None, r["us"] or 0)):
        print(f"{r['ratio']:>5} {r['path']:>6} {r.get('block_heads', ''):>5} {r.get('block_keys', ''):>4} "
              f"{r.get('max_splits', ''):>6} {r.get('num_warps', ''):>5} {r.get('num_stages', ''):>6} "
              f"{'-' if r['us'] is None else format(r['us'], '.1f'):>8}")
    if args.out:
        _save(args.out, ITERS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
