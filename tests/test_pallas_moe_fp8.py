"""The W4A8 routed-expert GEMM (dsv4_jax/pallas_kernels/moe_fp8.py) against float64 products from the formats'
definitions: e2m1 nibbles (low first) times 2^(E8M0 byte - 127) per 32 inputs; e4m3 activations times their
power-of-two scale per 128 inputs.

CPU: the in-kernel e2m1 -> e4m3 conversion for every code and shift, the kernel in interpret mode (rows in any
order, experts spanning several slots, unused experts, rows that are not real), and its CUDA lowering at Flash
geometry for an abstract H200. GPU (`-m gpu`): the compiled kernel at Flash geometry, where the FP8 wgmma's
accumulator (about 14 significant bits per 128-input block) sets the tolerance."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax.numerics.formats import Mxfp4Weight
from dsv4_jax.pallas_kernels import moe_fp8

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _weight(rng, shape, low=118, high=131):
    *lead, n, k = shape
    return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (*lead, n, k // 2)), jnp.uint8),
                       jnp.asarray(rng.integers(low, high, (*lead, n, k // 32)), jnp.uint8))


def _dense64(w: Mxfp4Weight) -> np.ndarray:
    packed = np.asarray(w.packed)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    scale = 2.0 ** (np.asarray(w.scale).astype(np.float64) - 127)
    return E2M1[codes] * np.repeat(scale, 32, axis=-1)


def _activation(rng, rows, k):
    """e4m3 values (over their whole range, some zero) and power-of-two scales per 128 inputs, as quantize_fp8."""
    xq = jnp.asarray(np.clip(rng.standard_normal((rows, k)) * 100, -448, 448), jnp.float32).astype(
        jnp.float8_e4m3fn)
    sx = jnp.asarray(2.0 ** rng.integers(-12, -4, (rows, k // 128)), jnp.float32)
    return xq, sx


def _x64(xq, sx) -> np.ndarray:
    return np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(sx, np.float64), 128, axis=-1)


def _reference(xq, sx, w, ids, real=None) -> np.ndarray:
    x, dense, ids = _x64(xq, sx), _dense64(w), np.asarray(ids)
    y = np.einsum("rk,rnk->rn", x, dense[ids])
    return y if real is None else np.where(np.asarray(real)[:, None], y, 0.0)


def _rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "non-finite output (an unwritten or poisoned row)"
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def test_e4m3_operand_every_code_and_shift():
    """The tables' float32 bits of e2m1 x 2^d, then rounded to e4m3, for every code and every shift they use."""
    codes = np.arange(16, dtype=np.int32)
    for shift in range(moe_fp8.MIN_SHIFT, 7):
        bits = np.asarray(moe_fp8.e4m3_operand_bits(jnp.asarray(codes), jnp.int32(shift)))
        got = bits.view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(got, E2M1 * 2.0 ** shift)          # exact in float32, signed zeros too
        np.testing.assert_array_equal(np.signbit(got), np.signbit(E2M1))
        e4m3 = got.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        if shift >= -8:       # every nonzero e2m1 x 2^d >= 2^-9: e4m3 holds it exactly
            np.testing.assert_array_equal(e4m3, E2M1 * 2.0 ** shift)


def _e4m3_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)


def test_magnitude_tables_and_block_scale():
    """The per-32-block tables: byte i of the words is e4m3(|e2m1 code i| x 2^(e - r + 6)) (shift clipped at
    MIN_SHIFT); the block's weight scale 2^(r - 133), clipped at 2^-126."""
    rng = np.random.default_rng(0)
    e = rng.integers(0, 255, (64, 4)).astype(np.uint8)
    e[0] = [127, 127, 127, 127]
    e[1] = [3, 250, 0, 5]                                                # shifts below MIN_SHIFT clip
    e[2] = [120, 100, 105, 110]                                          # subnormal and zero table entries
    lo, hi, scale = (np.asarray(a) for a in moe_fp8._block_tables(jnp.asarray(e), *moe_fp8.shift_tables()))
    r = e.astype(np.int64).max(axis=1)
    shift = np.maximum(e - r[:, None] + 6, moe_fp8.MIN_SHIFT)
    for code in range(8):
        word = lo if code < 4 else hi
        got = (word >> (8 * (code % 4))) & 0xFF
        np.testing.assert_array_equal(got, _e4m3_bytes(E2M1[code] * 2.0 ** shift))
    np.testing.assert_array_equal(scale.astype(np.float64), 2.0 ** (np.maximum(r - 6, 1) - 127.0))


def _tables_np(shift):
    words = [np.zeros(np.shape(shift), np.uint32) for _ in range(2)]
    for code in range(8):
        words[code // 4] |= _e4m3_bytes(E2M1[code] * 2.0 ** np.asarray(shift)) << (8 * (code % 4))
    return words


def test_decode_ptx_every_byte():
    """The PTX's constants, run instruction by instruction (decode_ptx_np), for every packed byte in each of the
    four positions of its register and tables of several shifts: the low and high nibbles' e4m3 bytes are
    e4m3(e2m1 value x 2^shift), signs and negative zero included; the jnp emulation (interpret mode) agrees."""
    byte = np.arange(256, dtype=np.uint32)
    for shift in (6, 0, -5, -9, -12, moe_fp8.MIN_SHIFT):
        table_lo, table_hi = _tables_np(shift)
        for position in range(4):
            word = (byte << (8 * position)) | np.uint32(0x5AC3E17F & ~(0xFF << (8 * position)))   # other bytes
            lo, hi = moe_fp8.decode_ptx_np(word, table_lo, table_hi)
            got_lo, got_hi = (lo >> (8 * position)) & 0xFF, (hi >> (8 * position)) & 0xFF
            for got, codes in ((got_lo, byte & 15), (got_hi, byte >> 4)):
                want = _e4m3_bytes(np.abs(E2M1[codes]) * 2.0 ** shift) | ((codes & 8) << 4)
                np.testing.assert_array_equal(got, want)
        emulated = moe_fp8._decode_emulated(jnp.asarray(byte, jnp.uint8), jnp.uint32(table_lo), jnp.uint32(table_hi))
        for got, codes in zip(emulated, (byte & 15, byte >> 4)):
            want = _e4m3_bytes(np.abs(E2M1[codes]) * 2.0 ** shift) | ((codes & 8) << 4)
            np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)), want)


def _case(rng, rows=150, n_exp=6, n=256, k=512):
    xq, sx = _activation(rng, rows, k)
    w = _weight(rng, (n_exp, n, k))
    ids = rng.integers(0, n_exp - 1, rows).astype(np.int32)    # expert n_exp - 1 unused
    ids[:80] = 2                                               # one expert over two 64-row slots
    rng.shuffle(ids)
    return xq, sx, w, jnp.asarray(ids)


@pytest.fixture(scope="module")
def case():
    return _case(np.random.default_rng(1))


def _run(xq, sx, w, ids, real=None, **kw):
    return jax.jit(lambda *a: moe_fp8.moe_fp8_matmul(*a, real, interpret=True, **kw))(xq, sx, w, ids)


def test_interpret_matches_float64(case):
    """Scale exponents within a 128-block differ by at most 12 here: the e4m3 operand is exact, so the only
    difference from float64 is float32 accumulation."""
    xq, sx, w, ids = case
    ref = _reference(xq, sx, w, ids)
    assert _rel_err(_run(xq, sx, w, ids), ref) < 1e-6
    # a weight byte of an expert in use changed must show (the comparison can fail)
    mutated = Mxfp4Weight(w.packed.at[2, 5, 7].set(w.packed[2, 5, 7] ^ 0x77), w.scale)
    assert _rel_err(_run(xq, sx, mutated, ids), ref) > 1e-6


@pytest.mark.parametrize("operand", ["a", "b"])
def test_interpret_tiles(case, operand):
    """Other tile shapes (128-row slots, 128 weight rows per program) with the weight as either wgmma operand."""
    xq, sx, w, ids = case
    ref = _reference(xq, sx, w, ids)
    assert _rel_err(_run(xq, sx, w, ids, block_m=128, block_n=128, weight_operand=operand), ref) < 1e-6


def test_rows_not_real_give_zeros(case):
    """Rows that are not real are zeros, and the real ones are unchanged (their experts' slots shrink)."""
    xq, sx, w, ids = case
    real = jnp.asarray(np.random.default_rng(2).random(ids.shape[0]) < 0.6)
    y = np.asarray(_run(xq, sx, w, ids, real))
    assert np.all(y[~np.asarray(real)] == 0)
    assert _rel_err(y, _reference(xq, sx, w, ids, real)) < 1e-6


def test_wide_exponent_spread_rounds_as_documented():
    """A 32-block more than 14 exponents below its 128-block's largest rounds to e4m3 (subnormals or zero): the
    kernel equals the operand the docstring defines, which differs from the exact product only there."""
    rng = np.random.default_rng(3)
    xq, sx = _activation(rng, 40, 256)
    w = _weight(rng, (2, 128, 256), low=100, high=140)
    ids = jnp.asarray(rng.integers(0, 2, 40), jnp.int32)
    packed, scale = np.asarray(w.packed), np.asarray(w.scale).astype(np.int64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(2, 128, 256)
    e = scale.reshape(2, 128, 2, 4)
    r = e.max(axis=-1, keepdims=True)
    shifts = np.maximum(e - r + 6, moe_fp8.MIN_SHIFT).reshape(2, 128, 8)
    operand = (E2M1[codes] * 2.0 ** np.repeat(shifts, 32, axis=-1)).astype(np.float32)
    operand = operand.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    dense = operand * np.repeat(2.0 ** (np.maximum(r[..., 0] - 6, 1) - 127.0), 128, axis=-1)
    ref = np.einsum("rk,rnk->rn", _x64(xq, sx), dense[np.asarray(ids)])
    assert _rel_err(_run(xq, sx, w, ids), ref) < 1e-6
    assert not np.array_equal(dense, _dense64(w))                        # the case does reach the rounding


def test_bad_input_is_refused(case):
    xq, sx, w, ids = case
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_fp8.moe_fp8_matmul(xq.astype(jnp.bfloat16), sx, w, ids)
    with pytest.raises(ValueError, match="multiple of block_n"):
        moe_fp8.moe_fp8_matmul(xq, sx, w, ids, block_n=96)
    with pytest.raises(ValueError, match="weight_operand must be 'a' or 'b'"):
        moe_fp8.moe_fp8_matmul(xq, sx, w, ids, weight_operand="c")
    with pytest.raises(TypeError, match="Mxfp4Weight"):
        moe_fp8.moe_fp8_matmul(xq, sx, w.dequantize(jnp.float32), ids)


def _lower_for_h200(f, *args):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("operand", ["a", "b"])
def test_cuda_lowering_flash_geometry(operand):
    """Flash's routed experts (256 x 2048 x 4096 gate / up, 256 x 4096 x 2048 down) for a 2,048-token chunk."""
    sds = jax.ShapeDtypeStruct
    rows = 2048 * 6
    for n, k in ((2048, 4096), (4096, 2048)):
        w = Mxfp4Weight(sds((256, n, k // 2), jnp.uint8), sds((256, n, k // 32), jnp.uint8))
        fn = functools.partial(moe_fp8.moe_fp8_matmul, weight_operand=operand)
        text = _lower_for_h200(fn, sds((rows, k), jnp.float8_e4m3fn), sds((rows, k // 128), jnp.float32), w,
                               sds((rows,), jnp.int32))
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_flash_geometry_gpu():
    """256 experts 2048 x 4096, an 8,192-row chunk's routing: the FP8 wgmma keeps ~14 bits per 128-input block."""
    rng = np.random.default_rng(229)
    xq, sx = _activation(rng, 8192, 4096)
    w = _weight(rng, (256, 2048, 4096))
    ids = jnp.asarray(rng.integers(0, 256, 8192), jnp.int32)
    real = jnp.asarray(rng.random(8192) < 0.95)
    sample = np.flatnonzero(np.asarray(real))[::64]                      # float64 for 1 row in 64
    x = _x64(xq[sample], sx[sample])
    dense = _dense64(Mxfp4Weight(w.packed[np.asarray(ids)[sample]], w.scale[np.asarray(ids)[sample]]))
    ref = np.einsum("rk,rnk->rn", x, dense)
    for operand in ("a", "b"):
        y = jax.jit(lambda *a: moe_fp8.moe_fp8_matmul(*a, real, weight_operand=operand))(xq, sx, w, ids)
        y = np.asarray(y, np.float64)
        assert np.all(y[~np.asarray(real)] == 0)
        assert _rel_err(y[sample], ref) < 2e-3, operand
