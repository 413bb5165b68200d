"""The mHC Sinkhorn kernel (dsv4_jax/pallas_kernels/sinkhorn.py) in Pallas interpret mode against the float64
reference (tests/reference_np.py), and its place in the mhc_site op (ops/mhc_site.py SINKHORN_KERNEL)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import presets
from dsv4_jax.ops import choice, mhc_site
from dsv4_jax.ops.plan import KernelPlan
from dsv4_jax.pallas_kernels.sinkhorn import sinkhorn_rows
from dsv4_jax.run_context import RunContext

import reference_np as R

ATOL, RTOL = 2e-6, 1e-4          # test_layers.py's tolerance for the jnp Sinkhorn against float64


def _close(got, want) -> bool:
    return bool(np.all(np.abs(np.asarray(got, np.float64) - want) <= ATOL + RTOL * np.abs(want)))


@pytest.mark.parametrize("lead", [(96,), (2, 1024)])
def test_sinkhorn_rows_matches_float64(lead):
    """Sharp logits (|logit| ~ 10), so that the result depends on running exactly 20 iterations; 96 rows are 3
    programs of 32, 2,048 rows 4 of 512. Interpret mode fills unwritten outputs with NaN: every entry must be
    finite and within tolerance; 19 or 21 iterations, or the matrices transposed, must not be."""
    rng = np.random.default_rng(5)
    logits = (10 * rng.standard_normal((*lead, 4, 4))).astype(np.float32)
    got = np.asarray(sinkhorn_rows(jnp.asarray(logits), iters=20, eps=1e-6, interpret=True))
    want = R.sinkhorn(logits.astype(np.float64), 20, 1e-6)
    assert got.shape == logits.shape and got.dtype == np.float32 and np.isfinite(got).all()
    assert _close(got, want), np.abs(got - want).max()
    for iters in (19, 21):
        assert not _close(R.sinkhorn(logits.astype(np.float64), iters, 1e-6), want)
    assert not _close(np.swapaxes(got, -1, -2), want)


def test_sinkhorn_rows_equals_the_jnp_path_to_rounding():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(3 * rng.standard_normal((1, 64, 4, 4)), jnp.float32)
    got = sinkhorn_rows(logits, iters=20, eps=1e-6, interpret=True)
    want = mhc_site.sinkhorn(logits, 20, 1e-6, unroll=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_sinkhorn_rows_refuses_what_it_does_not_tile():
    with pytest.raises(ValueError, match="multiple of 16 rows; got 24 rows"):
        sinkhorn_rows(jnp.zeros((24, 4, 4)), iters=20, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="square matrices"):
        sinkhorn_rows(jnp.zeros((32, 3, 3)), iters=20, eps=1e-6, interpret=True)


def test_a_gpu_plan_runs_the_sinkhorn_of_a_jnp_site_on_the_kernel():
    """On a GPU plan a prefill chunk's site stays on the jnp path (the site kernels are opt-in there) and its
    Sinkhorn takes the kernel; mhc_site=reference turns both off; rows that are not a multiple of 16 keep the jnp
    Sinkhorn. Traced only."""
    cfg = presets.tiny()
    gpu = KernelPlan("pallas", "pallas", target="NVIDIA H200")

    def kernels(overrides, rows):
        ctx = RunContext.create(dtype="bfloat16", kernels=gpu, kernel_overrides=overrides).in_phase("prefill")
        X = jax.ShapeDtypeStruct((1, rows, cfg.hc_mult, cfg.dim), jnp.bfloat16)
        fn = jax.ShapeDtypeStruct((cfg.hc_mult * (cfg.hc_mult + 2), cfg.hc_mult * cfg.dim), jnp.float32)
        vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)  # noqa: E731
        with choice.record_dispatch("mhc_site") as rec:
            jax.eval_shape(lambda *a: mhc_site.pre_norm(*a, cfg=cfg, ctx=ctx), X, fn,
                           vec(cfg.hc_mult * (cfg.hc_mult + 2)), vec(3), jax.ShapeDtypeStruct((cfg.dim,), jnp.bfloat16))
        return [(c.path, c.kernel) for c in rec]

    assert kernels({}, 32) == [("reference", None), ("pallas", "mhc_sinkhorn")]
    assert kernels({"mhc_site": "reference"}, 32) == [("reference", None), ("reference", None)]
    assert kernels({}, 24) == [("reference", None), ("reference", None)]


def test_a_site_on_the_sinkhorn_kernel_equals_the_reference_plan():
    """mhc_site.pre_norm of a 32-row prefill chunk at D = 96 (a width the site kernels do not take, so the site runs
    its jnp path), float32: on the interpret plan its Sinkhorn takes the kernel, and every output equals the
    reference plan's to float32 rounding."""
    cfg = dataclasses.replace(presets.tiny(), dim=96)
    rng = np.random.default_rng(8)
    n = cfg.hc_mult
    X = jnp.asarray(rng.standard_normal((1, 32, n, cfg.dim)), jnp.float32)
    fn = jnp.asarray(rng.standard_normal((n * (n + 2), n * cfg.dim)) / 8, jnp.float32)
    base = jnp.asarray(rng.standard_normal(n * (n + 2)), jnp.float32)
    scale = jnp.asarray([1.0, 1.0, 4.0], jnp.float32)
    weight = jnp.asarray(1 + rng.standard_normal(cfg.dim) / 4, jnp.float32)
    outs = {}
    for plan in ("interpret", "reference"):
        ctx = RunContext.create(dtype="float32", kernels=plan).in_phase("prefill")
        with choice.record_dispatch("mhc_site") as rec:
            outs[plan] = jax.jit(lambda *a: mhc_site.pre_norm(*a, cfg=cfg, ctx=ctx))(X, fn, base, scale, weight)
        outs[plan + " kernels"] = {c.kernel for c in rec if c.path != "reference"}
    assert outs["interpret kernels"] == {"mhc_sinkhorn"} and outs["reference kernels"] == set()
    for got, want in zip(outs["interpret"], outs["reference"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow                                        # two tiny models compiled, one with 10 interpret kernels
def test_model_prefill_with_the_sinkhorn_kernel_equals_the_reference():
    """The tiny preset at D = 96 (a width the site kernels do not take, so the site runs its jnp path), float32: a
    32-token prompt prefilled on the interpret plan, every other op on the reference, takes the Sinkhorn kernel at
    every site and gives the reference plan's logits."""
    from one_op_prefill import one_op_prefill

    cfg = dataclasses.replace(presets.tiny(), dim=96)
    prefill = one_op_prefill(cfg, "mhc_site", seed=4, max_seq_len=256)
    err, choices = prefill(np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 32)).astype(np.int32))
    assert {c.kernel for c in choices if c.phase == "prefill" and c.path != "reference"} == {"mhc_sinkhorn"}
    assert err < 1e-5, err


HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [16, 2048, 8192 + 64])
def test_gpu_sinkhorn_rows_matches_float64(rows):
    """The compiled Triton kernel (blocks of 16, 512 and 64 rows) against float64, with sharp logits."""
    rng = np.random.default_rng(126)
    logits = (10 * rng.standard_normal((rows, 4, 4))).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: sinkhorn_rows(x, iters=20, eps=1e-6))(jnp.asarray(logits)))
    want = R.sinkhorn(logits.astype(np.float64), 20, 1e-6)
    assert np.isfinite(got).all() and _close(got, want), np.abs(got - want).max()
