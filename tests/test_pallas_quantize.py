"""Pallas activation-quantization kernels (dsv4_jax/pallas_kernels/quantize.py) against the pure-jnp references of
dsv4_jax/numerics/activations.py, bit for bit.

CPU (CI): the kernels in interpret mode on fresh random inputs (the seed is in each failure message), every output
preloaded with poison through input/output aliasing (twice, two poisons, so an unwritten element cannot match by
chance), many-block grids with the row maximum in the LAST block (the two-launch NVFP4 amax reduction must see every
block), e2m1 / e4m3 rounding ties, e2m1 saturation, subnormal / clamped block scales, zero blocks and rows, padding
and leading dims; and the CUDA lowering of each kernel built on this CPU machine under an abstract H200 mesh
(Pallas -> Triton IR; the PTX compile itself happens in XLA on a GPU and is covered by the gpu test).
GPU (`-m gpu`, skipped without a CUDA device): the real kernels on device vs the references on device and on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.pallas_kernels.quantize import (quantize_fp8_kernel, quantize_fp8_reference, quantize_nvfp4_kernel,
                                     quantize_nvfp4_reference)

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _assert_same(out, ref, seed, what=""):
    assert len(out) == len(ref)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == r.shape and o.dtype == r.dtype, (what, i, o.shape, o.dtype, r.shape, r.dtype)
        ob, rb = _bits(o), _bits(r)
        bad = np.argwhere(ob != rb)
        assert bad.size == 0, (f"{what} output {i}: {len(bad)} of {ob.size} differ, first at {bad[:5].tolist()}: "
                               f"{ob[tuple(bad[0])]:#x} vs {rb[tuple(bad[0])]:#x} (seed {seed})")


def _nvfp4_input(rng, m, k, dtype=jnp.bfloat16, max_last=True):
    """Rows over 8 decades, 16-blocks over 7 more (block scales down to e4m3 subnormals and the 2^-9 clamp), e2m1 ties
    on exact power-of-two scales (rows 1, 2), a zero block, a zero row; the row maximum in the row's last element."""
    x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-4, 4, (m, 1))
    x *= np.repeat(10.0 ** rng.uniform(-7, 0, (m, -(-k // 16))), 16, axis=1)[:, :k]
    for r in (1, 2):
        if r >= m:
            continue
        j = int(rng.integers(-20, 20))                 # gsa = 2^j exactly
        for b in range(k // 16):
            kb = int(rng.integers(-9, 9))              # block scale 2^kb exactly (block amax = 6 * gsa * 2^kb)
            blk = rng.choice(E2M1_TIES, 16) * rng.choice([-1.0, 1.0], 16)
            blk[0] = 6.0
            x[r, 16 * b:16 * b + 16] = blk * 2.0 ** (kb + j)
        x[r, :] = np.clip(x[r, :], -6 * 448 * 2.0 ** j, 6 * 448 * 2.0 ** j)
        x[r, k - 1] = 6 * 448 * 2.0 ** j
    if max_last:   # rows 1, 2 already end in their exact maximum
        rows = [r for r in range(m) if r not in (1, 2)]
        x[rows, -1] = np.abs(x[rows]).max(axis=1) * rng.uniform(1.0, 3.0, len(rows)) * rng.choice([-1, 1], len(rows))
    if k >= 32:
        x[0, 16:32] = 0.0
    if m > 3:
        x[m - 1, :] = 0.0
    return jnp.asarray(x.astype(np.float32), dtype)


def _fp8_input(rng, m, k, dtype=jnp.bfloat16):
    """Rows over 12 decades, 128-blocks over 4 more; row 0: e4m3 rounding ties (normal and subnormal) under an exact
    power-of-two scale (block amax 448 * 2^j in the block's last element); a row under the 1e-4 amax floor; a zero
    row."""
    x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-6, 6, (m, 1))
    x *= np.repeat(10.0 ** rng.uniform(-4, 0, (m, -(-k // 128))), 128, axis=1)[:, :k]
    ties = np.concatenate([(1 + (2 * np.arange(8) + 1) / 16.0) * 2.0 ** e for e in range(-6, 8)]
                          + [(2 * np.arange(8) + 1) * 2.0 ** -10])
    for b in range(k // 128):
        j = int(rng.integers(-30, 30))
        blk = rng.choice(ties, 128) * rng.choice([-1.0, 1.0], 128)
        blk[-1] = 448.0
        x[0, 128 * b:128 * b + 128] = blk * 2.0 ** j
    if m > 1:
        x[1, :] = rng.uniform(-1e-7, 1e-7, k)
    if m > 2:
        x[2, :] = 0.0
    return jnp.asarray(x.astype(np.float32), dtype)


def _nvfp4_poisons(m, k, native=True):
    sdt = jnp.float8_e4m3fn if native else jnp.uint8
    out = []
    for byte, g in ((0xA5, np.nan), (0x5A, -1.0)):
        out.append((jnp.full((m, k // 16, 8), byte, jnp.uint8),
                    jax.lax.bitcast_convert_type(jnp.full((m, k // 16), byte, jnp.uint8), sdt),
                    jnp.full((m,), g, jnp.float32)))
    return out


def _fp8_poisons(m, k, native=True):
    qdt = jnp.float8_e4m3fn if native else jnp.uint8
    return [(jax.lax.bitcast_convert_type(jnp.full((m, k // 128, 128), byte, jnp.uint8), qdt),
             jnp.full((m, k // 128), g, jnp.float32)) for byte, g in ((0xA5, np.nan), (0x5A, -3.0))]


# ------------------------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,k,dtype,split,convert,opts", [
    (4, 7168, jnp.bfloat16, True, "native", {"block_rows": 4}),                    # decode shape, 7 chunks
    (8, 448, jnp.bfloat16, False, "native", {"block_rows": 2}),                     # fused, pieces 256+128+64
    (16, 2048, jnp.bfloat16, False, "bits", {"block_rows": 4, "chunk_blocks": 32}),
])
def test_nvfp4_kernel_bit_exact_poisoned(m, k, dtype, split, convert, opts):
    rng, seed = _fresh_rng()
    x = _nvfp4_input(rng, m, k, dtype)
    ref = quantize_nvfp4_reference(x)
    for poison in _nvfp4_poisons(m, k, convert == "native"):
        out = quantize_nvfp4_kernel(x, interpret=True, split=split, convert=convert, poison=poison, **opts)
        _assert_same(out, ref, seed, f"nvfp4 split={split} {convert}")


@pytest.mark.parametrize("split", [True, False])
def test_nvfp4_row_max_in_last_block(split):
    """Many K chunks (split: 64 programs per row block in each launch; fused: 16 register pieces): each row's max sits
    in its last element, another row's in its first -- gsa must come from every block."""
    rng, seed = _fresh_rng()
    m, k = 4, 4096
    x = np.array(_nvfp4_input(rng, m, k, jnp.float32, max_last=False))
    big = np.abs(x).max() * 1.5
    x[0, -1], x[1, -1], x[2, 0] = big, -big * 3, big * 7
    x = jnp.asarray(x, jnp.bfloat16)
    ref = quantize_nvfp4_reference(x)
    opts = {"chunk_blocks": 4, "block_rows": 2} if split else {"chunk_blocks": 16, "block_rows": 1}
    out = quantize_nvfp4_kernel(x, interpret=True, split=split, poison=_nvfp4_poisons(m, k)[0], **opts)
    _assert_same(out, ref, seed, f"nvfp4 max-last split={split}")
    np.testing.assert_array_equal(np.asarray(out[2])[:3, 0], np.asarray(ref[2])[:3, 0])


def test_nvfp4_padding_lead_dims_nan():
    """[2, 3, 200]: K not a multiple of 16 (zero-padded like the reference), leading dims; a NaN row gets gsa NaN and
    NaN block scales (its codes are unspecified); odd K is refused."""
    rng, seed = _fresh_rng()
    x = jnp.asarray(_nvfp4_input(rng, 6, 200, jnp.float32).reshape(2, 3, 200), jnp.bfloat16)
    _assert_same(quantize_nvfp4_kernel(x, interpret=True, split=False, block_rows=2),
                 quantize_nvfp4_reference(x), seed, "nvfp4 padded")
    x = np.array(_nvfp4_input(rng, 6, 256, jnp.float32)).reshape(2, 3, 256)
    x[1, 1, 77] = np.nan     # float32 input: the even / odd split path
    out = quantize_nvfp4_kernel(jnp.asarray(x), interpret=True, split=True, block_rows=2, chunk_blocks=4,
                                convert="bits")
    ref = quantize_nvfp4_reference(jnp.asarray(x))
    ok = np.ones(x.shape[:2], bool)
    ok[1, 1] = False
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(_bits(o)[ok], _bits(r)[ok], err_msg=f"seed {seed}")
    assert np.isnan(np.asarray(out[2])[1, 1, 0]) and np.isnan(np.asarray(ref[2])[1, 1, 0])
    assert np.all(_bits(out[1])[1, 1] == 0x7F) and np.all(_bits(ref[1])[1, 1] == 0x7F)
    with pytest.raises(ValueError):
        quantize_nvfp4_kernel(jnp.ones((2, 33), jnp.bfloat16), interpret=True)


# ------------------------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,convert", [(jnp.bfloat16, "native"), (jnp.float32, "bits"),
                                           (jnp.bfloat16, "bits")])
def test_fp8_kernel_bit_exact_poisoned(dtype, convert):
    rng, seed = _fresh_rng()
    m, k = 8, 1024                              # grid (4, 4) with these block sizes
    x = _fp8_input(rng, m, k, dtype)
    ref = quantize_fp8_reference(x)
    for poison in _fp8_poisons(m, k, convert == "native"):
        out = quantize_fp8_kernel(x, interpret=True, convert=convert, block_rows=2, chunk_blocks=2, poison=poison)
        _assert_same(out, ref, seed, f"fp8 {convert}")


def test_fp8_padding_lead_dims():
    rng, seed = _fresh_rng()
    x = _fp8_input(rng, 6, 192, jnp.float32).reshape(2, 3, 192)     # 128 + a partial 64
    _assert_same(quantize_fp8_kernel(x, interpret=True), quantize_fp8_reference(x), seed, "fp8 padded")


def test_kernels_under_jit_without_host_transfers():
    rng, _ = _fresh_rng()
    x = jax.device_put(_nvfp4_input(rng, 2, 256))
    nv = jax.jit(functools.partial(quantize_nvfp4_kernel, interpret=True))
    f8 = jax.jit(functools.partial(quantize_fp8_kernel, interpret=True))
    jax.block_until_ready((nv(x), f8(x)))
    with jax.transfer_guard("disallow"):
        jax.block_until_ready((nv(x), f8(x)))


# ------------------------------------------------------------------------------------------------------------------
# CUDA lowering, checked on CPU
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,fn,shape,dtype,launches", [
    ("nvfp4-split", functools.partial(quantize_nvfp4_kernel, split=True), (16, 7168), jnp.bfloat16, 2),
    ("nvfp4-fused", functools.partial(quantize_nvfp4_kernel, split=False), (512, 7168), jnp.bfloat16, 1),
    ("nvfp4-bits-f32-rn", functools.partial(quantize_nvfp4_kernel, split=True, convert="bits", division="rn"),
     (4, 4096), jnp.float32, 2),
    ("fp8", quantize_fp8_kernel, (16, 7168), jnp.bfloat16, 1),
    ("fp8-bits", functools.partial(quantize_fp8_kernel, convert="bits"), (64, 4096), jnp.float32, 1),
])
def test_cuda_lowering_on_cpu(name, fn, shape, dtype, launches):
    """Pallas -> Triton IR for an H200 (sm_90) without a GPU; `div.rn.f32` inline PTX included."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        text = jax.jit(fn).trace(jax.ShapeDtypeStruct(shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == launches, name


# ------------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def cuda():
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU")
    return jax.devices()[0]


def _on(dev, tree):
    return jax.device_put(tree, dev)


@pytest.mark.gpu
def test_gpu_kernels_match_reference(cuda):
    """The compiled kernels on the GPU vs the references (the definition: XLA on the CPU, IEEE division), poisoned
    outputs, decode and large shapes, both NVFP4 modes, both divisions, both e4m3 conversions, bf16 and f32."""
    cpu = jax.devices("cpu")[0]
    rng, seed = _fresh_rng()
    cases = [(1, 7168, jnp.bfloat16), (3, 4096, jnp.bfloat16), (16, 4096, jnp.float32), (1024, 7168, jnp.bfloat16)]
    nv = {v: jax.jit(functools.partial(quantize_nvfp4_kernel, split=v[0], convert=v[1], division=v[2]))
          for v in [(True, "native", "fast"), (False, "native", "fast"), (False, "bits", "fast"),
                    (True, "bits", "rn"), (False, "native", "rn")]}
    f8 = {c: jax.jit(functools.partial(quantize_fp8_kernel, convert=c)) for c in ("native", "bits")}
    nv_ref, f8_ref = jax.jit(quantize_nvfp4_reference), jax.jit(quantize_fp8_reference)
    for m, k, dtype in cases:
        x = _nvfp4_input(rng, m, k, dtype)
        ref = nv_ref(_on(cpu, x))
        for v, f in nv.items():
            for poison in _nvfp4_poisons(m, k, v[1] == "native"):
                _assert_same(f(_on(cuda, x), poison=_on(cuda, poison)), ref, seed,
                             f"nvfp4 gpu {m}x{k} {dtype.__name__} split/convert/division={v}")
        x = _fp8_input(rng, m, k, dtype)
        ref = f8_ref(_on(cpu, x))
        for convert, f in f8.items():
            for poison in _fp8_poisons(m, k, convert == "native"):
                _assert_same(f(_on(cuda, x), poison=_on(cuda, poison)), ref, seed,
                             f"fp8 gpu {m}x{k} {dtype.__name__} {convert}")
    # the row maximum in the last of many K chunks, decode-sized (two launches, 112 chunks per row)
    x = np.array(_nvfp4_input(rng, 4, 7168, jnp.float32, max_last=False))
    x[:, -1] = np.abs(x).max() * np.array([1.5, -2.0, 3.0, 9.0])
    x = jnp.asarray(x, jnp.bfloat16)
    out = jax.jit(functools.partial(quantize_nvfp4_kernel, split=True, chunk_blocks=4))(_on(cuda, x))
    _assert_same(out, nv_ref(_on(cpu, x)), seed, "nvfp4 gpu max-last")


@pytest.mark.gpu
@pytest.mark.xfail(strict=False, reason="seen 2026-11-30 on an H200: XLA:GPU's float32 division in the jnp reference "
                   "is not correctly rounded, so a few e2m1 codes differ from XLA:CPU's (the kernels match the CPU "
                   "reference); not this module's code")
def test_gpu_reference_matches_cpu_reference(cuda):
    cpu = jax.devices("cpu")[0]
    rng, seed = _fresh_rng()
    x = _nvfp4_input(rng, 16, 7168)
    ref = jax.jit(quantize_nvfp4_reference)
    _assert_same(ref(_on(cuda, x)), ref(_on(cpu, x)), seed, "nvfp4 reference gpu vs cpu")
