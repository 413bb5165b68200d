"""The ffi/ GEMV in slots of rows (ops/matmul_kernels.py): routed_gemv, the routed rows of a decode or verify step,
one slot per row or grouped by expert into slots of up to 8 rows; dense_slots_gemv, 9-64 rows times one weight in
slots of 8 (opt-in; FP8 on ffi.shared_weight_gemv's slot groups). Runs on the CPU with a stand-in for
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
from dsv4_jax.numerics.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from dsv4_jax.ops import matmul_kernels


def _fp4_weight(rng, fmt, shape):
    *lead, n, k = shape
    packed = jnp.asarray(rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8))   # not int64: 8 GB at Flash
    if fmt == "mxfp4":
        return Mxfp4Weight(packed, jnp.asarray(rng.integers(112, 132, (*lead, n, k // 32), dtype=np.uint8)))
    scale = jnp.asarray(rng.uniform(2.0 ** -6, 448, (*lead, n, k // 16)), jnp.float32).astype(jnp.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, jnp.asarray(rng.uniform(1e-3, 1e-2, tuple(lead)), jnp.float32))


class _StandIn:
    """ffi.grouped_gemv's contract in jnp, recording the slot experts it was given (run eagerly). `routed`: the calls
    must carry the routed schedules (one row per slot: the format's routed default; rows grouped into slots:
    ffi.SLOTTED_SCHEDULE) slot by slot, else the shape's default (0) tile by tile (one weight for every slot)."""

    def __init__(self, routed=False):
        self.slot_experts = []
        self.routed = routed
        self.shared_calls = 0                               # calls of `shared` (ffi.shared_weight_gemv's stand-in)

    def __call__(self, x3, weights, slot_expert, out_dtype, *, schedule, slots_inner=False):
        self.rows_per_slot = x3.shape[1]
        assert x3.ndim == 3 and x3.shape[1] <= ffi.max_rows(x3.dtype)
        pair = weights if isinstance(weights, tuple) else (weights,)
        w = jnp.concatenate([p.dequantize(jnp.float32) for p in pair], axis=1)          # [E, N', K]
        if self.routed:
            assert schedule == (ffi.routed_schedule(weights) if x3.shape[1] == 1 else ffi.SLOTTED_SCHEDULE)
            assert not slots_inner                          # every slot has its own expert
        else:
            assert schedule == 0 and slots_inner            # every slot reads the one weight: tile by tile
        y = jnp.einsum("smk,snk->smn", x3.astype(jnp.float32), w[jnp.maximum(slot_expert, 0)],
                       precision=jax.lax.Precision.HIGHEST)
        self.slot_experts.append(slot_expert)
        return jnp.where(slot_expert[:, None, None] >= 0, y, jnp.nan).astype(out_dtype)        # unwritten: poison

    def shared(self, x3, w, out_dtype=None, *, schedule=0):
        """ffi.shared_weight_gemv's contract: every slot times the one (FP8) weight; recorded as slots of expert 0."""
        assert isinstance(w, Fp8BlockWeight) and schedule in (0, *ffi.SLOT_GROUP_SCHEDULES)
        self.shared_calls += 1
        return self(x3, jax.tree.map(lambda a: a[None], w), jnp.zeros((x3.shape[0],), jnp.int32),
                    out_dtype or x3.dtype, schedule=0, slots_inner=True)


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
    stand_in = _StandIn(routed=True)
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
    y = matmul_kernels.routed_gemv(x, weights, jnp.asarray(experts), grouped_gemv=_StandIn(routed=True))
    want = np.einsum("rk,rnk->rn", np.asarray(x, np.float64),
                     np.asarray(weights.dequantize(jnp.float32), np.float64)[experts])
    assert np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max() < 1e-5


def _fp8_weight(rng, shape):
    w = np.clip(rng.standard_normal(shape) * 64, -448, 448)
    scale = rng.integers(108, 124, (-(-shape[0] // 128), shape[1] // 128))
    return Fp8BlockWeight(jnp.asarray(w, jnp.float32).astype(jnp.float8_e4m3fn), jnp.asarray(scale, jnp.uint8))


@pytest.mark.parametrize("rows, dtype, fmt, n", [(9, jnp.bfloat16, "fp8", 2064), (32, jnp.bfloat16, "mxfp4", 192),
                                                 (61, jnp.float32, "fp8", 2064), (64, jnp.bfloat16, "nvfp4", 192),
                                                 (40, jnp.bfloat16, "fp8", 192)])
def test_dense_slots_gemv(rows, dtype, fmt, n):
    """Every row against float64, the slots of ffi.max_rows rows (4 float32), one weight for all: FP8 with more
    tiles x slot groups than ffi.FEW_TILES (2064 rows: 129 tiles) on the slot-group kernel, else tile by tile."""
    rng = np.random.default_rng(rows)
    w = _fp8_weight(rng, (n, 256)) if fmt == "fp8" else _fp4_weight(rng, fmt, (n, 256))
    x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
    stand_in = _StandIn()
    y = np.asarray(matmul_kernels.dense_slots_gemv(x, w, grouped_gemv=stand_in, shared_weight_gemv=stand_in.shared),
                   np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(jnp.float32), np.float64).T
    assert y.shape == want.shape
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-5
    slot_expert = np.asarray(stand_in.slot_experts[0])
    capacity = ffi.max_rows(dtype)
    assert stand_in.rows_per_slot == capacity and slot_expert.tolist() == [0] * -(-rows // capacity)
    assert stand_in.shared_calls == (fmt == "fp8" and n // 16 > ffi.FEW_TILES)   # slot groups


def test_dense_slots_are_opt_in_on_cuda_plans(monkeypatch):
    """A batch-32 decode step traced for an H200 takes dense_slots_gemv for its dense FP8 weights only with the
    override matmul=kernel."""
    from dsv4_jax import presets
    from dsv4_jax.dispatch_census import step_dispatch
    from dsv4_jax.ops.plan import KernelPlan
    from dsv4_jax.run_context import RunContext
    monkeypatch.setattr(ffi, "register", lambda *args: None)               # tracing needs no library
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    cfg = presets.named("flash", 1)
    tables = {}
    for overrides in ((), ("matmul=kernel",)):
        plan = KernelPlan("auto", "cuda", ffi=True, target="NVIDIA H200").with_overrides(overrides)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h200)):
            tables[overrides] = step_dispatch(cfg, RunContext.create(kernels=plan), 32, 1, max_seq_len=4096)
    assert "cuda:ffi_gemv_slots" not in tables[()] and tables[()]["cuda:gemv"] >= 7
    assert tables[("matmul=kernel",)]["cuda:ffi_gemv_slots"] == tables[()]["cuda:gemv"] - 1, tables   # all but wo_a


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
    expert took over a minute a case)."""
    rng = np.random.default_rng()
    for n, k, pair in ((2048, 4096, True), (4096, 2048, False)):
        weights, x, experts, real = _case(rng, tokens * 6, n_experts=256, k=k, n=n, fmt=fmt, pair=pair)
        y = jax.jit(lambda x, e, r: matmul_kernels.routed_gemv(x, weights, e, r))(
            x, jnp.asarray(experts), jnp.asarray(real))
        checked = real & np.isin(experts, rng.choice(np.unique(experts[real]), 24, replace=False))
        y = np.asarray(y, np.float64)[checked]
        want = _touched_experts_reference(x, weights if pair else (weights,), experts, checked)
        assert np.all(np.isfinite(y))
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{fmt} {n}x{k} pair={pair}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows", [9, 32, 64])
def test_dense_slots_gemv_gpu(fmt, rows):
    """The real ffi.grouped_gemv in slots of 8 rows at a Flash projection's shape (4096 x 4096) against float64."""
    rng = np.random.default_rng()
    w = _fp8_weight(rng, (4096, 4096)) if fmt == "fp8" else _fp4_weight(rng, fmt, (4096, 4096))
    x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
    y = np.asarray(jax.jit(matmul_kernels.dense_slots_gemv)(x, w), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(jnp.float32), np.float64).T
    assert np.all(np.isfinite(y)) and np.abs(y - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", [811, 411])
def test_slots_inner_order_gpu(schedule):
    """The real ffi.grouped_gemv with its work items tile by tile (slots_inner) against slot by slot: 37 slots of
    their own experts (some unused, -1): each output element of a used slot must be the same bits whichever order
    ran it, and match float64 (an unused slot's rows are never written, so they are not compared)."""
    rng = np.random.default_rng()
    w = _fp4_weight(rng, "mxfp4", (12, 256, 512))
    x3 = jnp.asarray(rng.standard_normal((37, 8, 512)), jnp.bfloat16)
    experts = rng.integers(-1, 12, 37).astype(np.int32)
    run = jax.jit(lambda x3, e, inner: ffi.grouped_gemv(x3, w, e, jnp.float32, schedule=schedule, slots_inner=inner),
                  static_argnums=2)
    by_tile = np.asarray(run(x3, jnp.asarray(experts), True))
    by_slot = np.asarray(run(x3, jnp.asarray(experts), False))
    used = experts >= 0
    np.testing.assert_array_equal(by_tile[used], by_slot[used])
    w64 = np.asarray(w.dequantize(jnp.float32), np.float64)
    want = np.einsum("smk,snk->smn", np.asarray(x3, np.float64)[used], w64[experts[used]])
    assert np.abs(by_tile[used] - want).max() / np.abs(want).max() < 1e-5


def test_slots_inner_refuses_the_staged_schedules():
    """The staged kernel walks its items slot by slot only: asking it for tile by tile is a clear error, before
    any build or launch (so on any machine)."""
    rng = np.random.default_rng(3)
    w = _fp4_weight(rng, "mxfp4", (4, 64, 256))
    x3 = jnp.asarray(rng.standard_normal((3, 8, 256)), jnp.bfloat16)
    with pytest.raises(ValueError, match="staged schedules"):
        ffi.grouped_gemv(x3, w, jnp.zeros((3,), jnp.int32), schedule=4811, slots_inner=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("slots, m, dtype, schedule", [(11, 8, jnp.bfloat16, 411), (3, 5, jnp.bfloat16, 811),
                                                       (8, 8, jnp.bfloat16, 0), (5, 4, jnp.float32, 411)])
def test_shared_weight_gemv_gpu(slots, m, dtype, schedule):
    """The slot-group kernel (each weight tile decoded once for up to 8 slots; 11 slots: a group of 8 and one of 3)
    against float64, and against grouped_gemv slot by slot at the same warps: the same MMAs in the same order per
    slot, so the same bits."""
    rng = np.random.default_rng()
    w = _fp8_weight(rng, (384, 1024))
    x3 = jnp.asarray(rng.standard_normal((slots, m, 1024)), dtype)
    y = np.asarray(jax.jit(lambda x3: ffi.shared_weight_gemv(x3, w, jnp.float32, schedule=schedule))(x3))
    stacked = jax.tree.map(lambda a: a[None], w)
    by_slot = np.asarray(jax.jit(lambda x3: ffi.grouped_gemv(x3, stacked, jnp.zeros((slots,), jnp.int32), jnp.float32,
                                                             schedule=schedule or ffi.SLOT_GROUP_SCHEDULE))(x3))
    np.testing.assert_array_equal(y, by_slot)
    want = np.einsum("smk,nk->smn", np.asarray(x3, np.float64), np.asarray(w.dequantize(jnp.float32), np.float64))
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-5


def test_shared_weight_gemv_refuses_what_it_cannot_run():
    """FP4 weights, other schedules and too many rows per slot: one-line errors before any build or launch."""
    rng = np.random.default_rng(5)
    x3 = jnp.asarray(rng.standard_normal((3, 8, 256)), jnp.bfloat16)
    with pytest.raises(TypeError, match="FP8-block"):
        ffi.shared_weight_gemv(x3, _fp4_weight(rng, "mxfp4", (64, 256)))
    with pytest.raises(ValueError, match="slot groups run schedules"):
        ffi.shared_weight_gemv(x3, _fp8_weight(rng, (64, 256)), schedule=11)
    with pytest.raises(ValueError, match="rows per slot"):
        ffi.shared_weight_gemv(jnp.zeros((3, 9, 256), jnp.bfloat16), _fp8_weight(rng, (64, 256)))
