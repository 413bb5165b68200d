"""Which MoE-kernel tilings give finite, correct results on the GPU (found by `bench_kernels.py --sweep`: one
tiling's rel. error was inf). For a few routed-prefill shapes, each tiling's output vs the default tiling's:
count of non-finite outputs, the rows / columns they fall in, and the relative difference of the finite ones.

    PYTHONPATH=. python3 benchmarks/probe_moe_tilings.py        # on the GPU; result: docs/bench/*moe_tiling_probe.txt

The tiling found faulty (8 warps, pipelined, 32 packed bytes per row per K step) is now refused by
dsv4_jax/pallas_kernels/gemv.py's _fp4_config; the check is skipped here so it can be probed again under a new Triton.
"""

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_jax.pallas_kernels import gemv, moe  # noqa: E402
from benchmarks.bench_kernels import make_weight, routed_expert_ids  # noqa: E402

SHAPES = ((256, 2048, 4096, 24576), (256, 2048, 1024, 24576), (256, 2048, 4096, 3072), (16, 2048, 4096, 6144),
          (256, 512, 4096, 24576))                   # experts, N, K, routed rows
# block_n, unroll (MXFP4 scale blocks of 16 packed bytes per K step), warps, stages
TILINGS = ((128, 2, 8, 3), (128, 2, 4, 3), (64, 2, 4, 3), (128, 1, 8, 3), (128, 2, 8, 1))


def unchecked_config(n, k, block, block_n, unroll, split_k, num_warps, num_stages):
    return original_config(n, k, block, block_n, unroll, split_k, 4, num_stages)


original_config = gemv._fp4_config


def main():
    key = jax.random.key(0)
    for n_exp, n, k, rows in SHAPES:
        w = make_weight(jax.random.fold_in(key, 41), "mxfp4", (n_exp, n, k))
        ids = jnp.asarray(np.sort(routed_expert_ids(rows, rows // 6, n_exp, 6)), jnp.int32)
        x = jax.random.normal(jax.random.fold_in(key, 7), (ids.shape[0], k), jnp.float32).astype(jnp.bfloat16)
        base = jax.jit(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32, block_n=64, unroll=8, slot_cols=128,
                                                      split_k=1))(x, w, ids)
        for bn, u, nw, ns in TILINGS:
            def run(x, w, i, bn=bn, u=u, nw=nw, ns=ns):
                return moe.moe_matmul(x, w, i, jnp.float32, block_n=bn, unroll=u, num_warps=nw, num_stages=ns,
                                      slot_cols=128, split_k=1)
            with mock.patch("dsv4_jax.pallas_kernels.moe._fp4_config", unchecked_config):
                y = jax.jit(run)(x, w, ids)
            bad = np.asarray(~jnp.isfinite(y))
            bad_rows, bad_cols = np.unique(np.nonzero(bad)[0]), np.unique(np.nonzero(bad)[1])
            err = float(jnp.linalg.norm(jnp.where(bad, 0, y - base)) / jnp.linalg.norm(base))
            print(f"E={n_exp} N={n} K={k} R={rows} cfg={bn},{u},{nw},{ns}: nonfinite={int(bad.sum())} "
                  f"rows {bad_rows[:5]}..{len(bad_rows)} cols {bad_cols[:5]}..{len(bad_cols)} err(finite)={err:.3g}",
                  flush=True)
        del w


if __name__ == "__main__":
    main()
