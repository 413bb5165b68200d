"""The decode step's kernel launches, compiled for a compile-only H200 on this CPU machine (benchmarks/count_kernels.py,
dsv4_jax/hlo_census.py): the counts are deterministic, so they are held to limits -- the launches per layer kind
of a 4-layer Flash-geometry step at batch 1 as last counted (docs/performance.md), so that a change that adds
launches has to say so. Needs jax's CUDA build in the environment (`pip install "jax[cuda13]==0.11.2"`, no GPU;
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1); skipped where it is missing, as in the CPU-only CI."""

from __future__ import annotations

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

# launches per layer of each kind (window: layers 0-1, CSA: 2, HCA: 3, whose count includes the final hc_post);
# counted 2026-12-05 (after the decode attention's one softmax): window 25, CSA 35, HCA 28 (121 for the step)
LIMITS_PER_LAYER = {"window": 25, "csa": 35, "hca": 28}
LIMIT_STEP = 121


def _h200():
    import count_kernels
    try:
        return count_kernels, count_kernels.h200_device()
    except SystemExit as err:                 # no CUDA plugin here: count_kernels says what is missing
        pytest.skip(str(err))


def test_decode_step_launches_stay_within_limits():
    count_kernels, device = _h200()
    from dsv4_jax import presets
    from dsv4_jax.run_context import RunContext

    cfg = presets.named("flash", 4)
    ctx = RunContext.create(kernels="auto", device=device)
    with jax.default_matmul_precision("default"):          # as the model runs (conftest.py asks for "highest")
        counts = count_kernels.count_programs(cfg, ctx, 1, 4096, 512, 16, device,
                                              names=("decode_step",))["decode_step"]
    assert counts["while_loops"] == 0 and counts["unknown_trip_counts"] == 0
    layers = {"window": 2, "csa": 1, "hca": 1}
    per_layer = {kind: counts["by_layer_kind"].get(kind, 0) / n for kind, n in layers.items()}
    assert all(per_layer[kind] <= LIMITS_PER_LAYER[kind] for kind in layers), per_layer
    assert counts["launches_per_call"] <= LIMIT_STEP, counts


def test_hc_post_is_one_pass_over_the_streams():
    """mHC's hc_post for a 2,048-token prefill chunk at Flash width, compiled for an H200: its kernels read the
    streams and y and write the mixed streams once, in the streams' dtype (as an einsum, XLA wrote the float32 mix
    out and read it back: about three times these bytes)."""
    count_kernels, device = _h200()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv4_jax import hlo_census, presets
    from dsv4_jax.ops.mhc_site import hc_post

    cfg = presets.flash()
    rows, n, dim = 2048, cfg.hc_mult, cfg.dim
    mesh = jax.sharding.Mesh([device], ("x",))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    args = (spec((1, rows, dim), jnp.float32), spec((1, rows, n, dim), jnp.bfloat16), spec((1, rows, n), jnp.float32),
            spec((1, rows, n, n), jnp.float32))
    with jax.default_matmul_precision("default"):
        text = jax.jit(hc_post).trace(*args).lower().compile().as_text()
    one_pass = 2 * rows * n * dim * 2 + rows * dim * 4          # the streams read and written, y read
    assert hlo_census.kernel_bytes(text)["total"] < 1.2 * one_pass


def test_a_prefill_mhc_site_runs_its_sinkhorn_in_one_kernel():
    """One mHC site (mhc_site.pre_norm with the previous sub-layer's hc_post) of a 2,048-token prefill chunk at
    Flash width on the GPU plan, compiled for an H200: the site's jnp path with its Sinkhorn on
    pallas_kernels/sinkhorn.py was 9 launches when counted (2026-12-07); with mhc_site=reference (XLA's own unrolled
    Sinkhorn, which from ~2,048 rows XLA splits into about three kernels per iteration) 43."""
    count_kernels, device = _h200()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv4_jax import hlo_census, presets
    from dsv4_jax.ops import mhc_site
    from dsv4_jax.run_context import RunContext

    cfg = presets.flash()
    rows, n, dim = 2048, cfg.hc_mult, cfg.dim
    mesh = jax.sharding.Mesh([device], ("x",))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    args = (spec((1, rows, n, dim), jnp.bfloat16), spec((n * (n + 2), n * dim), jnp.float32),
            spec((n * (n + 2),), jnp.float32), spec((3,), jnp.float32), spec((dim,), jnp.bfloat16),
            spec((1, rows, dim), jnp.bfloat16), spec((1, rows, n), jnp.float32), spec((1, rows, n, n), jnp.float32))
    counts = {}
    for overrides in ({}, {"mhc_site": "reference"}):
        ctx = RunContext.create(kernels="auto", device=device, kernel_overrides=overrides).in_phase("prefill")

        def site(X, fn, base, scale, weight, y, post, comb):
            return mhc_site.pre_norm(X, fn, base, scale, weight, cfg, ctx, post_mix=(y, post, comb))

        with count_kernels._pallas_target(device), jax.default_matmul_precision("default"):
            text = jax.jit(site).trace(*args).lower().compile().as_text()
        counts[bool(overrides)] = hlo_census.census(text).launches_per_call
    assert counts[False] <= 10 and counts[True] > 30, counts
