"""Pallas decode kernels (dsv4_jax/pallas_kernels/gemv.py, moe.py) against float64 dequantized math.

CPU: the FP4 decode constants checked for every byte, the kernels in interpret mode (the inline-PTX decode is
replaced by its exact jnp emulation there) on fresh random weights, and the CUDA lowering of every kernel for an
abstract H200. GPU (`-m gpu`, benchmarks/gpu_check.sh): the compiled kernels against the same references.
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.numerics.formats import E2M1_VALUES, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from dsv4_jax.pallas_kernels import gemv, moe, prefill

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


# ---- random stored weights ------------------------------------------------------------------------------------
def _mxfp4(rng, shape):
    *lead, n, k = shape
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)),
                       jnp.asarray(rng.integers(112, 132, (*lead, n, k // 32), dtype=np.uint8)))


def _nvfp4(rng, shape):
    *lead, n, k = shape
    scale = jnp.asarray(rng.uniform(2.0 ** -6, 448, (*lead, n, k // 16)), jnp.float32).astype(jnp.float8_e4m3fn)
    gs = jnp.asarray(rng.uniform(1e-4, 1e-2, tuple(lead)), jnp.float32)
    return Nvfp4Weight(jnp.asarray(rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)), scale, gs)


def _fp8(rng, shape):
    n, k = shape
    w = jnp.asarray(np.clip(rng.standard_normal((n, k)) * 64, -448, 448), jnp.float32).astype(jnp.float8_e4m3fn)
    return Fp8BlockWeight(w, jnp.asarray(rng.integers(108, 124, (-(-n // 128), -(-k // 128))), jnp.uint8))


def _dequant64(w) -> np.ndarray:
    """float64 dense weight; every stored value and scale is exact in float32, so this is exact."""
    return np.asarray(w.dequantize(jnp.float32), np.float64)


def _check(y, x, w_dense, tol):
    """y [M, N] vs float64 x @ W^T: relative Frobenius error, NaN never passes (unwritten outputs show up)."""
    ref = np.asarray(x, np.float64) @ w_dense.T
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "non-finite output (unwritten or poisoned element)"
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < tol, err


def _x(rng, m, k, dtype):
    return jnp.asarray(rng.standard_normal((m, k)), dtype)


# ---- decode constants -----------------------------------------------------------------------------------------
def test_fp4_decode_constants_every_byte():
    pairs = np.arange(65536, dtype=np.uint32)
    lo, hi = gemv.fp4_decode_bits_np(pairs)

    def as_values(bits16):
        return (bits16.astype(np.uint32) << 16).view(np.float32).astype(np.float64) * 2.0 ** 126

    b0, b1 = pairs & 0xFF, pairs >> 8
    np.testing.assert_array_equal(as_values(lo & 0xFFFF), E2M1_VALUES[b0 & 0xF])
    np.testing.assert_array_equal(as_values(lo >> 16), E2M1_VALUES[b1 & 0xF])
    np.testing.assert_array_equal(as_values(hi & 0xFFFF), E2M1_VALUES[b0 >> 4])
    np.testing.assert_array_equal(as_values(hi >> 16), E2M1_VALUES[b1 >> 4])


def test_scale_factor_bits():
    b = np.arange(gemv.MX_SHIFT - 4, 129 + gemv.MX_SHIFT, dtype=np.uint8)
    f = np.asarray(gemv.mx_factor_bits(jnp.asarray(b)))
    assert np.all(f >> 16 == f & 0xFFFF)
    got = ((f & 0xFFFF) << 16).view(np.float32).astype(np.float64) * 2.0 ** (gemv.MX_SHIFT - 126)
    np.testing.assert_array_equal(got, 2.0 ** (b.astype(np.float64) - 127))
    normal = np.arange(0x08, 0x7F, dtype=np.uint8)                       # every positive normal e4m3
    f = np.asarray(gemv.nv_factor_bits(jnp.asarray(normal)))
    assert np.all(f >> 16 == f & 0xFFFF)
    got = ((f & 0xFFFF) << 16).view(np.float32).astype(np.float64) * 2.0 ** (gemv.NV_SHIFT - 126)
    want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(normal), jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


# ---- interpret mode -------------------------------------------------------------------------------------------
DENSE = {"mxfp4": (_mxfp4, gemv.mxfp4_matmul), "nvfp4": (_nvfp4, gemv.nvfp4_matmul), "fp8": (_fp8, gemv.fp8_matmul)}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
def test_dense_interpret(fmt):
    rng = np.random.default_rng(96)
    n, k = 128, 512
    make, fn = DENSE[fmt]
    w = make(rng, (n, k))
    dense = _dequant64(w)
    x = _x(rng, 5, k, jnp.bfloat16)
    _check(fn(x, w, jnp.float32, interpret=True, block_n=64, split_k=2), x.astype(jnp.float32), dense, 1e-5)
    x = _x(rng, 3, k, jnp.float32)                                        # float32: hi + lo bf16 rows
    _check(fn(x, w, interpret=True, block_n=64, split_k=1), x, dense, 2e-5)


def test_activation_tiling():
    """Rows -> (columns per program, column tiles): powers of two from 16 to 128, then tiles of 128."""
    assert [gemv.activation_tiling(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 200, 256)] == [
        (16, 1), (16, 1), (32, 1), (32, 1), (64, 1), (64, 1), (128, 1), (128, 1), (128, 2), (128, 2), (128, 2)]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("m,dtype", [(24, jnp.bfloat16), (64, jnp.bfloat16), (200, jnp.bfloat16),
                                     (40, jnp.float32), (100, jnp.float32)])
def test_dense_interpret_wide(fmt, m, dtype):
    """Decode steps of batch 17-256 (or verify steps): 32, 64 or 128 activation columns per program and two
    column tiles above 128 (float32 rows count twice, as hi + lo parts), on the kernels' default tilings. Every
    output row is checked against float64 math, so a column tile written twice or not at all (NaN in interpret
    mode) fails."""
    rng = np.random.default_rng(121)
    n, k = 128, 512
    make, fn = DENSE[fmt]
    w = make(rng, (n, k))
    x = _x(rng, m, k, dtype)
    y = fn(x, w, jnp.float32, interpret=True)
    _check(y, x.astype(jnp.float32), _dequant64(w), 1e-5 if dtype == jnp.bfloat16 else 2e-5)
    ref = np.asarray(x, np.float64) @ _dequant64(w).T                   # no row may be off, not just on average
    row_err = np.linalg.norm(np.asarray(y, np.float64) - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.max(row_err) < 1e-4


def test_f16_prescale_exponent():
    """amax * 2^p lands in [2^13, 2^14) for every normal float32 magnitude a bf16 row can have (float64 check),
    p is 0 for a zero row, and the clip holds at the extremes."""
    rng = np.random.default_rng(136)
    amax = np.concatenate([2.0 ** rng.uniform(-86, 86, 500), [2.0 ** -86, 1.0, 1.5, 2.0 ** 86]]).astype(np.float32)
    p = np.asarray(gemv.f16_prescale_exponent(jnp.asarray(amax)), np.float64)
    scaled = amax.astype(np.float64) * 2.0 ** p
    assert np.all((scaled >= 2.0 ** 13) & (scaled < 2.0 ** 14))
    extremes = gemv.f16_prescale_exponent(jnp.asarray([0.0, 2.0 ** -120, 2.0 ** 120], jnp.float32))
    assert list(np.asarray(extremes)) == [0, 100, -100]


@pytest.mark.parametrize("row_prescale", [False, True])
def test_fp8_rows_of_any_magnitude_interpret(row_prescale):
    """The FP8 kernel prescales each activation row by its own largest magnitude (in each program's K range, or
    with `row_prescale` once over all of K before the launch): rows from 2^-60 to 2^60 and a zero row, over two K
    splits, each within float32 rounding of float64 math; a shared prescale would flush the small rows to zero or
    overflow f16 on the large ones."""
    rng = np.random.default_rng(151)
    n, k, m = 128, 512, 6
    w = _fp8(rng, (n, k))
    magnitudes = np.array([2.0 ** -60, 2.0 ** -20, 1.0, 0.0, 2.0 ** 20, 2.0 ** 60])[:, None]
    x = jnp.asarray(rng.standard_normal((m, k)) * magnitudes, jnp.bfloat16)
    y = np.asarray(gemv.fp8_matmul(x, w, jnp.float32, interpret=True, block_n=64, split_k=2,
                                   row_prescale=row_prescale), np.float64)
    ref = np.asarray(x, np.float64) @ _dequant64(w).T
    assert np.all(y[3] == 0.0)
    for r in (0, 1, 2, 4, 5):
        assert np.linalg.norm(y[r] - ref[r]) / np.linalg.norm(ref[r]) < 1e-5, r


@pytest.mark.parametrize("m, dtype, block_n, row_prescale", [(40, jnp.bfloat16, 128, True),
                                                               (200, jnp.bfloat16, 256, True),
                                                               (50, jnp.float32, 128, True),
                                                               (64, jnp.bfloat16, 256, False),
                                                               (64, jnp.bfloat16, None, None),
                                                               (160, jnp.bfloat16, None, None)])
def test_fp8_wide_tiles_and_row_prescale_interpret(m, dtype, block_n, row_prescale):
    """The tilings the GPU sweep times (bench_ffi.DENSE_VARIANTS): `row_prescale` and weight tiles of 128 and 256
    rows (two 128-row scale blocks, each step's scale per block) at 64 and 128 activation columns, two column
    tiles and float32 hi + lo rows: every row against float64, rows of magnitudes 2^-30..2^30 (a prescale or its
    undo taken from another row is off by powers of two), block scales drawn per 128 rows (a scale taken from the
    other half of a 256-row tile is off)."""
    rng = np.random.default_rng(m)
    n, k = 512, 512
    w = _fp8(rng, (n, k))
    x = jnp.asarray(rng.standard_normal((m, k)) * 2.0 ** rng.integers(-30, 31, (m, 1)), dtype)
    tiling = dict(block_n=block_n, num_warps=8, split_k=2) if block_n else {}     # None: the default tiling
    y = np.asarray(gemv.fp8_matmul(x, w, jnp.float32, interpret=True, row_prescale=row_prescale, **tiling),
                   np.float64)
    ref = np.asarray(x, np.float64) @ _dequant64(w).T
    assert y.shape == ref.shape and np.all(np.isfinite(y))
    row_err = np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.max(row_err) < (1e-5 if dtype == jnp.bfloat16 else 2e-5), np.max(row_err)


def test_fp8_default_tiling():
    """fp8_matmul's default tiling by activation columns and column tiles: 128-row weight tiles on 8 warps at 32 and
    64 columns (the tiling the H100 sweep found fastest there), the same with the rows' prescale before the launch
    at more than one column tile (129-256 rows), the tiling before elsewhere (16 columns: 128 rows where N allows,
    one tile of 128 columns: 64 rows, both on 4 warps); given values are kept."""
    assert gemv._fp8_tiling(32768, 16, 1, None, None, None) == (128, 4, False)
    assert gemv._fp8_tiling(512, 32, 1, None, None, None) == (128, 8, False)
    assert gemv._fp8_tiling(32768, 64, 1, None, None, None) == (128, 8, False)
    assert gemv._fp8_tiling(4096, 128, 1, None, None, None) == (64, 4, False)
    assert gemv._fp8_tiling(4096, 128, 2, None, None, None) == (128, 8, True)
    assert gemv._fp8_tiling(192, 128, 2, None, None, None) == (64, 4, True)       # N takes no 128-row tile
    assert gemv._fp8_tiling(192, 64, 1, None, None, None) == (64, 4, False)
    assert gemv._fp8_tiling(4096, 64, 1, 256, None, True) == (256, 4, True)
    assert gemv._fp8_tiling(4096, 64, 1, 128, 4, None) == (128, 4, False)
    assert gemv._fp8_tiling(4096, 128, 2, 64, 4, False) == (64, 4, False)


@pytest.mark.parametrize("kernel", [False, True])
def test_f16_rows_are_exact(kernel):
    """f16_rows (its kernel in interpret mode over two K steps, or the jnp reference): each bf16 row times 2^p is
    exactly representable in f16 (float64 check) down to 2^-27 of the row's largest magnitude, and 2^-p undoes
    it; a zero row stays zero with undo 1; the kernel equals the reference bit for bit."""
    rng = np.random.default_rng(211)
    x = rng.standard_normal((8, 1024)) * 2.0 ** rng.integers(-40, 41, (8, 1))
    x[5] = 0.0
    x[2, 700] = -2.0 ** 30                             # the largest magnitude in the second step
    x = jnp.asarray(x, jnp.bfloat16)
    x16, undo = gemv.f16_rows(x, interpret=True) if kernel else gemv.f16_rows_reference(x)
    x64, back = np.asarray(x, np.float64), np.asarray(x16, np.float64) * np.asarray(undo, np.float64)[:, None]
    big = np.abs(x64) >= np.abs(x64).max(axis=1, keepdims=True) * 2.0 ** -27
    np.testing.assert_array_equal(back[big], x64[big])
    assert np.all(np.abs(back - x64) <= np.abs(x64).max(axis=1, keepdims=True) * 2.0 ** -37)
    assert np.all(np.asarray(x16[5]) == 0) and float(undo[5]) == 1.0
    assert np.all(np.abs(np.asarray(x16, np.float64)).max(axis=1)[np.arange(8) != 5] >= 2.0 ** 13)
    if kernel:
        ref16, ref_undo = gemv.f16_rows_reference(x)
        np.testing.assert_array_equal(np.asarray(x16).view(np.uint16), np.asarray(ref16).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(undo), np.asarray(ref_undo))


def test_split_is_capped_by_the_partials():
    """At 128 activation columns the split-K partials (split x N x 128 float32) would outgrow the weight: the split
    stays at what keeps them smaller; at 16 columns the GPU-filling split is unchanged."""
    assert gemv._split_cap(4096, 128) == 8 and gemv._split_cap(4096 / 2, 256) == 2
    assert gemv._pick_split(16, 32, max_split=gemv._split_cap(4096, 256)) == 4
    assert gemv._pick_split(16, 32, max_split=gemv._split_cap(4096, 16)) == 16


def test_dense_interpret_rows_and_dtype():
    rng = np.random.default_rng(238)
    w = _mxfp4(rng, (64, 256))
    x = _x(rng, 16, 256, jnp.bfloat16)
    y = gemv.mxfp4_matmul(x, w, interpret=True, block_n=64, split_k=1)
    assert y.dtype == jnp.bfloat16 and y.shape == (16, 64)
    _check(y.astype(jnp.float32), x.astype(jnp.float32), _dequant64(w), 1e-2)
    with pytest.raises(ValueError, match="at most 256 rows"):
        gemv.mxfp4_matmul(_x(rng, 257, 256, jnp.bfloat16), w, interpret=True)
    with pytest.raises(ValueError, match="at most 128 rows"):
        gemv.fp8_matmul(_x(rng, 129, 256, jnp.float32), _fp8(rng, (64, 256)), interpret=True)
    for block_n, n in ((192, 384), (256, 384), (48, 384)):          # not 128 / 2^j or a multiple of 128; N % 256
        with pytest.raises(ValueError, match="block_n="):
            gemv.fp8_matmul(_x(rng, 4, 256, jnp.bfloat16), _fp8(rng, (n, 256)), interpret=True, block_n=block_n)


@pytest.mark.parametrize("fmt,dtype", [("mxfp4", jnp.bfloat16), ("nvfp4", jnp.float32)])
def test_moe_interpret(fmt, dtype):
    """Decode-wide slots, an expert's rows over several slots (float32: hi and lo halves), against float64."""
    rng = np.random.default_rng(256)
    n_exp, n, k = 6, 64, 256
    w = (_mxfp4 if fmt == "mxfp4" else _nvfp4)(rng, (n_exp, n, k))
    dense = _dequant64(w)
    rows = 9 if dtype == jnp.bfloat16 else 11                            # float32: > 8 rows of one expert split
    ids = np.concatenate([rng.integers(0, n_exp, rows - 9), np.full(9, 2)]).astype(np.int32)
    rng.shuffle(ids)
    x = _x(rng, rows, k, dtype)
    y = np.asarray(moe.moe_matmul(x, w, jnp.asarray(ids), jnp.float32, interpret=True), np.float64)
    ref = np.einsum("rk,rnk->rn", np.asarray(x, np.float64), dense[ids])
    assert np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-5


def test_moe_prefill_slots_interpret():
    """Prefill-wide slots (64 columns, no split-K), rows in random order, against float64; rows past the slots'
    real rows are never read back (the output is exactly [R, N], finite)."""
    rng = np.random.default_rng(273)
    n_exp, n, k = 4, 128, 256
    w = _mxfp4(rng, (n_exp, n, k))
    ids = jnp.asarray(rng.integers(0, n_exp, 300), jnp.int32)
    x = _x(rng, 300, k, jnp.bfloat16)
    y = np.asarray(moe.moe_matmul(x, w, ids, jnp.float32, slot_cols=64, split_k=1, block_n=64, interpret=True))
    assert y.shape == (300, n) and np.all(np.isfinite(y))
    ref = np.einsum("rk,rnk->rn", np.asarray(x.astype(jnp.float32), np.float64), _dequant64(w)[np.asarray(ids)])
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


def _routed_ffn64(x, wg, wu, wd, ids, rw, limit) -> np.ndarray:
    """float64 routed experts of tokens x [T, D]: sum over the picks ids [T, K] (-1: none) of rw times
    W_down h, h = SiLU(min(gate, limit)) * clamp(up, -limit, limit), from the dequantized weights (exact)."""
    g64, u64, d64 = _dequant64(wg), _dequant64(wu), _dequant64(wd)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ids, rw = np.asarray(ids), np.asarray(rw, np.float64)
    out = np.zeros((x.shape[0], d64.shape[1]))
    for e in range(g64.shape[0]):
        t, k = np.nonzero(ids == e)
        gate = np.minimum(x64[t] @ g64[e].T, limit)
        up = np.clip(x64[t] @ u64[e].T, -limit, limit)
        h = gate / (1 + np.exp(-gate)) * up * rw[t, k][:, None]
        np.add.at(out, t, h @ d64[e].T)
    return out


def _routed_case(rng, make, n_exp=4, n=256, d=256, tokens=150, top_k=3):
    wg, wu, wd = make(rng, (n_exp, n, d)), make(rng, (n_exp, n, d)), make(rng, (n_exp, d, n))
    ids = rng.integers(0, n_exp, (tokens, top_k)).astype(np.int32)
    ids[5] = -1                                          # a token of no expert (padding)
    ids[7, 1] = -1                                       # a pick of another device's expert
    rw = jnp.asarray(rng.uniform(0.1, 2.0, (tokens, top_k)), jnp.float32)
    return wg, wu, wd, jnp.asarray(ids), rw


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_moe_ffn_interpret(fmt):
    """The routed experts of a chunk in the two kernels on one schedule (the hidden values never leave the slot
    layout): against float64 (activations scaled so that a part of both projections is clamped, picks of no
    expert adding nothing), and bit for bit what moe_matmul's gate and up outputs, the SwiGLU after them, and
    moe_matmul's down projection of the bf16 hidden rows give on the same tiling."""
    rng = np.random.default_rng(7)
    limit = 7.0
    make = _mxfp4 if fmt == "mxfp4" else _nvfp4
    wg, wu, wd, ids, rw = _routed_case(rng, make)
    x64 = rng.standard_normal((ids.shape[0], wg.shape[2]))
    gate64 = np.einsum("tk,enk->ten", x64, _dequant64(wg))
    x = jnp.asarray(x64 * 8.0 / np.median(np.abs(gate64)), jnp.bfloat16)      # |gate| around the limit
    y = moe.moe_ffn(x, wg, wu, wd, ids, rw, limit, slot_cols=64, interpret=True)
    assert y.shape == (ids.shape[0], wd.shape[1]) and y.dtype == jnp.float32
    got = np.asarray(y, np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[5] == 0.0)
    ref = _routed_ffn64(x, wg, wu, wd, ids, rw, limit)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3                # bf16 hidden values
    xr = np.asarray(x.astype(jnp.float32), np.float64)
    g = np.minimum(np.einsum("tk,enk->ten", xr, _dequant64(wg)), limit)
    assert 0.1 < np.mean(g == limit) < 0.9
    # the composition of the one-projection kernel on the same slots
    flat = jnp.maximum(ids, 0).reshape(-1)
    xs = jnp.repeat(x, ids.shape[1], axis=0)
    tiles = dict(slot_cols=64, split_k=1, block_n=64, interpret=True)
    gate = jnp.minimum(moe.moe_matmul(xs, wg, flat, jnp.float32, **tiles), limit)
    up = jnp.clip(moe.moe_matmul(xs, wu, flat, jnp.float32, **tiles), -limit, limit)
    h = (gate * jax.nn.sigmoid(gate) * up * rw.reshape(-1)[:, None]).astype(jnp.bfloat16)
    down = moe.moe_matmul(h, wd, flat, jnp.float32, **tiles)
    composed = jnp.where((ids >= 0).reshape(-1, 1), down, 0.0).reshape(*ids.shape, -1).sum(axis=1)
    np.testing.assert_array_equal(got, np.asarray(composed, np.float64))


def test_moe_ffn_picks_are_not_mixed_up():
    """Mutations the float64 check must catch: two tokens' picks swapped, or one routing weight changed."""
    rng = np.random.default_rng(9)
    wg, wu, wd, ids, rw = _routed_case(rng, _mxfp4, tokens=40)
    x = _x(rng, ids.shape[0], wg.shape[2], jnp.bfloat16) * 0.02
    ref = _routed_ffn64(x, wg, wu, wd, ids, rw, 7.0)
    run = lambda i, w: np.asarray(moe.moe_ffn(x, wg, wu, wd, i, w, 7.0, slot_cols=16, interpret=True), np.float64)
    err = lambda y: np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err(run(ids, rw)) < 5e-3
    swapped = ids.at[jnp.asarray([0, 1])].set(ids[jnp.asarray([1, 0])])
    assert not np.array_equal(np.asarray(swapped), np.asarray(ids))
    assert err(run(swapped, rw)) > 0.05
    assert err(run(ids, rw.at[3, 0].multiply(3.0))) > 1e-2


def test_moe_ffn_bad_input_is_refused():
    rng = np.random.default_rng(8)
    wg, wu, wd, ids, rw = _routed_case(rng, _mxfp4, tokens=8)
    x = _x(rng, 8, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="takes bfloat16 tokens"):
        moe.moe_ffn(x.astype(jnp.float32), wg, wu, wd, ids, rw, 7.0, interpret=True)
    with pytest.raises(ValueError, match="share a format and a shape"):
        moe.moe_ffn(x, wg, _nvfp4(rng, (4, 256, 256)), wd, ids, rw, 7.0, interpret=True)
    with pytest.raises(ValueError, match="down weight must be a stacked FP4 weight"):
        moe.moe_ffn(x, wg, wu, wg.packed, ids, rw, 7.0, interpret=True)
    with pytest.raises(ValueError, match=r"row_weights \[T, K\] expected"):
        moe.moe_ffn(x, wg, wu, wd, ids, rw[:3], 7.0, interpret=True)


def test_tiling_that_failed_on_the_gpu_is_refused():
    rng = np.random.default_rng(373)
    w = _mxfp4(rng, (2, 128, 256))
    x, ids = _x(rng, 4, 256, jnp.bfloat16), jnp.asarray([0, 1, 1, 0], jnp.int32)
    with pytest.raises(ValueError, match="8 warps with 3 pipeline stages and 32 packed bytes"):
        moe.moe_matmul(x, w, ids, block_n=128, unroll=2, num_warps=8, slot_cols=128, interpret=True)
    with pytest.raises(ValueError, match="gave wrong results"):
        gemv.mxfp4_matmul(x, Mxfp4Weight(w.packed[0], w.scale[0]), unroll=2, num_warps=8, interpret=True)
    moe.moe_matmul(x, w, ids, block_n=128, unroll=2, num_warps=8, num_stages=1, slot_cols=128, interpret=True)


def test_moe_schedule():
    ids = jnp.asarray([3, 1, 3, 3, 0, 1, 3], jnp.int32)
    slot_expert, slot_rows, slot_of_row, pos_of_row = moe.moe_schedule(ids, capacity=2)
    se = np.asarray(slot_expert)
    for r in range(7):
        assert se[slot_of_row[r]] == ids[r]
        assert slot_rows[slot_of_row[r], pos_of_row[r]] == r
    assert sorted(se[se >= 0].tolist()) == [0, 1, 3, 3]
    assert np.sum(np.asarray(slot_rows) < 7) == 7


@pytest.mark.parametrize("rows, experts, capacity", [(7, 4, 2), (192, 256, 8), (384, 256, 8), (1536, 256, 8),
                                                      (100, 3, 16), (64, 8, 1)])
def test_compared_schedule_equals_the_sorted_one(rows, experts, capacity):
    """moe_schedule's two constructions (pairwise comparisons for a step's rows, a stable sort beyond) give the same
    four arrays, element for element, on random experts with rows of no expert (-1) among them; and the schedule is
    one: every row sits in a slot of its expert, each slot holds rows of one expert in increasing index."""
    rng = np.random.default_rng(rows + experts)
    ids = jnp.asarray(rng.integers(-1, experts, rows), jnp.int32)
    n_slots = moe.slot_bound(rows, capacity, experts + 1)
    compared = moe._compared_schedule(ids, capacity, n_slots)
    sorted_ = moe._sorted_schedule(ids, capacity, n_slots)
    for a, b in zip(compared, sorted_):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    slot_expert, slot_rows, slot_of_row, pos_of_row = (np.asarray(a) for a in compared)
    ids = np.asarray(ids)
    assert np.array_equal(slot_expert[slot_of_row], ids)
    assert np.array_equal(slot_rows[slot_of_row, pos_of_row], np.arange(rows))
    held = slot_rows[slot_rows < rows].tolist()
    assert sorted(held) == list(range(rows))


# ---- CUDA lowering on CPU -------------------------------------------------------------------------------------
def _lower_for_h200(f, *args):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering():
    sds = jax.ShapeDtypeStruct
    n, k = 1024, 4096
    x = sds((4, k), jnp.bfloat16)
    cases = [
        (gemv.mxfp4_matmul, (x, Mxfp4Weight(sds((n, k // 2), jnp.uint8), sds((n, k // 32), jnp.uint8)))),
        (gemv.nvfp4_matmul, (x, Nvfp4Weight(sds((n, k // 2), jnp.uint8), sds((n, k // 16), jnp.float8_e4m3fn),
                                            sds((), jnp.float32)))),
        (gemv.fp8_matmul, (x, Fp8BlockWeight(sds((n, k), jnp.float8_e4m3fn), sds((n // 128, k // 128), jnp.uint8)))),
        (moe.moe_matmul, (sds((12, k), jnp.bfloat16),
                          Mxfp4Weight(sds((8, n, k // 2), jnp.uint8), sds((8, n, k // 32), jnp.uint8)),
                          sds((12,), jnp.int32))),
    ]
    wide = sds((200, k), jnp.bfloat16)                                    # a verify step: two column tiles
    cases += [(gemv.fp8_matmul, (wide, cases[2][1][1])), (gemv.mxfp4_matmul, (wide, cases[0][1][1])),
              (functools.partial(gemv.fp8_matmul, row_prescale=True, block_n=128, num_warps=8),
               (sds((64, k), jnp.bfloat16), cases[2][1][1])),
              (functools.partial(gemv.fp8_matmul, row_prescale=True, block_n=256, num_warps=8, split_k=1),
               (sds((128, k), jnp.bfloat16), cases[2][1][1]))]
    cases.append((functools.partial(moe.moe_matmul, slot_cols=64, split_k=1, block_n=64),      # prefill slots
                  (sds((600, k), jnp.bfloat16),
                   Mxfp4Weight(sds((8, n, k // 2), jnp.uint8), sds((8, n, k // 32), jnp.uint8)),
                   sds((600,), jnp.int32))))
    stacked = Mxfp4Weight(sds((8, n, k // 2), jnp.uint8), sds((8, n, k // 32), jnp.uint8))
    down = Mxfp4Weight(sds((8, k, n // 2), jnp.uint8), sds((8, k, n // 32), jnp.uint8))
    cases.append((functools.partial(moe.moe_ffn, limit=10.0, slot_cols=128, up_tiles=dict(unroll=4, num_warps=8)),
                  (sds((400, k), jnp.bfloat16), stacked, stacked, down, sds((400, 4), jnp.int32),
                   sds((400, 4), jnp.float32))))
    m, nb, kb = 512, n // 128, k // 128
    xq, wq = sds((m, k), jnp.float8_e4m3fn), sds((n, k), jnp.float8_e4m3fn)
    cases += [(prefill.fp8_block_matmul, (xq, sds((m, kb), jnp.float32), wq, sds((nb, kb), jnp.float32))),
              (prefill.fp8_block_matmul, (xq, sds((m, kb), jnp.float32), wq, sds((n, kb), jnp.float32)))]
    for fn, args in cases:
        text = _lower_for_h200(fn, *args)
        assert "__gpu$xla.gpu.triton" in text, fn.__name__


# ---- on the GPU -----------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 200, 256])
def test_dense_gpu(fmt, m):
    """Every activation width on the default tilings: 16 columns (decode), 32 / 64 / 128 and two tiles of 128
    (batch 17-256, verify steps); float32 rows as hi + lo parts up to 128 rows."""
    rng = np.random.default_rng(470)
    n, k = 2048, 4096
    make, fn = DENSE[fmt]
    w = make(rng, (n, k))
    x = _x(rng, m, k, jnp.bfloat16)
    _check(jax.jit(lambda x, w: fn(x, w, jnp.float32))(x, w), x.astype(jnp.float32), _dequant64(w), 1e-5)
    if m <= 8 or m in (32, 64):
        x = _x(rng, m, k, jnp.float32)
        _check(jax.jit(fn)(x, w), x, _dequant64(w), 2e-5)
    if fmt == "fp8" and m >= 32:                    # the rows prescaled before the launch, the sweep's tilings
        x = _x(rng, m, k, jnp.bfloat16)
        for block_n, warps in ((64, 4), (128, 8), (256, 8)):
            y = jax.jit(lambda x, w: fn(x, w, jnp.float32, row_prescale=True, block_n=block_n, num_warps=warps))(x, w)
            _check(y, x.astype(jnp.float32), _dequant64(w), 1e-5)


@pytest.mark.gpu
@gpu
def test_f16_rows_gpu():
    """f16_rows' kernel on the GPU equals its jnp reference (exact operations: a power-of-two scale, a conversion
    that is exact above f16's subnormals) bit for bit, rows of magnitudes 2^-40..2^40 and a zero row."""
    rng = np.random.default_rng(491)
    x = rng.standard_normal((64, 4096)) * 2.0 ** rng.integers(-40, 41, (64, 1))
    x[7] = 0.0
    x = jnp.asarray(x, jnp.bfloat16)
    x16, undo = jax.jit(gemv.f16_rows)(x)
    ref16, ref_undo = jax.jit(gemv.f16_rows_reference)(x)
    np.testing.assert_array_equal(np.asarray(x16).view(np.uint16), np.asarray(ref16).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(undo), np.asarray(ref_undo))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_moe_gpu(fmt):
    rng = np.random.default_rng(505)
    n_exp, n, k = 32, 2048, 4096
    w = (_mxfp4 if fmt == "mxfp4" else _nvfp4)(rng, (n_exp, n, k))
    ids = jnp.asarray(np.stack([rng.choice(n_exp, 6, replace=False) for _ in range(8)]).reshape(-1), jnp.int32)
    x = _x(rng, ids.shape[0], k, jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32))(x, w, ids), np.float64)
    dense = _dequant64(w)
    ref = np.einsum("rk,rnk->rn", np.asarray(x.astype(jnp.float32), np.float64), dense[np.asarray(ids)])
    assert np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_moe_ffn_gpu(fmt):
    """Flash's expert shapes (gate and up 2,048 x 4,096, down 4,096 x 2,048) over 16 experts and 1,024 tokens of 6
    picks on the tiling the dispatch picks (128-column slots; 64-row tiles on 8 warps for gate and up, moe_matmul's
    prefill tiling for the down projection): against float64 within bf16 rounding of the hidden values, and
    against moe_matmul's gate, up and down outputs with the SwiGLU between them (the kernel's sigmoid is Triton's,
    the composition's XLA's, so the hidden values may differ by a bf16 rounding)."""
    rng = np.random.default_rng(21)
    n_exp, n, d, tokens, top_k, limit = 16, 2048, 4096, 1024, 6, 10.0
    make = _mxfp4 if fmt == "mxfp4" else _nvfp4
    wg, wu, wd = make(rng, (n_exp, n, d)), make(rng, (n_exp, n, d)), make(rng, (n_exp, d, n))
    ids = np.stack([rng.choice(n_exp, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[:7] = -1                                                         # padding tokens
    ids, rw = jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)
    x = _x(rng, tokens, d, jnp.bfloat16) * (0.001 if fmt == "mxfp4" else 0.01)          # a part clamped
    unroll = 4 if fmt == "mxfp4" else 8                                  # 128-input K steps, as the dispatch
    down_tiles = (dict(block_n=128, unroll=4, num_warps=8) if fmt == "mxfp4" else dict(block_n=64, unroll=8))
    y = jax.jit(lambda x, g, u, w, i, r: moe.moe_ffn(x, g, u, w, i, r, limit, slot_cols=128,
                                                      up_tiles=dict(unroll=unroll, num_warps=8),
                                                      down_tiles=down_tiles))(x, wg, wu, wd, ids, rw)
    got = np.asarray(y, np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[:7] == 0.0)
    ref = _routed_ffn64(x, wg, wu, wd, ids, rw, limit)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3
    flat = jnp.maximum(ids, 0).reshape(-1)
    xs = jnp.repeat(x, top_k, axis=0)
    tiles = dict(slot_cols=128, split_k=1, block_n=64, unroll=unroll)
    mm = jax.jit(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32, **tiles))
    gate, up = jnp.minimum(mm(xs, wg, flat), limit), jnp.clip(mm(xs, wu, flat), -limit, limit)
    h = (gate * jax.nn.sigmoid(gate) * up * rw.reshape(-1)[:, None]).astype(jnp.bfloat16)
    down = jnp.where((ids >= 0).reshape(-1, 1), mm(h, wd, flat), 0.0).reshape(tokens, top_k, -1).sum(axis=1)
    want = np.asarray(down, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3


@pytest.fixture(scope="module")
def routed_prefill_case():
    """16 MXFP4 experts 2048 x 4096 and 6144 routed rows sorted by expert (a shape on which a faulty tiling wrote
    non-finite values, benchmarks/probe_moe_tilings.py), with float32 per-expert reference products."""
    rng = np.random.default_rng(558)
    n_exp, n, k = 16, 2048, 4096
    w = _mxfp4(rng, (n_exp, n, k))
    ids = np.sort(rng.integers(0, n_exp, 6144)).astype(np.int32)
    x = _x(rng, ids.shape[0], k, jnp.bfloat16)
    xf, dense = np.asarray(x.astype(jnp.float32)), np.asarray(w.dequantize(jnp.float32))
    ref = np.concatenate([xf[ids == e] @ dense[e].T for e in range(n_exp)])
    return x, w, jnp.asarray(ids), ref


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_n,step_bytes,warps", [(bn, sb, nw) for bn in (64, 128) for sb in (16, 32, 64, 128)
                                                      for nw in (4, 8)])
def test_moe_tilings_gpu(routed_prefill_case, block_n, step_bytes, warps):
    """The MoE kernel with prefill-wide slots (128 columns) in each tiling: weight rows per tile, packed bytes per
    row per K step (16: one MXFP4 scale block), warps. The tiling that wrote non-finite values is refused."""
    x, w, ids, ref = routed_prefill_case
    fn = functools.partial(moe.moe_matmul, block_n=block_n, unroll=step_bytes // 16, num_warps=warps, slot_cols=128,
                           split_k=1)
    if warps == 8 and step_bytes == 32:
        with pytest.raises(ValueError, match="gave wrong results"):
            fn(x, w, ids)
        return
    y = np.asarray(jax.jit(lambda x, w, i: fn(x, w, i, jnp.float32))(x, w, ids), np.float64)
    assert np.all(np.isfinite(y)), f"{np.sum(~np.isfinite(y))} non-finite outputs"
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("slot_cols", [64, 16])
def test_moe_slot_widths_gpu(routed_prefill_case, slot_cols):
    """Slots narrower than test_moe_tilings_gpu's 128 columns (64: prefill chunks with fewer rows per expert; 16:
    decode's) in a tiling the dispatch picks, against the float32 reference; the row-major output tiles transpose
    a [64, slot_cols] tile. (Before the tiles were stored row-major, both layouts ran here and in the 128-column
    tilings on an H200 on 2026-12-06 and were equal bit for bit.)"""
    x, w, ids, ref = routed_prefill_case
    fn = functools.partial(moe.moe_matmul, block_n=64, unroll=8, num_warps=4, slot_cols=slot_cols, split_k=1)
    y = np.asarray(jax.jit(lambda x, w, i: fn(x, w, i, jnp.float32))(x, w, ids), np.float64)
    assert np.all(np.isfinite(y)), f"{np.sum(~np.isfinite(y))} non-finite outputs"
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("unroll", [1, 2, 4])
def test_decode_short_k_steps_gpu(unroll):
    """Decode kernels with the shorter K steps the dispatch picks when K is not a multiple of 256 (MXFP4 scale
    blocks per step: 1, 2, 4), dense and routed."""
    rng = np.random.default_rng(608)
    n, k = 512, 1024
    w = _mxfp4(rng, (n, k))
    x = _x(rng, 5, k, jnp.bfloat16)
    y = jax.jit(lambda x, w: gemv.mxfp4_matmul(x, w, jnp.float32, unroll=unroll))(x, w)
    _check(y, x.astype(jnp.float32), _dequant64(w), 1e-5)
    we = _mxfp4(rng, (8, n, k))
    ids = jnp.asarray(rng.integers(0, 8, 12), jnp.int32)
    xe = _x(rng, 12, k, jnp.bfloat16)
    ye = np.asarray(jax.jit(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32, unroll=unroll))(xe, we, ids))
    ref = np.einsum("rk,rnk->rn", np.asarray(xe.astype(jnp.float32), np.float64), _dequant64(we)[np.asarray(ids)])
    assert np.all(np.isfinite(ye)) and np.linalg.norm(ye - ref) / np.linalg.norm(ref) < 1e-5
