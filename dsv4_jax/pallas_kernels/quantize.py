"""Activation quantization kernels (Pallas, GPU): NVFP4 (amax -> global scale -> per-16 e4m3 scales + packed e2m1)
and FP8 (per-128 e4m3 + power-of-two f32 scales), bit-exact against the pure-jnp references of
dsv4_jax/numerics/activations.py (`quantize_nvfp4`, `quantize_fp8`), which stay the definition of the numerics.

Backend: the Pallas **Triton** backend (`pl.pallas_call` with `jax.experimental.pallas.triton.CompilerParams`), not
Mosaic GPU (`plgpu.kernel`), although Mosaic GPU is the Pallas GPU backend JAX maintains. Why:
  * these kernels are memory-bound elementwise work with short reductions (per 16 / 128 elements, per row): no
    tensor cores, no TMA pipeline, nothing Mosaic GPU does better; Triton's grid + BlockSpec model fits them and
    vectorizes the loads by itself;
  * bit-exactness needs a correctly rounded float32 division per element (the references divide; x * (1/d) differs in
    the last bit and moves values across e2m1 rounding ties). Triton lowers `/` to the approximate `div.full.f32`,
    but the backend has `elementwise_inline_asm`, so we emit `div.rn.f32` exactly where we need it;
  * the Triton backend is seen working on the H200 image and its interpret mode runs grid/BlockSpec kernels on CPU
    (CI), while Mosaic GPU's interpret mode needs whole-array refs with explicit copies, and a Mosaic GPU quantize
    kernel tried here failed to lower ("Layout inference failed").
The Triton backend is deprecated upstream; if it goes, these kernels move to Mosaic GPU (the arithmetic helpers
below are plain lax ops and carry over).

Numerics (identical to the references, bit for bit, for finite inputs; subnormals: see below):
  nvfp4: the scale is per ROW, as in the reference (activations.py: a token's numerics never depend on the other
         tokens), gsa = amax(|x[m, :]|) / (6 * 448), NaN for a row holding a NaN. Block scale
         e4m3(clip(block_amax / (6 * gsa), 2^-9, 448)) (1.0 for an all-zero block), y = x / (scale * gsa),
         code = e2m1 round-to-nearest-even of |y| (saturating at 6) | 8 if y < 0. Outputs: packed uint8 [..., K/2]
         (element 2k in the low nibble), e4m3 block scales [..., K/16], f32 gsa [..., 1] -- i.e. the reference with
         its codes packed by nvfp4.pack_fp4_codes (`quantize_nvfp4_reference`).
  fp8:   per 128: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clip(x / s, -448, 448)); outputs e4m3 [..., K]
         and f32 scales [..., K/128] -- exactly the reference's (q, scale).
  All divisions are correctly rounded float32 divisions: div.rn.f32 (inline PTX) for the per-block / per-row ones,
  and per element (`division="fast"`, default) div.rn's own fast path -- the instruction sequence ptxas emits for
  div.rn, read off its SASS -- with the reciprocal hoisted per block after an exact power-of-two rescale of the row
  (see `_nvfp4_chunk`; bit-exact on the H200 over ~1e8 random elements, and `division="rn"` keeps one div.rn per
  element); an optimization barrier keeps XLA from turning them into
  reciprocal multiplies in interpret mode. x / s with s a power of two is done as x * 2^-k, which is the same real
  number and so the same rounding. Subnormals: the GPU kernels follow IEEE (no flush), as XLA:GPU does; XLA:CPU flushes
  subnormal inputs and results to zero, so a quotient or input below 2^-126 can give a different sign nibble / scale
  there (interpret mode runs on XLA:CPU and matches it).
  Found on the H200 (2026-11-30): XLA:GPU's run of the jnp reference is NOT bit-exact with XLA:CPU's -- its float32
  division is not correctly rounded (the reference's y = x / (scale * gsa) differed from numpy's IEEE quotient in
  ~36% of elements, gsa in 13 of 64 rows), which moves e2m1 codes near rounding ties. The kernels match the CPU
  reference (the definition) bit for bit; compare on the CPU.

NVFP4 amax across thread blocks. The global (per-row) amax is reduced without a host sync in one of two ways:
  * "fused" (one launch; the default): each program owns whole rows, loads each row once into registers, reduces
    its amax across the program's warps, then quantizes from the same registers -- one HBM read. No reduction crosses
    a thread block, because the scale is per row and a row lives in one block.
  * "split" (two launches, `split=True`; for rows too long for one program, and kept as the cross-block variant):
    launch 1, grid (row blocks, K chunks), writes each chunk's partial amax (as the uint32 bits of |x|, so NaN
    dominates) to a [chunks, M] buffer; launch 2, same grid, reads ALL partials of its rows, reduces them to gsa and quantizes its
    chunk. The kernel boundary is the grid-wide barrier: launches on one stream are ordered, so every partial is
    written before any program of launch 2 reads it. No in-kernel cross-block protocol, no atomics.
  Both modes run the same arithmetic and give identical bits. On the H200 the fused path was faster at every
  measured shape, decode sizes included (1.5-2.3 us vs 2.2-2.7 us), so it is the default.

e4m3 conversion: `convert="native"` uses the backend's float -> float8_e4m3fn conversion (cvt.rn.satfinite on
sm_89+; XLA's convert in interpret mode); `convert="bits"` rounds with integer ops (no fp8 types in the kernel).
Both are bit-identical to the reference; the tests run both.

Inputs: any float dtype; bf16 is the fast path (pairs of bf16 read as one uint32, split with two integer ops). Other
dtypes are cast to f32 and split into even/odd halves by XLA first (an extra pass; the float32 verification mode).
K not a multiple of the block is zero-padded like the reference (zeros change no amax), outputs sliced back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..numerics import activations as _act
from ..numerics.nvfp4 import pack_fp4_codes

from .tiles import pow2_divisor

NVFP4_BLOCK = 16
FP8_BLOCK = _act.FP8_ACT_BLOCK          # 128
_F32 = jnp.float32
_U32 = jnp.uint32
_E4M3_MAX = 448.0
_E4M3_MIN_SUB = 2.0 ** -9
_NVFP4_DEN = np.float32(6.0 * 448.0)
_MIN_AMAX = np.float32(6.0 * 448.0 * 2.0 ** -126)    # nvfp4.global_scale_from_amax's floor
_FP8_AMAX_FLOOR = np.float32(_act.FP8_AMAX_FLOOR)     # 1e-4 as float32, as jnp.maximum(f32, 1e-4) uses it


# ------------------------------------------------------------------------------------------------------------------
# references (pure jnp, the definition of the numerics)
# ------------------------------------------------------------------------------------------------------------------

def quantize_nvfp4_reference(x: jax.Array):
    """activations.quantize_nvfp4 with its codes packed: (packed uint8 [..., K/2], e4m3 [..., ceil(K/16)],
    f32 gsa [..., 1])."""
    codes, scale, gsa = _act.quantize_nvfp4(x)
    return pack_fp4_codes(codes), scale, gsa


def quantize_fp8_reference(x: jax.Array):
    """activations.quantize_fp8: (e4m3 [..., K], f32 power-of-two scales [..., ceil(K/128)])."""
    return _act.quantize_fp8(x)


# ------------------------------------------------------------------------------------------------------------------
# in-kernel arithmetic (plain lax ops: lowers through Triton and runs in interpret mode)
# ------------------------------------------------------------------------------------------------------------------

def _bits(x):
    return lax.bitcast_convert_type(x, _U32)


def _f32(b):
    return lax.bitcast_convert_type(b, _F32)


def _u32(v):
    return jnp.asarray(v, _U32)


def _div(a, b, exact_asm: bool):
    """Correctly rounded float32 a / b (b broadcast to a's shape)."""
    b = jnp.broadcast_to(jnp.asarray(b, _F32), a.shape)
    if exact_asm:   # Triton's `/` is div.full.f32 (approximate): ask for the IEEE division explicitly
        (q,) = pltriton.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, _F32)])
        return q
    return a / lax.optimization_barrier(b)   # interpret mode: keep XLA from rewriting into a * (1 / b)


def _e4m3_bits_nonneg(v):
    """v float32 >= 0 (<= 448, or NaN) -> (e4m3 byte as uint32, the e4m3 value as float32), round-to-nearest-even,
    with integer ops only."""
    b = _bits(v)
    r = (b + _u32(0x7FFFF) + ((b >> 20) & _u32(1))) & _u32(0xFFF00000)   # 3 mantissa bits, RNE (may carry up)
    normal = (r >> 20) - _u32(120 << 3)                                   # (exp - 127 + 7) << 3 | mantissa
    m = _bits(v * np.float32(512.0) + np.float32(2.0 ** 23)) - _u32(0x4B000000)   # RNE(v * 2^9), v < 2^-6
    sub = v < np.float32(2.0 ** -6)
    byte = jnp.where(sub, m, normal)
    value = jnp.where(sub, m.astype(_F32) * np.float32(2.0 ** -9), _f32(r))
    nan = v != v
    return jnp.where(nan, _u32(0x7F), byte), jnp.where(nan, v, value)


def _e2m1_magnitude_code(a):
    """a float32 >= 0 -> e2m1 magnitude code (uint32 0..7): round-to-nearest-even on {0,.5,1,1.5,2,3,4,6},
    saturating at 6, with integer ops: a >= 1 rounds its f32 mantissa to 1 bit (RNE, carry into the exponent), code =
    (biased exponent - 126) << 1 | mantissa bit; a < 1 is RNE(2a) on the subnormal grid {0, .5, 1}."""
    b = _bits(a)
    r = b + _u32(0x1FFFFF) + ((b >> 22) & _u32(1))
    normal = jnp.minimum((r >> 22) - _u32(252), _u32(7))
    sub = _bits(a * np.float32(2.0) + np.float32(2.0 ** 23)) - _u32(0x4B000000)
    return jnp.where(a < np.float32(1.0), sub, normal)


def _asm_f32(code, constraints, *args):
    (r,) = pltriton.elementwise_inline_asm(code, args=list(args), constraints=constraints, pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, _F32)])
    return r


def _div_fast_setup(d):
    """The reciprocal of div.rn.f32's fast path (MUFU.RCP + one Newton step), per divisor."""
    y0 = _asm_f32("rcp.approx.ftz.f32 $0, $1;", "=f,f", d)
    e = _asm_f32("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", -d, y0, jnp.ones_like(d))
    return _asm_f32("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", y0, e, y0)


def _div_fast(x, y1, neg_d):
    """div.rn.f32's fast path with a shared divisor: q = x*y1, r = fma(-d, q, x), q' = fma(y1, r, q) -- the same
    instructions ptxas emits for div.rn, so q' = RN(x / d) wherever div.rn takes that path (normal x, moderate d,
    normal quotient); elsewhere only quotients far below the e2m1 range can be affected."""
    return _asm_f32("{ .reg .f32 q, r; mul.rn.f32 q, $1, $2; fma.rn.f32 r, $3, q, $1; fma.rn.f32 $0, $2, r, q; }",
                    "=f,f,f,f", x, y1, neg_d)


def _nonzero_threshold(d):
    """Smallest positive float32 z with RN(z / d) != 0, i.e. the smallest float above d * 2^-150, exactly (d > 0,
    no flush to zero): a quotient x / d rounds to a (negative) non-zero iff |x| >= z."""
    v = (d * np.float32(2.0 ** -75)) * np.float32(2.0 ** -75)         # RN(d * 2^-150) (d < 2^-51: 0, fine)
    back = (v * np.float32(2.0 ** 75)) * np.float32(2.0 ** 75)        # exact
    return jnp.where(back > d, v, _f32(_bits(v) + _u32(1)))


def _split_pairs(refs, idx):
    """(lo, hi, |lo| bits max |hi| bits) f32/uint32 [..] for one chunk: elements 2k and 2k+1 of the input."""
    if len(refs) == 1:    # bf16 pairs packed in uint32 (little endian: element 2k in the low half)
        u = refs[0][idx]
        lo_b, hi_b = u << 16, u & _u32(0xFFFF0000)
    else:
        lo_b, hi_b = _bits(refs[0][idx]), _bits(refs[1][idx])
    absmax = jnp.maximum(lo_b & _u32(0x7FFFFFFF), hi_b & _u32(0x7FFFFFFF))
    return _f32(lo_b), _f32(hi_b), absmax


def _gsa_from_amax_bits(amax_bits, exact_asm):
    """Row amax (as uint32 bits of a non-negative float; NaN bits compare above inf) -> gsa float32."""
    amax = _f32(amax_bits)
    gs = _div(jnp.where(amax > _MIN_AMAX, amax, _MIN_AMAX), _NVFP4_DEN, exact_asm)
    return jnp.where(amax_bits > _u32(0x7F800000), np.float32(np.nan), gs)


def _nvfp4_chunk(lo, hi, absmax, gs, *, exact_asm, native, fast):
    """lo, hi f32 [BM, c, 8] (even / odd elements of c 16-blocks), absmax uint32 [BM, c, 8], gs f32 [BM]
    -> (packed uint8 [BM, c, 8], block scales [BM, c] (e4m3 if native else uint8 bytes)).

    fast (GPU only): instead of one div.rn per element (~10 instructions, each behind a branch to its slow path),
    the row is rescaled by 2^k (gs * 2^k in [1, 2), exact) so every divisor d' = d * 2^k lies in [2^-9, 896), the
    reciprocal of div.rn's fast path is computed once per block and each element costs 1 mul + 1 mul + 2 fma with
    the result of div.rn. Rescaling is exact except where x * 2^k underflows, i.e. for quotients < 2^-117 (code 0
    either way); the sign bit (y < 0 iff x < 0 and RN(|x| / d) != 0) is taken exactly from |x| >= z(d)."""
    bamax = _f32(jnp.max(absmax, axis=-1))                                   # [BM, c]
    gs2 = jnp.broadcast_to(gs[:, None], bamax.shape)
    ratio = _div(bamax, np.float32(6.0) * gs2, exact_asm)
    ratio = jnp.where(ratio == 0, np.float32(1.0), ratio)
    ratio = jnp.where(ratio < np.float32(_E4M3_MIN_SUB), np.float32(_E4M3_MIN_SUB),
                      jnp.where(ratio > np.float32(_E4M3_MAX), np.float32(_E4M3_MAX), ratio))
    ratio = jnp.where(ratio != ratio, np.float32(np.nan), ratio)   # NaN (NaN / inf rows): the positive quiet NaN
    if native:
        scale = ratio.astype(jnp.float8_e4m3fn)
        scale_val = scale.astype(_F32)
    else:
        scale, scale_val = _e4m3_bits_nonneg(ratio)
        scale = scale.astype(jnp.uint8)
    d = scale_val * gs2                                                      # [BM, c], as the reference
    full = lambda v: jnp.broadcast_to(v[:, :, None], lo.shape)               # noqa: E731
    if fast:
        pk = _f32((_u32(254) - (_bits(gs) >> 23)) << 23)                     # 2^k, gs * 2^k in [1, 2)
        pk2 = jnp.broadcast_to(pk[:, None], bamax.shape)
        dp = d * pk2                                                         # exact
        y1, neg_dp, pk3 = full(_div_fast_setup(dp)), full(-dp), full(pk2)
        neg_z = full(-_nonzero_threshold(d))

        def code(x):
            mag = _e2m1_magnitude_code(jnp.abs(_div_fast(x * pk3, y1, neg_dp)))
            return mag | jnp.where(x <= neg_z, _u32(8), _u32(0))
    else:
        d3 = full(d)

        def code(x):
            y = _div(x, d3, exact_asm)
            return _e2m1_magnitude_code(jnp.abs(y)) | jnp.where(y < 0, _u32(8), _u32(0))
    return (code(lo) | (code(hi) << 4)).astype(jnp.uint8), scale


def _pow2_pieces(n: int, cap: int):
    """[(start, size)] covering range(n) with power-of-two sizes <= cap (Triton loads must be powers of two)."""
    out, start = [], 0
    while start < n:
        size = min(cap, 1 << (int(n - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


# ------------------------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------------------------

def _nvfp4_fused_kernel(*refs, n_in, pieces, exact_asm, native, fast):
    in_refs, (packed_ref, scale_ref, gsa_ref) = refs[:n_in], refs[n_in:n_in + 3]
    chunks = [_split_pairs(in_refs, (slice(None), pl.ds(s, c), slice(None))) for s, c in pieces]
    amax = None
    for _, _, absmax in chunks:
        part = jnp.max(jnp.max(absmax, axis=-1), axis=-1)                    # [BM]
        amax = part if amax is None else jnp.maximum(amax, part)
    gs = _gsa_from_amax_bits(amax, exact_asm)
    for (s, c), (lo, hi, absmax) in zip(pieces, chunks):
        packed, scale = _nvfp4_chunk(lo, hi, absmax, gs, exact_asm=exact_asm, native=native, fast=fast)
        packed_ref[:, pl.ds(s, c), :] = packed
        scale_ref[:, pl.ds(s, c)] = scale
    gsa_ref[...] = gs


def _nvfp4_partial_kernel(*refs, n_in):
    in_refs, (part_ref,) = refs[:n_in], refs[n_in:n_in + 1]
    _, _, absmax = _split_pairs(in_refs, (slice(None), slice(None), slice(None)))
    part_ref[...] = jnp.max(jnp.max(absmax, axis=-1), axis=-1)[None, :]        # [1, BM]


def _nvfp4_split_kernel(*refs, n_in, n_chunks, exact_asm, native, fast):
    in_refs = refs[:n_in]
    part_ref, (packed_ref, scale_ref, gsa_ref) = refs[n_in], refs[n_in + 1:n_in + 4]
    amax = part_ref[0, :]
    for j in range(1, n_chunks):                                             # every chunk's partial of these rows
        amax = jnp.maximum(amax, part_ref[j, :])
    gs = _gsa_from_amax_bits(amax, exact_asm)
    lo, hi, absmax = _split_pairs(in_refs, (slice(None), slice(None), slice(None)))
    packed, scale = _nvfp4_chunk(lo, hi, absmax, gs, exact_asm=exact_asm, native=native, fast=fast)
    packed_ref[...] = packed
    scale_ref[...] = scale

    @pl.when(pl.program_id(1) == 0)
    def _():
        gsa_ref[...] = gs


def _call(kernel, grid, in_specs, out_specs, out_shape, args, poison, interpret, num_warps, name):
    """pallas_call; `poison` (tests) gives initial output buffers, aliased in place, so unwritten elements show."""
    aliases = {}
    if poison is not None:
        n = len(args)
        args = (*args, *poison)
        in_specs = (*in_specs, *out_specs)
        aliases = {n + i: i for i in range(len(poison))}
        inner = kernel

        def kernel(*refs):   # the aliased inputs are not read
            return inner(*refs[:n], *refs[n + len(poison):])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=list(in_specs), out_specs=list(out_specs), out_shape=list(out_shape),
        input_output_aliases=aliases, interpret=interpret, name=name,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*args)


def _nvfp4_inputs(x2):
    """[M, K] -> kernel inputs viewed [M, K/16, 8]: one uint32 per bf16 pair, or f32 even / odd halves."""
    m, k = x2.shape
    if x2.dtype == jnp.bfloat16:
        u = lax.bitcast_convert_type(x2.reshape(m, k // 2, 2), _U32)
        return (u.reshape(m, k // 16, 8),)
    xf = x2.astype(_F32).reshape(m, k // 2, 2)
    return xf[:, :, 0].reshape(m, k // 16, 8), xf[:, :, 1].reshape(m, k // 16, 8)


def _nvfp4_2d(x2, *, interpret, split, block_rows, chunk_blocks, num_warps, native, fast, poison):
    m, k = x2.shape
    nb = k // NVFP4_BLOCK
    exact_asm = not interpret
    inputs = _nvfp4_inputs(x2)
    n_in = len(inputs)
    sdt = jnp.float8_e4m3fn if native else jnp.uint8
    out_shape = (jax.ShapeDtypeStruct((m, nb, 8), jnp.uint8), jax.ShapeDtypeStruct((m, nb), sdt),
                 jax.ShapeDtypeStruct((m,), _F32))
    if split is None:   # measured on the H200 (docs/kernels_quantize.md): fused is faster at every shape tried
        split = False
    bm = pow2_divisor(m, block_rows or 1)
    if not split:
        pieces = _pow2_pieces(nb, chunk_blocks or 256)
        specs_in = [pl.BlockSpec((bm, nb, 8), lambda i: (i, 0, 0))] * n_in
        specs_out = [pl.BlockSpec((bm, nb, 8), lambda i: (i, 0, 0)), pl.BlockSpec((bm, nb), lambda i: (i, 0)),
                     pl.BlockSpec((bm,), lambda i: (i,))]
        kernel = functools.partial(_nvfp4_fused_kernel, n_in=n_in, pieces=tuple(pieces),
                                   exact_asm=exact_asm, native=native, fast=fast)
        packed, scale, gsa = _call(kernel, (m // bm,), specs_in, specs_out, out_shape, inputs, poison, interpret,
                                   num_warps or (8 if m < 256 else 4), "nvfp4_quantize_fused")
    else:
        ck = pow2_divisor(nb, chunk_blocks or 64)
        n_chunks = nb // ck
        grid = (m // bm, n_chunks)
        specs_in = [pl.BlockSpec((bm, ck, 8), lambda i, j: (i, j, 0))] * n_in
        part = _call(functools.partial(_nvfp4_partial_kernel, n_in=n_in), grid, specs_in,
                     [pl.BlockSpec((1, bm), lambda i, j: (j, i))], [jax.ShapeDtypeStruct((n_chunks, m), _U32)],
                     inputs, None, interpret, num_warps or 4, "nvfp4_partial_amax")[0]
        specs_out = [pl.BlockSpec((bm, ck, 8), lambda i, j: (i, j, 0)), pl.BlockSpec((bm, ck), lambda i, j: (i, j)),
                     pl.BlockSpec((bm,), lambda i, j: (i,))]
        kernel = functools.partial(_nvfp4_split_kernel, n_in=n_in, n_chunks=n_chunks,
                                   exact_asm=exact_asm, native=native, fast=fast)
        packed, scale, gsa = _call(kernel, grid, [*specs_in, pl.BlockSpec((n_chunks, bm), lambda i, j: (0, i))],
                                   specs_out, out_shape, (*inputs, part), poison, interpret, num_warps or 4,
                                   "nvfp4_quantize_split")
    if not native:
        scale = lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
    return packed.reshape(m, k // 2), scale, gsa.reshape(m, 1)


def quantize_nvfp4_kernel(x: jax.Array, interpret: bool = False, *, split: bool | None = None,
                          block_rows: int | None = None, chunk_blocks: int | None = None,
                          num_warps: int | None = None, convert: str = "native", division: str = "fast",
                          poison=None):
    """x [..., K] (K even) -> (packed e2m1 uint8 [..., K/2] low nibble first, e4m3 block scales [..., ceil(K/16)],
    f32 per-row global scale [..., 1]), bit-identical to `quantize_nvfp4_reference(x)`.

    split: False / None = one fused launch, rows resident in registers (the default: fastest at every measured
    shape, decode included); True = the two-launch split-K path. block_rows / chunk_blocks (16-blocks per program in
    split mode, per register piece in fused mode) / num_warps tune; convert "native" | "bits" picks
    the e4m3 rounding; division "fast" | "rn" (GPU: div.rn's fast path with a per-block reciprocal, or one div.rn
    per element; interpret mode always divides exactly); poison (tests) = initial (packed [M, K/16, 8] u8, scales [M, K/16], gsa [M] f32) buffers
    that the kernel must overwrite, for unpadded 2-D x."""
    k = x.shape[-1]
    if k % 2:
        raise ValueError(f"NVFP4 packing needs an even last dim, got {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    pad = -k % NVFP4_BLOCK
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)))
    packed, scale, gsa = _nvfp4_2d(x2, interpret=interpret, split=split, block_rows=block_rows,
                                   chunk_blocks=chunk_blocks, num_warps=num_warps, native=convert == "native",
                                   fast=division == "fast" and not interpret, poison=poison)
    return (packed[:, :k // 2].reshape(*lead, k // 2), scale.reshape(*lead, -1), gsa.reshape(*lead, 1))


# ------------------------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------------------------

def _fp8_kernel(x_ref, q_ref, s_ref, *, exact_asm, native):
    x = x_ref[...].astype(_F32)                                              # [BM, CB, 128]
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), _FP8_AMAX_FLOOR)        # [BM, CB]
    b = _bits(_div(amax, np.float32(_E4M3_MAX), exact_asm))
    e = (b >> 23) + ((b & _u32(0x7FFFFF)) != 0).astype(_U32)                 # pow2_ceil exponent field
    s_ref[...] = _f32(e << 23)
    recip = jnp.where(e >= _u32(255), np.float32(0.0), _f32((_u32(254) - e) << 23))   # exactly 1 / s
    v = x * recip[:, :, None]
    v = jnp.where(v > np.float32(_E4M3_MAX), np.float32(_E4M3_MAX),
                  jnp.where(v < np.float32(-_E4M3_MAX), np.float32(-_E4M3_MAX), v))     # NaN stays
    if native:
        q_ref[...] = v.astype(jnp.float8_e4m3fn)
    else:
        byte, _ = _e4m3_bits_nonneg(jnp.abs(v))
        q_ref[...] = (byte | ((_bits(v) >> 24) & _u32(0x80))).astype(jnp.uint8)


def quantize_fp8_kernel(x: jax.Array, interpret: bool = False, *, block_rows: int | None = None,
                        chunk_blocks: int | None = None, num_warps: int | None = None, convert: str = "native",
                        poison=None):
    """x [..., K] -> (e4m3 [..., K], f32 power-of-two scales [..., ceil(K/128)]), bit-identical to
    `quantize_fp8_reference(x)`. chunk_blocks = 128-blocks per program; poison (tests) = initial
    (q [M, K/128, 128] (e4m3, or uint8 for convert="bits"), scales [M, K/128] f32) buffers, for unpadded 2-D x."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if x2.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        x2 = x2.astype(_F32)
    pad = -k % FP8_BLOCK
    if pad:
        x2 = jnp.pad(x2, ((0, 0), (0, pad)))
    nb = x2.shape[1] // FP8_BLOCK
    native = convert == "native"
    large = m >= 256          # defaults measured on the H200 (docs/kernels_quantize.md)
    cb = pow2_divisor(nb, chunk_blocks or (16 if large else 8))
    bm = pow2_divisor(m, block_rows or (4 if large else max(1, 64 // cb)))
    num_warps = num_warps or (8 if large else 4)
    qdt = jnp.float8_e4m3fn if native else jnp.uint8
    spec = pl.BlockSpec((bm, cb, FP8_BLOCK), lambda i, j: (i, j, 0))
    q, s = _call(functools.partial(_fp8_kernel, exact_asm=not interpret, native=native), (m // bm, nb // cb),
                 [spec], [spec, pl.BlockSpec((bm, cb), lambda i, j: (i, j))],
                 [jax.ShapeDtypeStruct((m, nb, FP8_BLOCK), qdt), jax.ShapeDtypeStruct((m, nb), _F32)],
                 (x2.reshape(m, nb, FP8_BLOCK),), poison, interpret, num_warps, "fp8_quantize")
    if not native:
        q = lax.bitcast_convert_type(q, jnp.float8_e4m3fn)
    return q.reshape(m, -1)[:, :k].reshape(*lead, k), s.reshape(*lead, nb)
