"""The XLA FFI CUDA kernels of ffi/: the build (CPU, where nvcc exists: the sources compile for sm_90a, the cache
is keyed by content), argument checks, and on the GPU (`-m gpu`) every format, dense and routed, against float64
math on fresh random inputs."""

import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import ffi
from dsv4_jax.ffi import build
from dsv4_jax.numerics import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile only)")
@pytest.mark.parametrize("source", ["fp4_gemv.cu", "fp8_gemv.cu"])
def test_sources_compile_for_hopper_and_are_cached(source):
    """Built into the per-user build cache (keyed by source, headers, arch and nvcc), so a machine compiles each
    version of the sources once (~40 s for fp4_gemv.cu), as the model's own first use does."""
    cache = os.environ.get("DSV4_JAX_FFI_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsv4_jax", "ffi"))
    path = build.build_library(source, arch="sm_90a", cache_dir=cache)
    assert os.path.getsize(path) > 0 and path.startswith(cache) and "sm_90a" in os.path.basename(path)
    stamp = os.path.getmtime(path)
    assert build.build_library(source, arch="sm_90a", cache_dir=cache) == path
    assert os.path.getmtime(path) == stamp                                # not rebuilt


def _weight(rng, fmt, n, k, experts=None):
    lead = () if experts is None else (experts,)
    if fmt == "fp8":
        w = np.clip(rng.standard_normal((*lead, n, k)) * 64, -448, 448)
        return Fp8BlockWeight(jnp.asarray(w, jnp.float8_e4m3fn),
                              jnp.asarray(rng.integers(100, 135, (*lead, -(-n // 128), k // 128)), jnp.uint8))
    packed = jnp.asarray(rng.integers(0, 256, (*lead, n, k // 2)), jnp.uint8)
    if fmt == "mxfp4":
        return Mxfp4Weight(packed, jnp.asarray(rng.integers(100, 140, (*lead, n, k // 32)), jnp.uint8))
    # e4m3 block scales over their whole range, subnormals included (the kernel reads them exactly)
    scale = np.exp2(rng.uniform(-9, 8.8, (*lead, n, k // 16))) * rng.choice([-1, 1], (*lead, n, k // 16))
    return Nvfp4Weight(packed, jnp.asarray(scale, jnp.float8_e4m3fn),
                       jnp.asarray(rng.uniform(1e-4, 1e-2, lead), jnp.float32))


def test_bad_arguments_are_rejected_before_any_build():
    rng = np.random.default_rng(50)
    w = _weight(rng, "mxfp4", 64, 256)
    with pytest.raises(ValueError, match="1..8"):
        ffi.gemv(jnp.ones((9, 256), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="1..4"):
        ffi.gemv(jnp.ones((5, 256), jnp.float32), w)
    with pytest.raises(ValueError, match="K % 128"):
        ffi.gemv(jnp.ones((2, 192), jnp.bfloat16), _weight(rng, "mxfp4", 64, 192))
    with pytest.raises(TypeError, match="unsupported weight"):
        ffi.gemv(jnp.ones((2, 256), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        ffi.moe_gemv(jnp.ones((2, 256), jnp.bfloat16), w, jnp.zeros(2, jnp.int32))


def test_default_schedule_by_shape(monkeypatch):
    """schedule 0 runs 16 warps per tile (FEW_TILES_SCHEDULE) for one wave of tiles at K >= 4096 (where it was
    measured faster), else 811; the choice is an attribute of the lowered call."""
    assert ffi.default_schedule(1, 512, 4096) == ffi.default_schedule(1, 2048, 7168) == ffi.FEW_TILES_SCHEDULE
    assert ffi.default_schedule(1, 2064, 4096) == 811                     # 129 tiles: more than one wave
    assert ffi.default_schedule(8, 1024, 4096) == 811                     # 8 slots x 64 tiles
    assert ffi.default_schedule(1, 1024, 2048) == 811                     # K not measured
    monkeypatch.setattr(ffi, "register", lambda *args: None)               # lowering needs no library
    rng = np.random.default_rng(72)
    for n, expected in ((1024, ffi.FEW_TILES_SCHEDULE), (4096, 811)):
        w = _weight(rng, "fp8", n, 4096)
        x = jnp.ones((2, 4096), jnp.bfloat16)
        text = jax.jit(lambda x, w: ffi.gemv(x, w)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert f"schedule = {expected} : i32" in text


def test_gemv_concat_checks_and_lowering(monkeypatch):
    """gemv_concat: FP8 weights of one K only, its schedules only; lowered for CUDA it is one call of the concat
    handler with the default schedule of N + N2 rows."""
    rng = np.random.default_rng(83)
    x = jnp.ones((2, 4096), jnp.bfloat16)
    q, kv = _weight(rng, "fp8", 1024, 4096), _weight(rng, "fp8", 512, 4096)
    with pytest.raises(TypeError, match="FP8-block weights only"):
        ffi.gemv_concat(x, (q, _weight(rng, "mxfp4", 512, 4096)))
    with pytest.raises(ValueError, match="equal K"):
        ffi.gemv_concat(x, (q, _weight(rng, "fp8", 512, 2048)))
    with pytest.raises(ValueError, match="a pair"):
        ffi.gemv_concat(x, q)
    with pytest.raises(ValueError, match="schedules"):
        ffi.gemv_concat(x, (q, kv), schedule=411)
    monkeypatch.setattr(ffi, "register", lambda *args: None)               # lowering needs no library
    text = jax.jit(lambda x, a, b: ffi.gemv_concat(x, (a, b))).trace(x, q, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @dsv4_fp8_gemv_concat") == 1
    assert f"schedule = {ffi.default_schedule(1, 1536, 4096)} : i32" in text
    assert "tensor<1x2x1536xf32>" in text


def test_bf16_output_handler_by_format_dtype_and_schedule(monkeypatch):
    """One FP8 weight times bf16 rows into a bf16 output takes the handler that stores bf16 (no cast kernel after
    it) at the schedules it is compiled for; a float32 output, float32 rows, another schedule or an FP4 weight keep
    the float32 handler."""
    monkeypatch.setattr(ffi, "register", lambda *args: None)               # lowering needs no library
    rng = np.random.default_rng(107)
    fp8, fp4 = _weight(rng, "fp8", 1024, 4096), _weight(rng, "mxfp4", 1024, 4096)

    def lowered(w, dtype, out_dtype, schedule=0):
        x = jnp.ones((2, 4096), dtype)
        return jax.jit(lambda x, w: ffi.gemv(x, w, out_dtype, schedule=schedule)).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
    for schedule in (0, *ffi.BF16_OUTPUT_SCHEDULES):
        text = lowered(fp8, jnp.bfloat16, jnp.bfloat16, schedule)
        assert text.count("custom_call @dsv4_fp8_gemv_bf16") == 1 and "tensor<1x2x1024xbf16>" in text
    for w, dtype, out_dtype, schedule in ((fp8, jnp.bfloat16, jnp.float32, 0), (fp8, jnp.float32, jnp.bfloat16, 0),
                                          (fp8, jnp.bfloat16, jnp.bfloat16, 814), (fp4, jnp.bfloat16, jnp.bfloat16, 0)):
        text = lowered(w, dtype, out_dtype, schedule)
        assert "_bf16" not in text and "xf32>" in text, (type(w).__name__, dtype, out_dtype, schedule)


def test_bad_weight_pairs_are_rejected_before_any_build():
    rng = np.random.default_rng(124)
    x = jnp.ones((2, 256), jnp.bfloat16)
    a = _weight(rng, "mxfp4", 64, 256)
    with pytest.raises(ValueError, match="one format, layout and shape"):
        ffi.gemv(x, (a, _weight(rng, "mxfp4", 128, 256)))
    with pytest.raises(ValueError, match="one format, layout and shape"):
        ffi.gemv(x, (a, _weight(rng, "nvfp4", 64, 256)))
    with pytest.raises(ValueError, match="one format, layout and shape"):
        ffi.gemv(x, (a, ffi.to_gemv_layout(_weight(rng, "mxfp4", 64, 256))))
    with pytest.raises(ValueError, match="one weight or a pair"):
        ffi.gemv(x, (a, a, a))
    with pytest.raises(ValueError, match="a pair of weights runs schedules"):
        ffi.gemv(x, (a, a), schedule=2811)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _dequant64(w):
    return _f64(w.dequantize(jnp.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("n,k,m,dtype,schedule", [
    (2048, 4096, 1, jnp.bfloat16, 0), (1024, 7168, 8, jnp.bfloat16, 0), (4096, 1024, 5, jnp.bfloat16, 821),
    (512, 2048, 3, jnp.float32, 0), (2080, 1536, 4, jnp.bfloat16, 411), (1024, 4096, 6, jnp.bfloat16, 1811),
    # streamed schedules (contiguous steps per warp; some warps get none) and register caps
    (1024, 2048, 8, jnp.bfloat16, 2811), (2080, 1536, 4, jnp.bfloat16, 2811), (2048, 7168, 3, jnp.bfloat16, 2411),
    (8192, 1024, 2, jnp.bfloat16, 50811), (1024, 4096, 8, jnp.bfloat16, 2411), (1024, 2048, 4, jnp.float32, 50811),
    # pipelined schedules: odd and even step counts per warp, warps without steps
    (2080, 1536, 4, jnp.bfloat16, 43811), (1024, 1408, 8, jnp.bfloat16, 3411), (512, 7168, 2, jnp.float32, 83411),
    (512, 1024, 1, jnp.bfloat16, 43811), (2048, 7168, 7, jnp.bfloat16, 83411),
    # unrolled (a warp's steps loaded together; partial last group)
    (512, 4096, 1, jnp.bfloat16, 814), (1024, 2048, 3, jnp.float32, 812), (2048, 1408, 5, jnp.bfloat16, 414),
    # 16 warps per tile (warps digit 0): 2 steps each, warps without steps (11 steps), unrolled with a partial group
    (512, 4096, 1, jnp.bfloat16, 11), (1024, 1408, 8, jnp.bfloat16, 11), (512, 4096, 3, jnp.float32, 12),
    (2048, 1536, 5, jnp.bfloat16, 12),
    # a streamed warp cut short (11 steps over 4 warps: 3, 3, 3, 2); pipelined warps without steps (4 over 8)
    (1024, 1408, 4, jnp.bfloat16, 2411), (512, 512, 2, jnp.bfloat16, 43811)])
def test_gemv_gpu(fmt, n, k, m, dtype, schedule):
    if n % (16 * (schedule // 10 % 10 or 1)):
        pytest.skip("N does not fit the schedule's tile")
    rng = np.random.default_rng(169)
    w = _weight(rng, fmt, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = jax.jit(lambda x, w: ffi.gemv(x, w, jnp.float32, schedule=schedule))(x, w)
    ref = _f64(x) @ _dequant64(w).T
    y = np.asarray(y, np.float64)
    assert y.shape == (m, n) and np.all(np.isfinite(y))
    tol = 2e-5 if dtype == jnp.float32 else 1e-5        # float32 rows: hi + lo bf16 parts (~2^-16 relative)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol
    assert np.max(np.abs(y - ref)) < 1e-4 * np.max(np.abs(ref))          # no single output wrong


# Staged schedules (FP4 only): one tile per CTA, many tiles per CTA (the stage ring wraps), float32 rows, two CTAs
# per SM, 4 and 16 consumer warps (warps digit 0 = 16).
STAGED_CASES = [(2048, 4096, 1, jnp.bfloat16, 4811), (1040, 7168, 8, jnp.bfloat16, 4811),
                (32768, 512, 4, jnp.float32, 4811), (8192, 4096, 3, jnp.bfloat16, 24811),
                (4096, 1408, 5, jnp.bfloat16, 4411), (2048, 4096, 8, jnp.bfloat16, 24011),
                (1040, 7168, 3, jnp.float32, 4011)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("n,k,m,dtype,schedule", STAGED_CASES)
def test_staged_gemv_gpu(fmt, n, k, m, dtype, schedule):
    test_gemv_gpu(fmt, n, k, m, dtype, schedule)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_staged_gemv_rejects_a_k_too_large_for_two_stages():
    rng = np.random.default_rng(200)
    w = _weight(rng, "mxfp4", 256, 7168)         # 61 KB per 16-row tile; two CTAs per SM leave ~113 KB each
    with pytest.raises(Exception, match="too large for two shared-memory stages"):
        jax.block_until_ready(ffi.gemv(jnp.ones((1, 7168), jnp.bfloat16), w, schedule=24811))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("schedule", [811, 4811])
def test_grouped_gemv_skips_unused_slots_gpu(fmt, schedule):
    """Slots with expert -1 are skipped by every warp (the staged producer and consumers must skip the same ones,
    or the stage ring goes out of step: wrong sums or a hang) and the other slots are right (the skipped slots'
    outputs are left unwritten, so they are not checked)."""
    rng = np.random.default_rng(214)
    w = _weight(rng, fmt, 512, 1024, experts=8)
    experts = jnp.asarray([3, -1, 0, -1, -1, 7, 3, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((8, 2, 1024)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w, e: ffi.grouped_gemv(x, w, e, jnp.float32, schedule=schedule))(x, w, experts),
                   np.float64)
    wd = _dequant64(w)
    for s, e in enumerate(np.asarray(experts)):
        if e >= 0:
            ref = _f64(x[s]) @ wd[e].T
            assert np.linalg.norm(y[s] - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows,dtype,schedule", [(6, jnp.bfloat16, 0), (48, jnp.bfloat16, 0), (24, jnp.float32, 0),
                                                 (40, jnp.bfloat16, 0), (40, jnp.bfloat16, 811), (48, jnp.bfloat16, 1811),
                                                 (48, jnp.bfloat16, 2811), (40, jnp.bfloat16, 50811),
                                                 (40, jnp.bfloat16, 43811), (48, jnp.bfloat16, 4811),
                                                 (24, jnp.float32, 4411), (40, jnp.bfloat16, 24011),
                                                 (48, jnp.bfloat16, 411), (24, jnp.float32, 811)])
def test_moe_gemv_gpu(fmt, rows, dtype, schedule):
    rng = np.random.default_rng(237)
    n_exp, n, k = 16, 256, 512
    w = _weight(rng, fmt, n, k, experts=n_exp)
    # few experts, so several rows share one (slots fill up, and some experts get more than 8 rows)
    ids = jnp.asarray(rng.integers(0, 5 if rows == 40 else n_exp, rows), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    y = np.asarray(jax.jit(lambda x, w, i: ffi.moe_gemv(x, w, i, jnp.float32, schedule=schedule))(x, w, ids), np.float64)
    wd = _dequant64(w)
    ref = np.einsum("rk,rnk->rn", _f64(x), wd[np.asarray(ids)])
    assert y.shape == (rows, n) and np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < (2e-5 if dtype == jnp.float32 else 1e-5)
    assert np.max(np.abs(y - ref)) < 1e-4 * np.max(np.abs(ref))


def _check_pair(y, x, w_a, w_b, experts=None):
    """y [R, 2N] (a pair's output): columns 0 .. N are x times w_a, N .. 2N x times w_b (row r times expert
    experts[r] where given), each half against float64 math; the second half is never written by the first's
    products, so a kernel that skipped a set or swapped the two fails here."""
    y = np.asarray(y, np.float64)
    n = w_a.shape[-2]
    assert y.shape == (x.shape[0], 2 * n) and np.all(np.isfinite(y))
    tol = 2e-5 if x.dtype == jnp.float32 else 1e-5
    for half, w in zip((y[:, :n], y[:, n:]), (w_a, w_b)):
        wd = _dequant64(w)
        ref = _f64(x) @ wd.T if experts is None else np.einsum("rk,rnk->rn", _f64(x), wd[np.asarray(experts)])
        assert np.linalg.norm(half - ref) / np.linalg.norm(ref) < tol
        assert np.max(np.abs(half - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("n,k,m,dtype,schedule", [(2048, 4096, 1, jnp.bfloat16, 0), (1040, 1536, 8, jnp.bfloat16, 411),
                                                  (512, 2048, 3, jnp.float32, 811), (1024, 1408, 6, jnp.bfloat16, 11)])
def test_gemv_pair_gpu(fmt, n, k, m, dtype, schedule):
    """Two weights of one format and shape in one launch (gate and up): y [M, 2N]; NVFP4 global scales differ."""
    rng = np.random.default_rng(273)
    w_a, w_b = _weight(rng, fmt, n, k), _weight(rng, fmt, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = jax.jit(lambda x, a, b: ffi.gemv(x, (a, b), jnp.float32, schedule=schedule))(x, w_a, w_b)
    _check_pair(y, x, w_a, w_b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("n,n2,k,m,dtype,schedule", [
    (1024, 512, 4096, 1, jnp.bfloat16, 0), (512, 1024, 2048, 8, jnp.bfloat16, 811),
    (2048, 144, 1536, 3, jnp.float32, 0), (128, 2064, 1024, 5, jnp.bfloat16, 11), (16, 16, 128, 2, jnp.bfloat16, 11)])
def test_gemv_concat_gpu(n, n2, k, m, dtype, schedule):
    """Two FP8 weights of one K and their own N in one launch: y [M, N + N2] against float64 math (N2 not a
    multiple of 128: a partial scale row; more warps than steps)."""
    rng = np.random.default_rng(288)
    w_a, w_b = _weight(rng, "fp8", n, k), _weight(rng, "fp8", n2, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = np.asarray(jax.jit(lambda x, a, b: ffi.gemv_concat(x, (a, b), jnp.float32, schedule=schedule))(x, w_a, w_b),
                   np.float64)
    ref = _f64(x) @ np.concatenate([_dequant64(w_a), _dequant64(w_b)]).T
    assert y.shape == (m, n + n2) and np.all(np.isfinite(y))
    tol = 2e-5 if dtype == jnp.float32 else 1e-5
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol
    assert np.max(np.abs(y - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("rows,dtype,schedule,layout", [(6, jnp.bfloat16, 0, False), (48, jnp.bfloat16, 811, False),
                                                        (24, jnp.float32, 0, False), (40, jnp.bfloat16, 0, True)])
def test_moe_gemv_pair_gpu(fmt, rows, dtype, schedule, layout):
    """Routed rows times their experts of two stacked weights in one launch (the routed gate and up projections),
    checkpoint and GEMV layout (FP4); stacked FP8 pairs too (the API takes them, the model does not use them)."""
    if layout and fmt == "fp8":
        pytest.skip("the GEMV layout is for FP4 weights")
    rng = np.random.default_rng(310)
    n_exp, n, k = 16, 256, 512
    w_a, w_b = _weight(rng, fmt, n, k, experts=n_exp), _weight(rng, fmt, n, k, experts=n_exp)
    ids = jnp.asarray(rng.integers(0, 5 if rows == 40 else n_exp, rows), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    pair = (ffi.to_gemv_layout(w_a), ffi.to_gemv_layout(w_b)) if layout else (w_a, w_b)
    y = jax.jit(lambda x, p, i: ffi.moe_gemv(x, p, i, jnp.float32, schedule=schedule))(x, pair, ids)
    _check_pair(y, x, w_a, w_b, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("slots,n,k,m,schedule", [(1, 2048, 4096, 1, 0), (1, 1024, 7168, 8, 811), (8, 1024, 4096, 1, 0),
                                                  (8, 1024, 4096, 5, 411), (1, 512, 4096, 3, 11)])
def test_fp8_bf16_output_gpu(slots, n, k, m, schedule):
    """The bf16-output handler stores each float32 sum rounded to nearest even: bit for bit the float32 handler's
    output cast to bf16 (the same sums, one rounding), and within bf16 rounding of float64 math. Grouped as the
    attention's wo_a calls it (slot g times weight g, 8 groups)."""
    rng = np.random.default_rng(328)
    w = _weight(rng, "fp8", n, k, experts=slots)
    x = jnp.asarray(rng.standard_normal((slots, m, k)), jnp.bfloat16)
    groups = np.arange(slots, dtype=np.int32)
    run = jax.jit(lambda x, w, dtype: ffi.grouped_gemv(x, w, groups, dtype, schedule=schedule), static_argnums=2)
    y16, y32 = run(x, w, jnp.bfloat16), run(x, w, jnp.float32)
    assert y16.dtype == jnp.bfloat16 and y16.shape == (slots, m, n)
    bits = lambda y: np.asarray(y.astype(jnp.bfloat16).view(jnp.uint16))   # noqa: E731
    np.testing.assert_array_equal(bits(y16), bits(y32))
    ref = np.einsum("smk,snk->smn", _f64(x), _dequant64(w))
    assert np.max(np.abs(_f64(y16) - ref)) < 2 ** -8 * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gemv_gpu_no_host_sync_and_no_retrace():
    rng = np.random.default_rng(344)
    w = _weight(rng, "mxfp4", 1024, 2048)
    f = jax.jit(lambda x, w: ffi.gemv(x, w))
    xs = [jnp.asarray(rng.standard_normal((4, 2048)), jnp.bfloat16) for _ in range(3)]
    jax.block_until_ready(f(xs[0], w))
    with jax.transfer_guard("disallow"):
        for x in xs:
            jax.block_until_ready(f(x, w))
    assert f._cache_size() == 1


def test_dispatch_falls_back_to_pallas_without_nvcc(monkeypatch):
    """No nvcc on a CUDA machine: one warning, and the kernel plan keeps the Pallas kernels (ffi=False)."""
    from dsv4_jax.ops import plan as kernel_plan
    def no_nvcc():
        raise build.FfiBuildError("nvcc not found")
    monkeypatch.setattr(build, "_nvcc", no_nvcc)
    monkeypatch.setattr(build, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(build, "_registered", set())
    kernel_plan.ffi_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="using the Pallas kernels: nvcc not found"):
            assert kernel_plan.ffi_available() is False
    finally:
        kernel_plan.ffi_available.cache_clear()
