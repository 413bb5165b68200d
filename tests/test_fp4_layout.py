"""The FP4 GEMV layout (dsv4_jax/ffi/fp4_layout.py): lossless, and the kernel's decode of it (dsv4_jax/ffi/fp4_gemv.cu,
decode_fp4_word_gemv_layout, transcribed here) gives every weight pair the same bf16 bits as decoding the
checkpoint's nibbles directly; on the GPU the kernels on the layout match float64 math."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsv4_jax import ffi
from dsv4_jax.ffi.fp4_layout import GemvLayoutFp4, to_gemv_layout
from dsv4_jax.numerics import Mxfp4Weight, Nvfp4Weight

from tests.test_ffi import HAS_GPU, _dequant64, _f64, _weight

M32 = 0xFFFFFFFF
MASK = 0x81C081C0


def _rotl(w, s):
    return ((w << s) | (w >> (32 - s))) & M32


def _kernel_decode(w):
    """The four bf16 pairs the kernel builds from GEMV-layout words (uint64 arrays holding uint32 values)."""
    return [w & MASK, _rotl(w, 13) & MASK, (((w & 0x003A003A) * 0x4008) & M32) & MASK,
            (((_rotl(w, 26) & 0x05C005C0) * 0x21) & M32) & MASK]


def _bf16_bits(nibble):
    """e2m1 code as the bf16 bits the decode produces (value * 2^-126): magnitude at bits 6-8, sign at 15."""
    return ((nibble & 7) << 6) | ((nibble & 8) << 12)


def test_round_trip_is_lossless_and_changes_the_bytes():
    rng = np.random.default_rng(37)
    w = _weight(rng, "nvfp4", 48, 256, experts=3)
    g = to_gemv_layout(w)
    assert isinstance(g, GemvLayoutFp4) and g.shape == w.shape and g.weight.scale.shape == w.scale.shape
    assert not np.array_equal(np.asarray(g.weight.packed), np.asarray(w.packed))
    assert not np.array_equal(np.asarray(g.weight.scale, np.float32), np.asarray(w.scale, np.float32))
    back = g.to_checkpoint_layout()
    assert np.array_equal(np.asarray(back.packed), np.asarray(w.packed))
    assert np.array_equal(np.asarray(back.scale, np.float32), np.asarray(w.scale, np.float32))
    np.testing.assert_array_equal(np.asarray(g.dequantize()), np.asarray(w.dequantize()))


@pytest.mark.parametrize("fmt,block", [("mxfp4", 32), ("nvfp4", 16)])
def test_layout_scales_sit_where_the_kernel_reads_them(fmt, block):
    """Fp4Layout::tile_scales of fp4_gemv.cu, transcribed: the bytes of rows g and g + 8 (16-row tile T) for the 32
    inputs at k0 start at T * 16 * K/B + step * 2048/B + g * 256/B + q * 64/B, row g's 32/B bytes first."""
    rng = np.random.default_rng(53)
    n, k = 48, 512
    w = _weight(rng, fmt, n, k, experts=2)
    laid = np.asarray(to_gemv_layout(w).weight.scale, np.float32)[1].reshape(-1)
    orig = np.asarray(w.scale, np.float32)[1]
    per = 32 // block
    for row in range(n):
        tile, g = row // 16, row % 8
        for k0 in range(0, k, 32):
            at = tile * 16 * (k // block) + k0 // 128 * (2048 // block) + g * (256 // block) + k0 // 32 % 4 * (64 // block)
            at += 0 if row % 16 < 8 else per
            np.testing.assert_array_equal(laid[at:at + per], orig[row, k0 // block:k0 // block + per])


def test_layout_needs_whole_tiles_and_steps():
    rng = np.random.default_rng(68)
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        to_gemv_layout(_weight(rng, "mxfp4", 24, 256))


def test_kernel_decode_of_the_layout_equals_the_direct_decode():
    rng = np.random.default_rng(74)
    # random words, plus every code of every weight position with the other seven random
    words = [rng.integers(0, 2**32, 200_000, dtype=np.uint64)]
    for j in range(8):
        base = rng.integers(0, 2**32, 16, dtype=np.uint64) & ~np.uint64(0xF << (4 * j))
        words.append(base | (np.arange(16, dtype=np.uint64) << np.uint64(4 * j)))
    words = np.concatenate(words)
    words = np.concatenate([words, rng.integers(0, 2**32, -len(words) % 256, dtype=np.uint64)])   # 16 rows, K % 128
    packed = jnp.asarray(words.astype(np.uint32).view(np.uint8).reshape(16, -1))      # little-endian bytes
    w = Mxfp4Weight(packed, jnp.zeros((16, packed.shape[1] * 2 // 32), jnp.uint8))
    permuted = np.asarray(to_gemv_layout(w).weight.packed).reshape(-1).view(np.uint32).astype(np.uint64)
    decoded = _kernel_decode(permuted)
    for p in range(4):
        lo = (words >> np.uint64(8 * p)) & np.uint64(0xF)                            # weight 2p (checkpoint order)
        hi = (words >> np.uint64(8 * p + 4)) & np.uint64(0xF)                        # weight 2p + 1
        np.testing.assert_array_equal(decoded[p], _bf16_bits(lo) | (_bf16_bits(hi) << np.uint64(16)))


def test_gemv_rejects_what_it_cannot_read():
    with pytest.raises(TypeError, match="MXFP4 / NVFP4"):
        to_gemv_layout(jnp.ones((16, 128), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("n,k,m,dtype,schedule", [
    (2048, 4096, 1, jnp.bfloat16, 0), (1024, 7168, 8, jnp.bfloat16, 0), (512, 2048, 3, jnp.float32, 0),
    (2080, 1536, 5, jnp.bfloat16, 814), (1024, 1408, 4, jnp.bfloat16, 43811), (512, 7168, 2, jnp.bfloat16, 83411),
    (2048, 4096, 1, jnp.bfloat16, 4811), (1040, 7168, 8, jnp.bfloat16, 4811), (32768, 512, 4, jnp.float32, 4811),
    (8192, 4096, 3, jnp.bfloat16, 24811), (4096, 1408, 5, jnp.bfloat16, 4411), (2048, 4096, 8, jnp.bfloat16, 24011),
    (1040, 7168, 3, jnp.float32, 4011)])
def test_gemv_layout_gpu(fmt, n, k, m, dtype, schedule):
    rng = np.random.default_rng(107)
    w = _weight(rng, fmt, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = np.asarray(jax.jit(lambda x, w: ffi.gemv(x, w, jnp.float32, schedule=schedule))(x, to_gemv_layout(w)),
                   np.float64)
    ref = _f64(x) @ _dequant64(w).T
    assert y.shape == (m, n) and np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < (2e-5 if dtype == jnp.float32 else 1e-5)
    assert np.max(np.abs(y - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("schedule", [0, 811, 4811, 24011])
def test_moe_gemv_layout_gpu(fmt, schedule):
    rng = np.random.default_rng(123)
    w = _weight(rng, fmt, 256, 512, experts=16)
    ids = jnp.asarray(rng.integers(0, 16, 40), jnp.int32)
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x, w, i: ffi.moe_gemv(x, w, i, jnp.float32, schedule=schedule))(
        x, to_gemv_layout(w), ids), np.float64)
    ref = np.einsum("rk,rnk->rn", _f64(x), _dequant64(w)[np.asarray(ids)])
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gemv_layout_takes_only_its_schedules_gpu():
    rng = np.random.default_rng(136)
    w = to_gemv_layout(_weight(rng, "mxfp4", 64, 256))
    with pytest.raises(Exception, match="unknown schedule 821"):
        jax.block_until_ready(ffi.gemv(jnp.ones((2, 256), jnp.bfloat16), w, schedule=821))
