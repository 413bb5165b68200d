"""Weight formats (docs/model.md 6.2, 7): decoding, packing order, the NVFP4 quantization recipe, the lossless
MXFP4 -> NVFP4 cast, every format's matmul against float64 math, and the stored byte totals of Flash.

The numpy references here are written from the spec (and, for the details the spec leaves open, from NVIDIA
ModelOpt's NVFP4QTensor: the 2^-9 lower clamp of block scales and the sign bit of values that round to zero) and
run in float32 where the recipe is float32 arithmetic, so quantized bytes can be compared bit for bit.
"""

from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ckpt_writer as cw
from dsv4_jax import presets
from dsv4_jax.params import disk_tensor_specs, init_params, nvidia_formats
from dsv4_jax.numerics import (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, dequantize, mxfp4_to_nvfp4,
                               mxfp4_to_nvfp4_is_exact, quantize_nvfp4)
from dsv4_jax.ops import group_linear, grouped_linear, linear
from dsv4_jax.numerics.fake_quant import correctly_rounded_divide, round_to_e2m1, round_to_e4m3
from dsv4_jax.numerics.formats import e8m0_to_float, unpack_fp4_codes
from dsv4_jax.numerics.nvfp4 import pack_fp4_codes, quantize_blocks
from dsv4_jax.run_context import RunContext

REFERENCE = RunContext.create(kernels="reference")

F32 = np.float32
deq = jax.jit(dequantize)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)

# ---------------------------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------------------------


def e2m1_codes_np(y: np.ndarray) -> np.ndarray:
    """Spec 7.2 step 3: nearest e2m1 magnitude, ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) to the even code, > 6
    saturates; sign bit iff y < 0 (so -0.0 -> code 0, -0.1 -> code 8)."""
    a = np.abs(y)
    code = np.searchsorted(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]), a, side="left")   # ties: lower code
    code = code + np.isin(a, (0.75, 1.75, 3.5))                          # ... unless the upper code is the even one
    return (code | ((y < 0).astype(np.int64) << 3)).astype(np.uint8)


def pack_np(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_np(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0xF, packed >> 4
    return out


def nvfp4_blocks_np(x: np.ndarray, gs: np.ndarray):
    """Spec 7.2 steps 2-3 in float32: x [..., K], gs broadcastable to [..., 1] -> (codes [..., K], e4m3 [..., K/16])."""
    xb = x.astype(F32).reshape(x.shape[:-1] + (-1, 16))
    gs = np.asarray(gs, F32)
    ratio = np.abs(xb).max(-1) / (F32(6) * gs)
    ratio = np.where(ratio == 0, F32(1), ratio)
    scale = np.clip(ratio, F32(2.0 ** -9), F32(448)).astype(ml_dtypes.float8_e4m3fn)
    y = xb / (scale.astype(F32) * gs)[..., None]
    return e2m1_codes_np(y).reshape(x.shape), scale


def nvfp4_weight_np(w: np.ndarray):
    """Standard NVFP4 weight quantization of [..., out, in]: (packed, e4m3 scales, global scale [...] float32)."""
    gs = np.abs(w.astype(F32)).max(axis=(-2, -1)) / F32(6 * 448)
    codes, scale = nvfp4_blocks_np(w, gs[..., None, None])
    return pack_np(codes), scale, gs.astype(F32)


def dequant_nvfp4_np(packed, scale, gs) -> np.ndarray:
    values = E2M1[unpack_np(packed)] * np.repeat(scale.astype(np.float64), 16, axis=-1)
    return values * np.asarray(gs, np.float64)[..., None, None]


def fp8_weight_np(w: np.ndarray):
    """ckpt_writer's FP8 128x128 quantizer per matrix of a [..., out, in] stack."""
    parts = [cw.quantize_fp8_block(m) for m in w.reshape((-1,) + w.shape[-2:])]
    q, s, deq = (np.stack(p).reshape(w.shape[:-2] + p[0].shape) for p in zip(*parts))
    return Fp8BlockWeight(jnp.asarray(q), jnp.asarray(s)), deq


def mxfp4_weight_np(w: np.ndarray):
    parts = [cw.quantize_mxfp4(m) for m in w.reshape((-1,) + w.shape[-2:])]
    packed, s, deq = (np.stack(p).reshape(w.shape[:-2] + p[0].shape) for p in zip(*parts))
    return Mxfp4Weight(jnp.asarray(packed), jnp.asarray(s)), deq


def make_weight(fmt: str, shape, rng):
    """(stored weight in `fmt`, its float64 value)."""
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-1, 1, shape[:-1] + (1,))) / math.sqrt(shape[-1])
    if fmt == "bf16":
        q = w.astype(ml_dtypes.bfloat16)
        return jnp.asarray(q), q.astype(np.float64)
    if fmt == "fp8":
        return fp8_weight_np(w)
    if fmt == "mxfp4":
        return mxfp4_weight_np(w)
    packed, scale, gs = nvfp4_weight_np(w)
    return (Nvfp4Weight(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(gs)),
            dequant_nvfp4_np(packed, scale, gs))


def fp8_act_np(x: np.ndarray, block: int = 128) -> np.ndarray:
    """Spec 3.3 FP8 activation quantization (blocks along the last axis, a trailing partial block on its own):
    amax floored at 1e-4, scale 2^ceil(log2(amax/448)) exactly, q = e4m3(clip(x/s)). Returns q*s float64."""
    k = x.shape[-1]
    pad = -k % block
    xp = np.concatenate([x.astype(F32), np.zeros(x.shape[:-1] + (pad,), F32)], -1).reshape(x.shape[:-1] + (-1, block))
    ratio = np.maximum(np.abs(xp).max(-1), F32(1e-4)) / F32(448)
    mant, exp = np.frexp(ratio)
    s = np.ldexp(F32(1), np.where(mant == 0.5, exp - 1, exp)).astype(F32)[..., None]
    q = np.clip(xp / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float64) * s).reshape(x.shape[:-1] + (-1,))[..., :k]


def nvfp4_act_np(x: np.ndarray):
    """Spec 7.2 activation path with the runtime per-row global scale gsa = amax(row) / (6 * 448):
    returns (e2m1 x block scale as float64 [..., K], gsa float32 [..., 1])."""
    gsa = (np.abs(x.astype(F32)).max(-1, keepdims=True) / F32(6 * 448)).astype(F32)
    codes, scale = nvfp4_blocks_np(x, gsa)
    values = E2M1[codes].reshape(x.shape[:-1] + (-1, 16)) * scale.astype(np.float64)[..., None]
    return values.reshape(x.shape), gsa


def act_np(x: np.ndarray, fmt: str, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The activation a `fmt` weight meets under `mode` (ops/matmul.py's table): (values, row factor)."""
    one = np.ones(x.shape[:-1] + (1,))
    if mode == "none" or fmt == "bf16":
        return x.astype(np.float64), one
    if mode == "fp8" or fmt == "fp8":
        return fp8_act_np(x), one
    values, gsa = nvfp4_act_np(x)
    return values, gsa.astype(np.float64)


def global_np(weight) -> np.ndarray | float:
    return np.asarray(weight.global_scale, np.float64) if isinstance(weight, Nvfp4Weight) else 1.0


# ---------------------------------------------------------------------------------------------------------------
# decoding and packing
# ---------------------------------------------------------------------------------------------------------------

def test_fp4_nibble_order_and_values_bit_exact():
    rng = np.random.default_rng(11)
    every_byte = np.arange(256, dtype=np.uint8)
    packed = np.concatenate([every_byte, rng.integers(0, 256, 256 * 3 - 256, dtype=np.uint8)]).reshape(3, 256)
    codes = unpack_np(packed)
    np.testing.assert_array_equal(np.asarray(unpack_fp4_codes(jnp.asarray(packed))), codes)
    np.testing.assert_array_equal(np.asarray(pack_fp4_codes(jnp.asarray(codes))), packed)
    # element 2k is the low nibble: byte 0x71 holds [1 -> 0.5, 7 -> 6]
    assert list(E2M1[unpack_np(np.array([0x71], np.uint8))]) == [0.5, 6.0]
    # MXFP4 with scale byte 127 (2^0) dequantizes to the table values themselves, signs included (-0.0 too)
    got = np.asarray(deq(Mxfp4Weight(jnp.asarray(packed), jnp.full((3, 16), 127, jnp.uint8))))
    np.testing.assert_array_equal(got.view(np.uint32), E2M1[codes].astype(F32).view(np.uint32))


def test_e8m0_scales_decode_as_exponent_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = np.asarray(e8m0_to_float(jnp.asarray(b)))
    want = np.ldexp(1.0, b[1:255].astype(np.int64) - 127).astype(F32)
    np.testing.assert_array_equal(got[1:255], want)       # 2^-126 .. 2^127, exact
    assert np.isnan(got[255]), "0xFF must decode as NaN"
    assert got[0] in (0.0, 2.0 ** -127)                   # a subnormal that XLA may flush


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_dequantize_matches_numpy_bit_exact(fmt):
    """Stacked [E, out, in] with out not a multiple of 128 (FP8 partial row block). Each dequantized value is one
    float32 rounding of the float64 product (exact for FP8 / MXFP4)."""
    weight, want = make_weight(fmt, (3, 200, 256), np.random.default_rng(12))
    got = np.asarray(deq(weight))
    np.testing.assert_array_equal(got, want.astype(F32))
    assert weight.shape == (3, 200, 256)


def test_float_rounding_and_division_helpers_are_exact():
    """The arithmetic roundings equal ml_dtypes' e4m3 / e2m1 casts (RNE, signs, subnormals, saturation) and
    correctly_rounded_divide equals the float64 quotient rounded once to float32 (exact for division)."""
    rng = np.random.default_rng(13)
    y = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 3, 20000),
                        np.arange(-1024, 1025) / 64.0, np.arange(-8192, 8193) * 2.0 ** -12, [1e4, -1e4, -0.0]])
    y = y.astype(F32)
    got8, got4 = jax.jit(lambda v: (round_to_e4m3(v), round_to_e2m1(v)))(jnp.asarray(y))
    want8 = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    want4 = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    np.testing.assert_array_equal(np.asarray(got8).view(np.uint32), want8.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(got4).view(np.uint32), want4.view(np.uint32))
    a = (rng.standard_normal(50000) * np.exp(rng.uniform(-30, 30, 50000))).astype(F32)
    b = np.abs(rng.standard_normal(50000) * np.exp(rng.uniform(-30, 30, 50000))).astype(F32)
    a[:3000], b[:3000] = (np.arange(3000) * 7).astype(F32), F32(7)           # exact quotients
    a[3000:6000], b[3000:6000] = np.arange(3000, dtype=F32), F32(2688)
    got = np.asarray(jax.jit(correctly_rounded_divide)(a, b))
    np.testing.assert_array_equal(got, (a.astype(np.float64) / b).astype(F32))


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 quantization recipe
# ---------------------------------------------------------------------------------------------------------------

def _recipe_matrix(rng) -> np.ndarray:
    """[64, 128] float32 exercising the recipe: random rows over 10 decades, and rows built on a power-of-two
    global scale so block scales and scaled values land exactly on e2m1 ties, on e4m3 rounding ties that round
    the block scale down (values then exceed 6 and saturate), on zero, -0.0 and sub-2^-9 blocks."""
    x = rng.standard_normal((64, 128)) * 10.0 ** rng.uniform(-5, 5, (64, 1))
    gs = 2.0 ** -4
    x[0, 0] = 6 * 448 * gs                                  # global amax -> global scale exactly 2^-4
    x[:8, 1:] = 0.0
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.1, 0.3, 0.0, 4.5, 2.75, 1.0, 5.5, 3.0])
    for row in range(1, 8):
        for blk in range(8):
            bs = 2.0 ** rng.integers(-6, 6) * rng.choice([1.0, 1.125, 1.5, 1.875])
            vals = rng.permutation(ties) * rng.choice([-1, 1], 16)
            if blk % 3 == 1:
                vals = vals * 1.0625        # block amax 6.375 bs: ratio 1.0625 bs ties down in e4m3 -> 6.375 > 6
            x[row, blk * 16:(blk + 1) * 16] = vals * bs * gs
    x[1, 0:16] = 0.0                                        # all-zero block -> scale 1.0
    x[2, 16:32] = -0.0
    x[3, 32:48] = 1e-12                                     # ratio below 2^-9 -> clamped
    x[4, 48:52] = [-1e-9, -0.0, 1e-9, 0.0]                  # tiny negatives round to code 8 ("-0")
    return x.astype(F32)


def test_nvfp4_quantization_matches_numpy_recipe_bit_exact():
    rng = np.random.default_rng(21)
    x = _recipe_matrix(rng)
    stacked = np.stack([x, rng.standard_normal((64, 128)).astype(F32) * 1e-3, -x[::-1]])
    for w in (x, stacked, x.astype(ml_dtypes.bfloat16)):
        got = jax.jit(quantize_nvfp4)(jnp.asarray(w))
        packed, scale, gs = nvfp4_weight_np(w)
        np.testing.assert_array_equal(np.asarray(got.global_scale).view(np.uint32), gs.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(got.scale).view(np.uint8), scale.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.packed), packed)
    # The data really exercised ties, saturation, clamped and zero blocks.
    _, scale = nvfp4_blocks_np(x, F32(2.0 ** -4))
    y = x.reshape(64, 8, 16) / (scale.astype(F32) * F32(2.0 ** -4))[..., None]
    for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        assert (np.abs(y) == tie).sum() >= 5, f"no e2m1 tie at {tie} in the test data"
    assert (np.abs(y) > 6).sum() >= 10, "no saturating values in the test data"
    assert (scale.astype(F32) == 2.0 ** -9).any() and (scale.astype(F32)[1, 0] == 1.0)
    codes = unpack_np(np.asarray(jax.jit(quantize_nvfp4)(jnp.asarray(x)).packed))
    assert codes[4, 48] == 8 and codes[4, 49] == 0 and codes[2, 16] == 0, "sign of values that round to zero"


def test_nvfp4_round_trip_error_is_within_half_a_step():
    """quantize -> dequantize moves each element by at most half an e2m1 step (0.25 below 2, 0.5 below 4, 1
    above) in block units, or by the saturation excess (<= 6.375 - 6) when the block scale rounded down."""
    rng = np.random.default_rng(22)
    w = (rng.standard_normal((96, 256)) * np.exp(rng.uniform(-3, 3, (96, 1)))).astype(F32)
    q = jax.jit(quantize_nvfp4)(jnp.asarray(w))
    got = np.asarray(deq(q), np.float64)
    unit = np.repeat(np.asarray(q.scale).astype(np.float64), 16, -1) * float(q.global_scale)
    y = np.abs(w) / unit
    half_step = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0)) * (1 + 1e-6)
    assert np.all(np.abs(got - w) <= half_step * unit), "round trip error above half an e2m1 step"
    np.testing.assert_array_equal(np.asarray(deq(q)), dequant_nvfp4_np(*nvfp4_weight_np(w)).astype(F32))


def test_quantize_blocks_rejects_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_blocks(jnp.ones((2, 40)), jnp.float32(1.0))


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 -> NVFP4 lossless cast (docs/model.md 7.3)
# ---------------------------------------------------------------------------------------------------------------

def test_mxfp4_to_nvfp4_cast_is_lossless_bit_for_bit():
    rng = np.random.default_rng(31)
    # Block magnitudes spread over 2^-15 .. 2^0, so block exponents span up to 17 (the widest the cast holds).
    w = rng.standard_normal((4, 64, 256)) * np.exp2(rng.integers(-15, 1, (4, 64, 8)).repeat(32, -1))
    mx, want = mxfp4_weight_np(w)
    nv = jax.jit(mxfp4_to_nvfp4)(mx)
    k = np.asarray(mx.scale).astype(int).reshape(4, -1)
    assert (k.max(1) - k.min(1)).max() == 17, "test data should reach the widest exact span"
    assert bool(np.all(np.asarray(mxfp4_to_nvfp4_is_exact(mx))))
    np.testing.assert_array_equal(np.asarray(nv.packed), np.asarray(mx.packed))          # nibbles untouched
    np.testing.assert_array_equal(np.asarray(deq(nv)).view(np.uint32),
                                  np.asarray(deq(mx)).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(deq(nv)), want.astype(F32))
    for e in range(4):      # the same bytes as the test-side implementation of docs/model.md 7.3
        _, bs, ws2 = cw.mxfp4_to_nvfp4(np.asarray(mx.packed[e]), np.asarray(mx.scale[e]))
        np.testing.assert_array_equal(np.asarray(nv.scale[e]).view(np.uint8), bs.view(np.uint8))
        assert np.asarray(nv.global_scale[e]) == ws2


def test_mxfp4_to_nvfp4_exactness_check():
    rng = np.random.default_rng(32)
    mx, _ = mxfp4_weight_np(rng.standard_normal((2, 32, 64)))
    scale = np.asarray(mx.scale).copy()
    scale[0, 0, 0] = scale[0].max() - 18                     # a span of 18 exponents: not castable ...
    wide = Mxfp4Weight(mx.packed, jnp.asarray(scale))
    assert list(np.asarray(mxfp4_to_nvfp4_is_exact(wide))) == [False, True]
    packed = np.asarray(mx.packed).copy()
    packed[0, 0, :16] = 0x80                                 # ... unless that block holds only (+-)zeros
    zero_block = Mxfp4Weight(jnp.asarray(packed), jnp.asarray(scale))
    assert list(np.asarray(mxfp4_to_nvfp4_is_exact(zero_block))) == [True, True]
    np.testing.assert_array_equal(np.asarray(deq(mxfp4_to_nvfp4(zero_block))).view(np.uint32),
                                  np.asarray(deq(zero_block)).view(np.uint32))
    scale[1, 3, 1] = 255
    assert not np.asarray(mxfp4_to_nvfp4_is_exact(Mxfp4Weight(mx.packed, jnp.asarray(scale))))[1]


# ---------------------------------------------------------------------------------------------------------------
# matmuls against float64 math, every format x act_quant mode
# ---------------------------------------------------------------------------------------------------------------

M_ROWS, K_IN, N_OUT, GROUPS = 24, 192, 160, 4      # K = 128 + 64: a partial FP8 activation block
GROUP_SIZES = np.array([7, 0, 10, 5], np.int32)    # 22 of 24 rows: the last two belong to no group


@functools.lru_cache(maxsize=None)
def _matmuls(mode: str):
    ctx = RunContext.create(act_quant=mode)

    def run(x, w2d, w3d, wgrp, xg):
        return (linear(x, w2d, jnp.float32, ctx=ctx),
                grouped_linear(x, w3d, jnp.asarray(GROUP_SIZES), jnp.float32, ctx=ctx),
                group_linear(xg, wgrp, jnp.float32, ctx=ctx))
    return jax.jit(run)


def _bound(xv, wv):
    """float32 accumulation of K products: |err| <= K * 2^-24 * sum |x_k w_k| (a worst case ~100x the typical)."""
    return K_IN * 2.0 ** -24 * (np.abs(xv) @ np.abs(wv).swapaxes(-1, -2)) + 1e-30


@pytest.mark.parametrize("mode", ["none", "fp8", "nvfp4"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_matmuls_match_float64_dequantized_math(fmt, mode):
    if mode == "nvfp4" and fmt in ("mxfp4", "nvfp4") and jax.default_backend() != "cpu":
        pytest.skip("XLA GPU divides with div.full (<= 2 ulp): bf16 activations often sit exactly on e2m1 ties")
    rng = np.random.default_rng(zlib.crc32(f"{fmt}-{mode}".encode()))
    x = (rng.standard_normal((M_ROWS, K_IN)) * np.exp(rng.uniform(-2, 2, (M_ROWS, 1)))).astype(ml_dtypes.bfloat16)
    xg = rng.standard_normal((M_ROWS, GROUPS, K_IN)).astype(ml_dtypes.bfloat16)
    w2d, v2d = make_weight(fmt, (N_OUT, K_IN), rng)
    w3d, v3d = make_weight(fmt, (GROUPS, N_OUT, K_IN), rng)
    wgrp, vgrp = make_weight(fmt, (GROUPS * 48, K_IN), rng)
    got = [np.asarray(a) for a in _matmuls(mode)(jnp.asarray(x), w2d, w3d, wgrp, jnp.asarray(xg))]
    x64 = x.astype(np.float64)

    xv, row = act_np(x64, fmt, mode)
    want = (xv @ v2d.T) * row
    np.testing.assert_array_less(np.abs(got[0] - want), _bound(xv, v2d) * row, err_msg=f"linear {fmt} {mode}")

    group_of = np.repeat(np.arange(GROUPS), GROUP_SIZES)
    valid = len(group_of)
    want = np.einsum("mk,mnk->mn", xv[:valid], v3d[group_of]) * row[:valid]
    bound = np.einsum("mk,mnk->mn", np.abs(xv[:valid]), np.abs(v3d[group_of])) * K_IN * 2.0 ** -24 * row[:valid]
    np.testing.assert_array_less(np.abs(got[1][:valid] - want), bound + 1e-30, err_msg=f"grouped {fmt} {mode}")
    np.testing.assert_array_equal(got[1][valid:], 0.0, err_msg="rows past the groups must be zero")

    xv, row = act_np(xg.astype(np.float64), fmt, mode)
    vg = vgrp.reshape(GROUPS, 48, K_IN)
    want = np.einsum("mgk,grk->mgr", xv, vg) * row
    bound = np.einsum("mgk,grk->mgr", np.abs(xv), np.abs(vg)) * K_IN * 2.0 ** -24 * row
    np.testing.assert_array_less(np.abs(got[2] - want), bound + 1e-30, err_msg=f"group_linear {fmt} {mode}")


@pytest.mark.parametrize("mode", ["none", "fp8", "nvfp4"])
def test_mxfp4_and_its_nvfp4_cast_give_identical_matmuls(mode):
    """The cast moves a power of two from the block scales into the global scale; every GEMM operand stays
    exact, so the float32 results agree bit for bit in every activation mode."""
    rng = np.random.default_rng(41)
    x = jnp.asarray(rng.standard_normal((M_ROWS, K_IN)), jnp.bfloat16)
    xg = jnp.asarray(rng.standard_normal((M_ROWS, GROUPS, K_IN)), jnp.bfloat16)
    mx = [mxfp4_weight_np(rng.standard_normal(s) * 0.05)[0] for s in
          ((N_OUT, K_IN), (GROUPS, N_OUT, K_IN), (GROUPS * 48, K_IN))]
    nv = [mxfp4_to_nvfp4(w) for w in mx]
    assert all(float(np.max(np.asarray(w.global_scale))) != 1.0 for w in nv)
    for a, b in zip(_matmuls(mode)(x, *mx, xg), _matmuls(mode)(x, *nv, xg)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_rows_do_not_influence_each_other(mode):
    """Activation quantization is per row: a poisoned row (huge values, a NaN) changes only its own output, and
    the NaN shows in that row's output (e2m1 has no NaN code, so the row's global scale carries it)."""
    rng = np.random.default_rng(42)
    x = rng.standard_normal((M_ROWS, K_IN)).astype(ml_dtypes.bfloat16)
    xg = rng.standard_normal((M_ROWS, GROUPS, K_IN)).astype(ml_dtypes.bfloat16)
    weights = [make_weight(mode, s, rng)[0] for s in ((N_OUT, K_IN), (GROUPS, N_OUT, K_IN), (GROUPS * 48, K_IN))]
    px, pxg = x.copy(), xg.copy()
    px[3], pxg[3] = 1e30, 1e30
    px[5, 7] = pxg[5, 1, 7] = np.nan
    clean = _matmuls(mode)(jnp.asarray(x), *weights, jnp.asarray(xg))
    dirty = _matmuls(mode)(jnp.asarray(px), *weights, jnp.asarray(pxg))
    keep = np.setdiff1d(np.arange(22), [3, 5])
    for c, d, what in zip(clean, dirty, ("linear", "grouped_linear", "group_linear")):
        np.testing.assert_array_equal(np.asarray(d)[keep], np.asarray(c)[keep], err_msg=what)
        assert np.isnan(np.asarray(d)[5] if what != "group_linear" else np.asarray(d)[5, 1]).all(), what


def test_default_output_dtype_and_errors():
    rng = np.random.default_rng(43)
    w, _ = make_weight("nvfp4", (32, 64), rng)
    x = jnp.ones((3, 64), jnp.bfloat16)
    assert linear(x, w, ctx=REFERENCE).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"act_quant must be one of \('none', 'fp8', 'nvfp4'\), got 'int8'"):
        linear(x, w, ctx=RunContext.create(act_quant="int8"))
    with pytest.raises(ValueError, match=r"linear: input has 32 features but the weight \[32, 64\] expects 64"):
        linear(jnp.ones((3, 32)), w, ctx=REFERENCE)
    with pytest.raises(TypeError, match="linear weight must be a jax/numpy array, Fp8BlockWeight, Mxfp4Weight or "
                                        "Nvfp4Weight, got dict"):
        linear(x, {"weight": w}, ctx=REFERENCE)
    with pytest.raises(ValueError, match="group_linear: 32 weight rows do not split into 3 groups"):
        group_linear(jnp.ones((2, 3, 64)), w, ctx=REFERENCE)


def test_quantized_matmuls_have_no_host_transfers():
    rng = np.random.default_rng(44)
    x = jax.device_put(rng.standard_normal((M_ROWS, K_IN)).astype(ml_dtypes.bfloat16))
    xg = jax.device_put(rng.standard_normal((M_ROWS, GROUPS, K_IN)).astype(ml_dtypes.bfloat16))
    weights = jax.device_put([make_weight("nvfp4", s, rng)[0]
                              for s in ((N_OUT, K_IN), (GROUPS, N_OUT, K_IN), (GROUPS * 48, K_IN))])
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(_matmuls("nvfp4")(x, *weights, xg))


# ---------------------------------------------------------------------------------------------------------------
# device bytes = checkpoint bytes
# ---------------------------------------------------------------------------------------------------------------

_DISK_ITEMSIZE = {"BF16": 2, "F32": 4, "I64": 8, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}


def _tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _disk_bytes(cfg, stored=None) -> int:
    return sum(_DISK_ITEMSIZE[d[0]] * math.prod(s) for d, s in disk_tensor_specs(cfg, stored).values())


def _to_nvfp4_like_nvidia(tree):
    """Backbone experts MXFP4 -> NVFP4 with an input_scale per matrix (the NVIDIA layout); MTP stays MXFP4."""
    def convert(layer):
        for proj in ("w1", "w2", "w3"):
            slot = layer["ffn"]["experts"][proj]
            nv = mxfp4_to_nvfp4(slot["weight"])
            slot["weight"] = Nvfp4Weight(nv.packed, nv.scale, nv.global_scale, jnp.zeros_like(nv.global_scale))
    for layer in tree["layers"]:
        convert(layer)
    return tree


def test_flash_device_bytes_equal_checkpoint_bytes():
    """The published Flash size, '148.7 GB' on Hugging Face, is 148.65 GiB = 159.6e9 bytes (docs/model.md 6.3)."""
    cfg = presets.flash()
    init = functools.partial(init_params, cfg)
    mxfp4 = _tree_bytes(jax.eval_shape(init, jax.random.PRNGKey(0)))
    tid2eid_narrowing = cfg.n_hash_layers * cfg.vocab_size * cfg.n_activated_experts * 4     # I64 -> int32
    assert mxfp4 == _disk_bytes(cfg) - tid2eid_narrowing
    assert abs(mxfp4 / 2 ** 30 - 148.7) / 148.7 < 0.01, f"Flash MXFP4 tree: {mxfp4 / 2 ** 30:.2f} GiB"
    nvfp4 = _tree_bytes(jax.eval_shape(lambda k: _to_nvfp4_like_nvidia(init(k)), jax.random.PRNGKey(0)))
    assert nvfp4 == _disk_bytes(cfg, nvidia_formats(cfg)) - tid2eid_narrowing
    described = _tree_bytes(jax.eval_shape(functools.partial(init_params, cfg, stored=nvidia_formats(cfg)),
                                           jax.random.PRNGKey(0)))
    assert described == nvfp4, "the description with NVIDIA's stored formats sizes the converted tree"
    # docs/model.md 6.6
    assert abs(nvfp4 / 2 ** 30 - 156.7) / 156.7 < 0.01, f"Flash NVFP4 tree: {nvfp4 / 2 ** 30:.2f} GiB"
    head = jax.eval_shape(quantize_nvfp4, jax.ShapeDtypeStruct((cfg.vocab_size, cfg.dim), jnp.bfloat16))
    assert _tree_bytes(head) == cfg.vocab_size * cfg.dim * (1 / 2 + 1 / 16) + 4
    print(f"Flash: MXFP4 {mxfp4 / 2 ** 30:.2f} GiB, NVFP4 experts {nvfp4 / 2 ** 30:.2f} GiB, "
          f"NVFP4 head saves {(2 * cfg.vocab_size * cfg.dim - _tree_bytes(head)) / 2 ** 30:.2f} GiB")
