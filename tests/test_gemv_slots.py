"""The ffi/ GEMV in slots of rows (ops/matmul_kernels.py): routed_gemv, the routed rows of a decode or verify step,
one slot per row or grouped by expert into slots of up to 8 rows. Runs on the CPU with a stand-in for
ffi.grouped_gemv that keeps its contract (slot s times expert slot_expert[s]; a slot of expert -1 is skipped, its
rows unwritten: poisoned here), and checks the rows against float64 products and which slots read which expert; on
the GPU (`-m gpu`) the real kernel."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import ffi
from dsv4_jax.numerics.formats import Mxfp4Weight, Nvfp4Weight
from dsv4_jax.ops import matmul_kernels


def _fp4_weight(rng, fmt, shape):
    """Random stored FP4 bytes and scales, drawn by jax.random on the default device from a seed of `rng`: the
    Flash-geometry GPU test's 256 experts are 3 GB of bytes a case, minutes for numpy on the host."""
    *lead, n, k = shape
    k_packed, k_scale, k_global = jax.random.split(jax.random.key(int(rng.integers(2 ** 31))), 3)
    packed = jax.random.bits(k_packed, (*lead, n, k // 2), jnp.uint8)
    if fmt == "mxfp4":
        return Mxfp4Weight(packed, jax.random.randint(k_scale, (*lead, n, k // 32), 112, 132).astype(jnp.uint8))
    scale = jax.random.uniform(k_scale, (*lead, n, k // 16), jnp.float32, 2.0 ** -6, 448).astype(jnp.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, jax.random.uniform(k_global, tuple(lead), jnp.float32, 1e-3, 1e-2))


class _StandIn:
    """ffi.grouped_gemv's contract in jnp, recording the slot experts it was given (run eagerly). The calls must carry
    the routed schedules: one row per slot, the format's routed default; rows grouped into slots,
    ffi.SLOTTED_SCHEDULE."""

    def __init__(self):
        self.slot_experts = []

    def __call__(self, x3, weights, slot_expert, out_dtype, *, schedule):
        assert x3.ndim == 3 and x3.shape[1] <= ffi.max_rows(x3.dtype)
        assert schedule == (ffi.routed_schedule(weights) if x3.shape[1] == 1 else ffi.SLOTTED_SCHEDULE)
        pair = weights if isinstance(weights, tuple) else (weights,)
        w = jnp.concatenate([p.dequantize(jnp.float32) for p in pair], axis=1)          # [E, N', K]
        y = jnp.einsum("smk,snk->smn", x3.astype(jnp.float32), w[jnp.maximum(slot_expert, 0)],
                       precision=jax.lax.Precision.HIGHEST)
        self.slot_experts.append(slot_expert)
        return jnp.where(slot_expert[:, None, None] >= 0, y, jnp.nan).astype(out_dtype)        # unwritten: poison


def _case(rng, rows, n_experts=12, k=256, n=64, fmt="mxfp4", pair=False):
    weights = tuple(_fp4_weight(rng, fmt, (n_experts, n, k)) for _ in range(2 if pair else 1))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    # skewed routing: expert 0 takes about a third of the rows (several slots), a few experts none
    experts = np.where(rng.random(rows) < 0.35, 0, rng.integers(1, n_experts - 3, rows)).astype(np.int32)
    real = rng.random(rows) < 0.8
    experts[~real & (rng.random(rows) < 0.5)] = n_experts - 1         # an expert only rows that are not real chose
    return (weights if pair else weights[0]), x, experts, real


@pytest.mark.parametrize("rows, fmt, pair", [(300, "mxfp4", False), (300, "nvfp4", True), (200, "mxfp4", True),
                                             (96, "mxfp4", False)], ids=["slots", "slots-nvfp4-pair", "slots-pair",
                                                                         "row-slots"])
def test_routed_gemv_rows_and_reads(rows, fmt, pair):
    rng = np.random.default_rng(rows + 7 * pair)
    weights, x, experts, real = _case(rng, rows, fmt=fmt, pair=pair)
    stand_in = _StandIn()
    y = matmul_kernels.routed_gemv(x, weights, jnp.asarray(experts), jnp.asarray(real), grouped_gemv=stand_in)
    y = np.asarray(y, np.float64)
    w64 = np.concatenate([np.asarray(p.dequantize(jnp.float32), np.float64)
                          for p in (weights if pair else (weights,))], axis=1)
    want = np.einsum("rk,rnk->rn", np.asarray(x, np.float64), w64[experts])
    err = np.abs(y[real] - want[real]).max() / np.abs(want[real]).max()
    assert err < 1e-5, f"real rows vs float64: {err:.2e}"
    # reads: each expert the real rows chose, in ceil(its real rows / slot capacity) slots; nothing else
    slot_expert = np.asarray(stand_in.slot_experts[0])
    capacity = 1 if rows <= matmul_kernels.MAX_MOE_ROWS else ffi.max_rows(jnp.bfloat16)
    used, counts = np.unique(slot_expert[slot_expert >= 0], return_counts=True)
    real_ids, real_rows = np.unique(experts[real], return_counts=True)
    assert used.tolist() == real_ids.tolist()
    assert counts.tolist() == [math.ceil(c / capacity) for c in real_rows]
    assert np.all(np.isnan(y[~real])), "rows that are not real must not be computed"


def test_routed_gemv_without_real_computes_every_row():
    rng = np.random.default_rng(5)
    weights, x, experts, _ = _case(rng, 260)
    y = matmul_kernels.routed_gemv(x, weights, jnp.asarray(experts), grouped_gemv=_StandIn())
    want = np.einsum("rk,rnk->rn", np.asarray(x, np.float64),
                     np.asarray(weights.dequantize(jnp.float32), np.float64)[experts])
    assert np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max() < 1e-5


HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def _touched_experts_reference(x, weights, experts, real):
    """float64 rows x[real] times their experts' weights (a tuple: side by side), one expert at a time: at Flash's
    geometry the whole stacked weight in float64 is 34 GB, and indexed by row far more."""
    xr, er = np.asarray(x, np.float64)[real], experts[real]
    want = np.empty((xr.shape[0], sum(w.shape[1] for w in weights)))
    for e in np.unique(er):
        w_e = np.concatenate([np.asarray(jax.tree.map(lambda a: a[e], w).dequantize(jnp.float32), np.float64)
                              for w in weights])
        want[er == e] = xr[er == e] @ w_e.T
    return want


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [32, 256])
def test_routed_gemv_flash_geometry_gpu(fmt, tokens):
    """The real ffi.grouped_gemv at Flash's routed geometry (256 experts, gate + up pair 2 x 2048 x 4096 and down
    4096 x 2048), a decode step's rows (tokens x 6) with a fifth of them not real: against float64, every real row
    of 24 of the touched experts drawn at random (all their slots' rows; the float64 reference of every touched
    expert took over a minute a case). The weights are arguments of the jitted call, not constants closed over:
    3 GB of constants would go into the compiled program."""
    rng = np.random.default_rng(11 * tokens + (fmt == "nvfp4"))
    for n, k, pair in ((2048, 4096, True), (4096, 2048, False)):
        weights, x, experts, real = _case(rng, tokens * 6, n_experts=256, k=k, n=n, fmt=fmt, pair=pair)
        y = jax.jit(matmul_kernels.routed_gemv)(x, weights, jnp.asarray(experts), jnp.asarray(real))
        checked = real & np.isin(experts, rng.choice(np.unique(experts[real]), 24, replace=False))
        y = np.asarray(y, np.float64)[checked]
        want = _touched_experts_reference(x, weights if pair else (weights,), experts, checked)
        assert np.all(np.isfinite(y))
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{fmt} {n}x{k} pair={pair}: {err:.2e}"
