"""Time the decode rows' norm kernel (pallas_kernels/norm_rope.rms_norm_rows) at serving batches, by rows per
program, beside XLA's path for the same rows, at Flash geometry:

    python benchmarks/bench_norm_rows.py --batches 1,64,128,256 --per 1,2,4,8,16 --out norm_rows.json

Cases: the per-head queries (batch x 64 heads rows of 512 from wq_b's float32 output, a token's heads at its
position: the norm and RoPE), the keys (batch rows of 512: norm with weight, RoPE, the FP8 rounding of the nope
dims) and the query latent (batch rows of 1,024: norm with weight). Each case runs ITERS times chained in one
jitted program (each call's input depends on the previous output), best of three runs; the table gives
microseconds per call and the bytes read and written per second (float32 in, bf16 out). Each kernel row's output
is compared with the one-row-a-program kernel's ("equal": bit for bit; XLA's path: the share of elements that
differ, by a last-bit difference of the norm's sum moving a rounding) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_decode_attention import ITERS, _timed  # noqa: E402  (chained calls in one program, best of three)


def cases(batch: int, interpret: bool):
    """(name, input, kernel(rows_per_program), XLA's path, rows, the rows sharing a position) at this batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4_jax import presets
    from dsv4_jax.numerics.fake_quant import fp8_fake_quant
    from dsv4_jax.ops.norm_rope import apply_rope, rms_norm, rope_inv_freq
    from dsv4_jax.pallas_kernels.norm_rope import rms_norm_rows

    rng = np.random.default_rng(batch)
    inv_freq = rope_inv_freq(presets.named("flash"), 4)
    positions = jnp.asarray(rng.integers(0, 1 << 16, (batch, 1)), jnp.int32)
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(1024), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((batch, 1, 64, 512)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((batch, 1, 512)), jnp.float32)
    latent = jnp.asarray(rng.standard_normal((batch, 1, 1024)), jnp.float32)
    bf16 = jnp.bfloat16

    def xla_queries(x):
        x32 = x.astype(bf16).astype(jnp.float32)
        factor = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return apply_rope((x32 * factor).astype(bf16), positions[:, :, None], inv_freq)

    def xla_keys(x):
        k = apply_rope(rms_norm(x.astype(bf16), weight[:512], 1e-6), positions, inv_freq)
        return jnp.concatenate([fp8_fake_quant(k[..., :448]), k[..., 448:]], axis=-1)

    return [
        ("queries", q, lambda per: lambda x: rms_norm_rows(x, None, eps=1e-6, in_dtype=bf16, rope=(positions, inv_freq),
                                                           rows_per_program=per, interpret=interpret),
         xla_queries, batch * 64, 64),
        ("keys", kv, lambda per: lambda x: rms_norm_rows(x, weight[:512], eps=1e-6, in_dtype=bf16,
                                                         rope=(positions, inv_freq), fp8_nope=True,
                                                         rows_per_program=per, interpret=interpret),
         xla_keys, batch, 1),
        ("latent", latent, lambda per: lambda x: rms_norm_rows(x, weight, eps=1e-6, in_dtype=bf16,
                                                               rows_per_program=per, interpret=interpret),
         lambda x: rms_norm(x.astype(bf16), weight, 1e-6), batch, 1),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--per", default="1,2,4,8,16", help="rows per program to time (those that divide the case's rows "
                                                        "and its rows sharing a position)")
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "norm_rows.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, one batch, 2 iters")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4_jax.pallas_kernels.norm_rope import default_rows_per_program

    batches = [int(b) for b in args.batches.split(",")]
    pers = [int(p) for p in args.per.split(",")]
    iters = 2 if args.smoke else args.iters
    rows_out = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(f"{'case':8} {'batch':>5} {'path':>10} {'us':>9} {'GB/s':>7}  check")
    for batch in batches:
        for name, x, kernel, xla, rows, group in cases(batch, args.smoke):
            moved = x.size * 4 + x.size * 2                 # float32 in, bf16 out
            base = np.asarray(jax.jit(kernel(1))(x).astype(jnp.float32))
            default = default_rows_per_program(rows, group, x.shape[-1])
            variants = [("xla", xla, None)] + [
                (f"kernel/{p}" + ("*" if p == default else ""), kernel(p), None)
                for p in pers if rows % p == 0 and (group == 1 or group % p == 0)]
            for path, fn, check in variants:
                if check is None:
                    got = np.asarray(jax.jit(fn)(x).astype(jnp.float32))
                    check = "equal" if np.array_equal(got, base) else f"{np.mean(got != base):.2%} differ"
                us = _timed(fn, (x,), iters)
                row = {"case": name, "batch": batch, "rows": rows, "path": path, "us": us,
                       "gb_per_s": moved / us / 1e3, "check": check}
                rows_out.append(row)
                print(f"{name:8} {batch:5d} {path:>10} {us:9.2f} {row['gb_per_s']:7.0f}  {check}", flush=True)
                with open(args.out, "w") as f:
                    json.dump({"device": jax.devices()[0].device_kind, "argv": sys.argv[1:], "iters": iters,
                               "default": "* marks default_rows_per_program's choice", "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
