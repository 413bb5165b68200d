// The decode GEMV skeleton shared by the weight formats (fp4_gemv.cu, fp8_gemv.cu):
//   y[m, n] = sum_k x[m, k] * W[n, k] for M <= 8 bf16 activation rows, W in a quantized format read as stored.
//
// Tensor cores: mma.sync m16n8k16 (bf16 in, float32 accumulate) with 16 weight rows as the A operand and the
// M <= 8 activation rows as the 8 columns of B. A dot product does not care in which order k is summed, so each
// thread (lane = 4 g + q) owns one contiguous run of 32 inputs per 128-input step, for weight rows g and g + 8 of
// each 16-row tile; the format decodes its bytes into bf16 pairs in whatever order is cheapest and builds the
// matching B pairs from the same 32 activations (Format::mma below).
//
// Schedule: one CTA of kWarps warps per kTiles x 16 output rows; warp w takes the 128-input steps
// w, w + kWarps, ...; kUnroll steps' loads are issued before any of them is consumed (bytes in flight hide DRAM
// latency); the kWarps partial tiles are summed through shared memory. kTiles > 1 shares each activation load
// and B fragment between tiles. One launch, no atomics (deterministic), no allocation, no host sync:
// command-buffer compatible.
//
// Routed experts (MoE decode): a second grid axis over slots; slot s multiplies its M activation rows
// x[s, 0:M, :] by expert slot_expert[s] of the stacked weight [E, N, K] and writes y[s, 0:M, :]; slots with
// expert -1 write nothing. A dense matmul is one slot with expert 0.
//
// A Format provides:
//   struct Weights                                device pointers of one [E or 1, N, K] weight (+ scales)
//   struct Tile                                   registers of one step of one 16-row tile for one thread
//   static Tile load(const Weights&, int expert, int row, int k0, int n, int k)   rows `row` and `row + 8`
//   static void mma(const Tile&, const uint32_t (&x)[16], float (&c)[4])          x: the thread's 32 inputs
//   static float epilogue(const Weights&, int expert)                              factor applied to each sum
#pragma once

#include <cstdint>
#include <string>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace dsv4 {

constexpr int kStep = 128;          // inputs per warp step: 4 quad lanes x 32
constexpr int kMaxRows = 8;         // activation rows (the mma's N = 8)

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

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <class Format, int kWarps, int kTiles, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
gemv_kernel(const uint16_t* __restrict__ x, typename Format::Weights w, const int32_t* __restrict__ slot_expert,
            float* __restrict__ y, int m_rows, int n, int k) {
  constexpr int kRows = 16 * kTiles;
  __shared__ float partial[kWarps][kRows][kMaxRows];
  const int expert = slot_expert[blockIdx.y];              // dense: one slot, expert 0
  if (expert < 0) return;                                  // unused slot (uniform over the CTA)
  x += static_cast<size_t>(blockIdx.y) * m_rows * k;
  y += static_cast<size_t>(blockIdx.y) * m_rows * n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;                    // fragment row group, quad lane
  const int row_base = blockIdx.x * kRows;
  const bool has_x = g < m_rows;                           // B column g is activation row g
  const uint16_t* x_row = x + static_cast<size_t>(has_x ? g : 0) * k;
  const int steps = k / kStep;

  float c[kTiles][4] = {};
  for (int base = warp; base < steps; base += kWarps * kUnroll) {
    typename Format::Tile tile[kUnroll][kTiles];
    uint32_t xs[kUnroll][16];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int step = base + u * kWarps;
      if (step < steps) {
        const int k0 = step * kStep + q * 32;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) tile[u][t] = Format::load(w, expert, row_base + 16 * t + g, k0, n, k);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 v = has_x ? load16(x_row + k0 + 8 * i) : make_uint4(0, 0, 0, 0);
          xs[u][4 * i] = v.x, xs[u][4 * i + 1] = v.y, xs[u][4 * i + 2] = v.z, xs[u][4 * i + 3] = v.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kWarps < steps) {
#pragma unroll
        for (int t = 0; t < kTiles; ++t) Format::mma(tile[u][t], xs[u], c[t]);
      }
    }
  }
  // c[t][0], c[t][1]: weight row 16t + g, activation rows 2q, 2q + 1; c[t][2], c[t][3]: weight row 16t + g + 8.
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    partial[warp][16 * t + g][2 * q] = c[t][0];
    partial[warp][16 * t + g][2 * q + 1] = c[t][1];
    partial[warp][16 * t + g + 8][2 * q] = c[t][2];
    partial[warp][16 * t + g + 8][2 * q + 1] = c[t][3];
  }
  __syncthreads();
  const float factor = Format::epilogue(w, expert);
  for (int e = threadIdx.x; e < kRows * kMaxRows; e += kWarps * 32) {
    const int r = e % kRows, mcol = e / kRows;             // consecutive threads: consecutive outputs
    if (mcol < m_rows) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) sum += partial[v][r][mcol];
      y[static_cast<size_t>(mcol) * n + row_base + r] = sum * factor;
    }
  }
}

// Schedules the benchmarks compare (ffi attribute `schedule` = 100 warps + 10 tiles + unroll); 0 = the default.
constexpr int kDefaultSchedule = 811;

template <class Format>
xla::ffi::Error launch_gemv(cudaStream_t stream, int schedule, const uint16_t* x, const typename Format::Weights& w,
                            const int32_t* slot_expert, int slots, float* y, int m_rows, int n, int k,
                            const char* name) {
  using xla::ffi::Error;
  if (schedule == 0) schedule = kDefaultSchedule;
  const int tiles = schedule / 10 % 10;
  if (tiles < 1 || n % (16 * tiles) != 0) {
    return Error::InvalidArgument(std::string(name) + ": N must be a multiple of 16 x tiles of the schedule");
  }
  const dim3 grid(static_cast<unsigned>(n / (16 * tiles)), static_cast<unsigned>(slots));
  switch (schedule) {
#define DSV4_SCHEDULE(W, T, U)                                                                          \
  case W * 100 + T * 10 + U:                                                                            \
    gemv_kernel<Format, W, T, U><<<grid, W * 32, 0, stream>>>(x, w, slot_expert, y, m_rows, n, k);     \
    break;
    DSV4_SCHEDULE(8, 1, 1)
    DSV4_SCHEDULE(8, 1, 2)
    DSV4_SCHEDULE(8, 1, 4)
    DSV4_SCHEDULE(8, 2, 1)
    DSV4_SCHEDULE(8, 2, 2)
    DSV4_SCHEDULE(4, 1, 4)
    DSV4_SCHEDULE(4, 2, 2)
    DSV4_SCHEDULE(4, 2, 4)
#undef DSV4_SCHEDULE
    default:
      return Error::InvalidArgument(std::string(name) + ": unknown schedule " + std::to_string(schedule));
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return Error::Success();
}

}  // namespace dsv4
