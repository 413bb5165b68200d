// MXFP4 decode GEMV through XLA FFI: y[m, n] = sum_k x[m, k] * dequant(W)[n, k] for M <= 8 activation rows.
//
//   x       bf16 [M, K]            activations, row-major (M <= 8)
//   packed  u8   [N, K / 2]        e2m1 pairs, low nibble = even k (the checkpoint layout, read as stored)
//   scale   u8   [N, K / 32]       E8M0 exponents, one per 32 consecutive k
//   y       f32  [M, N]
//
// Tensor cores: mma.sync m16n8k16 (bf16 in, f32 accumulate) with 16 weight rows as the A operand and the M <= 8
// activation rows as the 8 columns of B. A dot product does not care in which order k is summed, so each thread
// owns one whole 32-input scale block per row and step (16 contiguous bytes: one 128-bit load, one scale byte)
// and feeds its values to the fragment slots in the order the nibble decode produces them; the activations are
// permuted the same way when the B fragments are built. Per 32-bit word of packed weights (8 nibbles):
//
//   r0 = ((w      & 0x000F000F) * 0x1040) & 0x81C081C0     nibbles 0 and 4 as bf16 pair (value * 2^-126)
//   r1 = ((w      & 0x00F000F0) * 0x0104) & 0x81C081C0     nibbles 1 and 5
//   r2 = (((w>>8) & 0x000F000F) * 0x1040) & 0x81C081C0     nibbles 2 and 6
//   r3 = (((w>>8) & 0x00F000F0) * 0x0104) & 0x81C081C0     nibbles 3 and 7
//
// (the same constants as pallas_kernels/gemv.py, checked there for every byte), each times the block factor
// 2^(s - 1 - 32) in bf16 (exact: at most 2 significant bits times a power of two), 2^32 taken back at the end.
// Word t feeds MMA 2t with (r0, r1) and MMA 2t+1 with (r2, r3); the B pairs are (x[8t], x[8t+4]),
// (x[8t+1], x[8t+5]), (x[8t+2], x[8t+6]), (x[8t+3], x[8t+7]) relative to the thread's block.
//
// Schedule: one CTA of 8 warps per 16 output rows; warp w takes the 128-input steps w, w + 8, ...; the 8 partial
// 16 x 8 tiles are summed through shared memory and warp 0 writes the M valid columns. One launch, no atomics
// (deterministic), no allocation, no host sync: command-buffer compatible.
//
// Exactness: scales with 2^-99 <= 2^(s-127) <= 2^33 (every real checkpoint) are exact; the 0xFF NaN scale is not
// handled. Status: compiled for sm_90a; see ffi/README.md for what has been run where.

#include <cstdint>
#include <string>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerCta = 16;
constexpr int kStep = 128;          // inputs per warp step: 4 threads x one 32-block each
constexpr int kMaxRows = 8;         // activation rows (the mma's N = 8)
constexpr int kMxShift = 32;

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four bf16 pairs (r0..r3 above) of one 32-bit word of packed nibbles, times the block factor.
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t factor, uint32_t (&r)[4]) {
  const uint32_t mask = 0x81C081C0u;
  const uint32_t v = w >> 8;
  r[0] = bf16x2_mul(((w & 0x000F000Fu) * 0x1040u) & mask, factor);
  r[1] = bf16x2_mul(((w & 0x00F000F0u) * 0x0104u) & mask, factor);
  r[2] = bf16x2_mul(((v & 0x000F000Fu) * 0x1040u) & mask, factor);
  r[3] = bf16x2_mul(((v & 0x00F000F0u) * 0x0104u) & mask, factor);
}

// E8M0 byte s -> bf16 2^(s - 1 - kMxShift) in both halves (times the decode's 2^-126 gives 2^(s - 127 - 32)).
__device__ __forceinline__ uint32_t block_factor(uint32_t s) { return (s + 126u - kMxShift) * 0x00800080u; }

__global__ void __launch_bounds__(kWarps * 32)
mxfp4_gemv_kernel(const uint16_t* __restrict__ x, const uint8_t* __restrict__ packed,
                  const uint8_t* __restrict__ scale, float* __restrict__ y, int m_rows, int n, int k) {
  __shared__ float partial[kWarps][kRowsPerCta][kMaxRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;                    // fragment row group, quad lane
  const int row0 = blockIdx.x * kRowsPerCta + g;           // this thread's two weight rows: row0, row0 + 8
  const int steps = k / kStep;
  const size_t row_bytes = k / 2, row_scales = k / 32;
  const uint8_t* w_row0 = packed + row0 * row_bytes;
  const uint8_t* w_row1 = w_row0 + 8 * row_bytes;
  const uint8_t* s_row0 = scale + row0 * row_scales;
  const uint8_t* s_row1 = s_row0 + 8 * row_scales;
  const bool has_x = g < m_rows;                           // B column g is activation row g
  const uint16_t* x_row = x + (has_x ? g : 0) * static_cast<size_t>(k);

  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int step = warp; step < steps; step += kWarps) {
    const int k0 = step * kStep + q * 32;                  // this thread's 32-block
    const uint4 w0 = __ldg(reinterpret_cast<const uint4*>(w_row0 + k0 / 2));
    const uint4 w1 = __ldg(reinterpret_cast<const uint4*>(w_row1 + k0 / 2));
    const uint32_t f0 = block_factor(__ldg(s_row0 + k0 / 32));
    const uint32_t f1 = block_factor(__ldg(s_row1 + k0 / 32));
    uint4 xv[4] = {};
    if (has_x) {
#pragma unroll
      for (int i = 0; i < 4; ++i) xv[i] = __ldg(reinterpret_cast<const uint4*>(x_row + k0) + i);
    }
    const uint32_t wa[4] = {w0.x, w0.y, w0.z, w0.w}, wb[4] = {w1.x, w1.y, w1.z, w1.w};
    const uint32_t xs[16] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w,
                             xv[2].x, xv[2].y, xv[2].z, xv[2].w, xv[3].x, xv[3].y, xv[3].z, xv[3].w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {                          // word t: inputs 8t .. 8t + 7 of the block
      uint32_t ra[4], rb[4];
      decode_word(wa[t], f0, ra);
      decode_word(wb[t], f1, rb);
      const uint32_t x01 = xs[4 * t], x23 = xs[4 * t + 1], x45 = xs[4 * t + 2], x67 = xs[4 * t + 3];
      // B pairs in the decode's order: (x0, x4), (x1, x5), (x2, x6), (x3, x7)
      const uint32_t b04 = __byte_perm(x01, x45, 0x5410), b15 = __byte_perm(x01, x45, 0x7632);
      const uint32_t b26 = __byte_perm(x23, x67, 0x5410), b37 = __byte_perm(x23, x67, 0x7632);
      mma_bf16(c, ra[0], rb[0], ra[1], rb[1], b04, b15);
      mma_bf16(c, ra[2], rb[2], ra[3], rb[3], b26, b37);
    }
  }
  // c[0], c[1]: weight row g, activation rows 2q, 2q + 1; c[2], c[3]: weight row g + 8.
  partial[warp][g][2 * q] = c[0];
  partial[warp][g][2 * q + 1] = c[1];
  partial[warp][g + 8][2 * q] = c[2];
  partial[warp][g + 8][2 * q + 1] = c[3];
  __syncthreads();
  if (warp == 0) {
    const float unshift = 4294967296.0f;                   // 2^kMxShift
#pragma unroll
    for (int e = lane; e < kRowsPerCta * kMaxRows; e += 32) {
      const int r = e / kMaxRows, mcol = e % kMaxRows;
      if (mcol < m_rows) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += partial[w][r][mcol];
        y[static_cast<size_t>(mcol) * n + blockIdx.x * kRowsPerCta + r] = sum * unshift;
      }
    }
  }
}

ffi::Error Mxfp4GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                         ffi::Buffer<ffi::U8> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || pd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("dsv4_mxfp4_gemv: x, packed and scale must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1], n = pd[0];
  if (m < 1 || m > kMaxRows) return ffi::Error::InvalidArgument("dsv4_mxfp4_gemv: 1 <= M <= 8 rows");
  if (k % kStep != 0 || pd[1] * 2 != k || sd[0] != n || sd[1] * 32 != k) {
    return ffi::Error::InvalidArgument("dsv4_mxfp4_gemv: need packed [N, K/2], scale [N, K/32], K % 128 == 0");
  }
  if (n % kRowsPerCta != 0) return ffi::Error::InvalidArgument("dsv4_mxfp4_gemv: N must be a multiple of 16");
  mxfp4_gemv_kernel<<<static_cast<unsigned>(n / kRowsPerCta), kWarps * 32, 0, stream>>>(
      reinterpret_cast<const uint16_t*>(x.typed_data()), packed.typed_data(), scale.typed_data(), y->typed_data(),
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("dsv4_mxfp4_gemv: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DSV4Mxfp4Gemv, Mxfp4GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
