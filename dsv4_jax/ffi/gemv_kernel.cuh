// The decode GEMV skeleton shared by the weight formats (fp4_gemv.cu, fp8_gemv.cu):
//   y[m, n] = sum_k x[m, k] * W[n, k] for M <= 8 bf16 activation rows, W in a quantized format read as stored.
//
// Tensor cores: mma.sync m16n8k16 (bf16 in, float32 accumulate) with 16 weight rows as the A operand and the
// M <= 8 activation rows as the 8 columns of B. A dot product does not care in which order k is summed, so each
// thread (lane = 4 g + q) owns one contiguous run of 32 inputs per 128-input step, for weight rows g and g + 8 of
// each 16-row tile; the format decodes its bytes into bf16 pairs in whatever order is cheapest and builds the
// matching B pairs from the same 32 activations (Format::mma below).
//
// Schedule: a CTA of kWarps warps computes kTiles x 16 output rows at a time; warp w takes the 128-input steps
// w, w + kWarps, ...; kUnroll steps' loads are issued before any of them is consumed; the kWarps partial tiles
// are summed through shared memory. kTiles > 1 shares each activation load and B fragment between tiles.
// Other walks (enum Mode): persistent schedules run as many CTAs as fit, each looping over tiles and
// bulk-prefetching the next tile's weight bytes into L2 while it computes the current one; streamed schedules give
// each warp a contiguous run of steps and load with an L2::256B hint; pipelined schedules load a warp's next step
// before computing the current one. kMinBlocks caps the registers for that many CTAs per SM. One launch, no atomics
// (deterministic), no allocation, no host sync: command-buffer compatible.
//
// Slots (grouped matmuls, routed experts): the work items are (slot, 16 kTiles-row tile) pairs; slot s
// multiplies its M activation rows x[s, 0:M, :] by expert slot_expert[s] of the stacked weight [E, N, K] and
// writes y[s, 0:M, :]; slots with expert -1 write nothing. A dense matmul is one slot with expert 0.
//
// Weight sets (kSets = 2: a gate and an up projection in one launch): kSets weights of one format and shape
// [E, N, K] times the same activation rows; an item computes its tile rows of every set, so each activation load
// and B fragment serves all of them (as kTiles > 1 does), and the outputs lie side by side: y [S, M, kSets N].
// Concatenated weights (kConcat, kSets = 2): two weights of one format and K but their own N (N and N2), e.g. the
// attention's wq_a and wkv, which read the same activations: an item is a tile of one of them, y [S, M, N + N2].
// More items than a pair for the same weights, none waits for another weight's rows: for small matrices, whose
// time is latency, one launch instead of two.
//
// A Format provides:
//   kAllSchedules                                 false: only the schedules of compiled_for (a variant on trial)
//   kStageable                                    true: the staged schedules too, with
//     static size_t stage_bytes(int k)            shared-memory bytes of one 16-row tile
//     static void tile_pieces(const Weights&, int expert, int row0, int n, int k, const uint8_t* (&src)[2],
//                             uint32_t (&bytes)[2])  the tile's bytes as <= 2 contiguous pieces (16-byte multiples)
//     static Tile load_staged(const uint8_t* tile, int g, int k0, int k)    rows g and g + 8 from a staged tile
//   struct Weights                                device pointers of one [E or 1, N, K] weight (+ scales)
//   struct Tile                                   registers of one step of one 16-row tile for one thread
//   template <bool kStream>                       rows `row` and `row + 8`, weight bytes through load_weight16
//   static Tile load(const Weights&, int expert, int row, int k0, int n, int k)
//   static void mma(const Tile&, const uint32_t (&x)[16], float (&c)[4])          x: the thread's 32 inputs
//   static float epilogue(const Weights&, int expert)                              factor applied to each sum
//   static void prefetch(const Weights&, int expert, int row, int rows, int n, int k, int part, int parts)
//                                                 L2 prefetch of part `part` / `parts` of rows row .. row + rows
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <cuda_bf16.h>
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

// An output element: float32 as accumulated, or rounded to bf16 (to nearest even, as XLA's convert of the float32
// output would round it) so that a bf16 consumer needs no cast kernel of its own.
__device__ __forceinline__ void store_output(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_output(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// A weight load of the streamed schedules: read once, so not kept in L1 (where the activations are re-read by the
// other tiles' CTAs), and the whole 256-byte L2 sector group around it fetched from DRAM at once: a warp that walks
// its own contiguous run of a row finds its next steps already in L2, which puts more bytes in flight than the
// registers of the loads themselves could hold.
template <bool kStream>
__device__ __forceinline__ uint4 load_weight16(const void* p) {
  if constexpr (kStream) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
  } else {
    return load16(p);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(p), "r"(bytes) : "memory");
}

// Bulk L2 prefetch (no registers, no shared memory) of part `part` of `parts` of a 16-byte aligned region.
__device__ __forceinline__ void prefetch_part(const uint8_t* base, size_t bytes, int part, int parts) {
  const size_t chunk = (bytes / parts + 15) / 16 * 16;
  const size_t begin = chunk * part;
  if (begin < bytes) prefetch_l2(base + begin, static_cast<uint32_t>(bytes - begin < chunk ? bytes - begin : chunk));
}

// Barrier over the kThreads threads 0 .. kThreads - 1 (named barrier 1), or over the whole CTA (kThreads = 0).
template <int kThreads>
__device__ __forceinline__ void sync_threads() {
  if constexpr (kThreads == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 1, %0;" : : "n"(kThreads) : "memory");
  }
}

// The weights of one call: kSets weights of one format and shape (see "Weight sets" above).
template <class Weights, int kSets>
struct WeightSets {
  Weights set[kSets];
};

// Set s (0 or 1, known at run time) of a WeightSets, without indexing the kernel parameter by a run-time value.
template <class Weights, int kSets>
__device__ __forceinline__ const Weights& pick_set(const WeightSets<Weights, kSets>& w, int s) {
  if constexpr (kSets == 1) {
    return w.set[0];
  } else {
    return s ? w.set[1] : w.set[0];
  }
}

// The second weight of a pair must have the first's shapes (its bytes and its scales); "" or an error message.
inline std::string check_pair_shapes(const std::string& name, xla::ffi::Buffer<xla::ffi::U8>& bytes,
                                     xla::ffi::Buffer<xla::ffi::U8>& scale, xla::ffi::Buffer<xla::ffi::U8>& bytes2,
                                     xla::ffi::Buffer<xla::ffi::U8>& scale2) {
  const auto same = [](auto a, auto b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) return false;
    }
    return true;
  };
  if (!same(bytes.dimensions(), bytes2.dimensions()) || !same(scale.dimensions(), scale2.dimensions())) {
    return name + ": the two weights of a pair must have the same shapes";
  }
  return "";
}

// Sums the kWarps partial tiles of a CTA through shared memory and writes rows row_base .. row_base + 16 kTiles
// of each set's columns of y_slot [m_rows, row_stride] (row_stride 0: kSets n; set s at column s n), times the
// set's epilogue factor. Ends with a barrier (over the CTA, or over threads 0 .. kBarrierThreads - 1 when a
// producer warp does not take part): `partial` is free again. Tile t of c is tile t % kTiles of set t / kTiles.
template <class Format, int kWarps, int kTiles, int kSets, int kBarrierThreads = 0, class OutT = float>
__device__ __forceinline__ void store_tiles(float (&partial)[kWarps][16 * kTiles * kSets][kMaxRows],
                                            const float (&c)[kTiles * kSets][4],
                                            const WeightSets<typename Format::Weights, kSets>& w, int expert,
                                            OutT* y_slot, int m_rows, int n, int row_base, int row_stride = 0) {
  constexpr int kRows = 16 * kTiles, kAllRows = kRows * kSets;
  if (row_stride == 0) row_stride = kSets * n;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  // c[t][0], c[t][1]: weight row 16t + g, activation rows 2q, 2q + 1; c[t][2], c[t][3]: row 16t + g + 8.
#pragma unroll
  for (int t = 0; t < kTiles * kSets; ++t) {
    partial[warp][16 * t + g][2 * q] = c[t][0];
    partial[warp][16 * t + g][2 * q + 1] = c[t][1];
    partial[warp][16 * t + g + 8][2 * q] = c[t][2];
    partial[warp][16 * t + g + 8][2 * q + 1] = c[t][3];
  }
  sync_threads<kBarrierThreads>();
  float factor[kSets];
#pragma unroll
  for (int s = 0; s < kSets; ++s) factor[s] = Format::epilogue(w.set[s], expert);
  for (int e = threadIdx.x; e < kAllRows * kMaxRows; e += kWarps * 32) {
    const int r = e % kAllRows, mcol = e / kAllRows;       // consecutive threads: consecutive outputs
    if (mcol < m_rows) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) sum += partial[v][r][mcol];
      const int set = r / kRows;
      store_output(y_slot + static_cast<size_t>(mcol) * row_stride + set * n + row_base + r % kRows,
                   sum * factor[set]);
    }
  }
  sync_threads<kBarrierThreads>();
}

// The thread's 32 activations of one step. Lanes whose B column has no activation row (g >= M) read row 0 again
// instead of zeros: an mma's output column depends on its own B column only, and those columns are never stored,
// so no predicate or zeroing is needed (13-20 fewer instructions per step than zero-filling, SASS of sm_90a).
__device__ __forceinline__ void load_x(const uint16_t* x_row, int k0, uint32_t (&xs)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = load16(x_row + k0 + 8 * i);
    xs[4 * i] = v.x, xs[4 * i + 1] = v.y, xs[4 * i + 2] = v.z, xs[4 * i + 3] = v.w;
  }
}

// How a CTA walks its work (the P digit of a schedule).
enum Mode : int {
  kDirect = 0,       // one item per CTA; warp w takes the steps w, w + kWarps, ... (the CTA reads each row in
                     // sweeps of kWarps consecutive steps: kWarps x 64 contiguous bytes for FP4, x 128 for FP8)
  kPersistent = 1,   // CTAs loop over items and bulk-prefetch the next item's weight bytes into L2
  kStreamed = 2,     // one item per CTA; warp w takes its own contiguous run of steps, weight loads carry the
                     // L2::256B hint (load_weight16) so each warp's next steps are on their way to L2
  kPipelined = 3,    // as kDirect, but each warp loads the weights of its next step before it computes the
                     // current one (one step of weights in registers while waiting: the DRAM latency is hidden
                     // behind the previous step's math instead of the other warps' alone)
  kStaged = 4,       // warp-specialized (gemv_staged_kernel): a producer warp copies whole 16-row tiles into a ring
                     // of shared-memory stages with bulk async copies (TMA, no registers), kWarps consumer warps
                     // decode from shared memory; persistent CTAs (Formats with kStageable only)
};

// One work item = one (slot, tile of kRows output rows); CTAs loop over items (a grid smaller than the work is a
// persistent schedule). kPersistent: each warp bulk-prefetches its share of the next item's weight bytes into L2
// before computing the current one, so DRAM keeps a deep queue without registers held for loads in flight.
// kMinBlocks > 1 caps the registers so that many CTAs fit on an SM (more loads in flight; may spill).
template <class Format, int kWarps, int kTiles, int kUnroll, int kMode, int kMinBlocks, int kSets, bool kConcat,
          class OutT>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
gemv_kernel(const uint16_t* __restrict__ x, WeightSets<typename Format::Weights, kSets> w,
            const int32_t* __restrict__ slot_expert, OutT* __restrict__ y, int m_rows, int n, int k, int items,
            int n2) {
  static_assert(!kConcat || (kSets == 2 && kMode == kDirect), "concatenated weights: two sets, direct loads");
  constexpr int kItemSets = kConcat ? 1 : kSets;                // weight sets one item computes
  constexpr int kRows = 16 * kTiles, kAll = kTiles * kItemSets;  // kAll tiles per item: tile t of set t / kTiles
  constexpr bool kPrefetch = kMode == kPersistent, kStream = kMode == kStreamed;
  __shared__ float partial[kWarps][kRows * kItemSets][kMaxRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;                    // fragment row group, quad lane
  const int tiles_first = n / kRows;                       // items per slot: tiles of the first set (a pair: both)
  const int tiles = kConcat ? tiles_first + n2 / kRows : tiles_first, steps = k / kStep;
  const bool has_x = g < m_rows;                           // B column g is activation row g (else row 0, unused)
  // this warp's steps: first, first + stride, ... < last
  const int per_warp = (steps + kWarps - 1) / kWarps;
  const int first = kStream ? warp * per_warp : warp, stride = kStream ? 1 : kWarps;
  const int last = kStream ? min(steps, first + per_warp) : steps;
  // rows row .. row + kRows of every set, into L2
  auto prefetch = [&](int expert, int row) {
#pragma unroll
    for (int s = 0; s < kSets; ++s) Format::prefetch(w.set[s], expert, row, kRows, n, k, warp, kWarps);
  };
  // rows g and g + 8 of the item's tile t (tile t % kTiles of set t / kTiles; concatenated: of set `second`) at k0
  auto load_tile = [&](auto stream, int expert, int row_base, int t, int k0, int second) {
    if constexpr (kConcat) {
      return Format::template load<decltype(stream)::value>(pick_set(w, second), expert,
                                                            row_base + 16 * (t % kTiles) + g, k0, second ? n2 : n, k);
    } else {
      return Format::template load<decltype(stream)::value>(w.set[t / kTiles], expert,
                                                            row_base + 16 * (t % kTiles) + g, k0, n, k);
    }
  };
  if (kPrefetch && lane == 0 && slot_expert[blockIdx.x / tiles] >= 0) {
    prefetch(slot_expert[blockIdx.x / tiles], blockIdx.x % tiles * kRows);
  }
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / tiles, tile = item % tiles;
    const int second = kConcat && tile >= tiles_first;     // concatenated: the item is a tile of the second weight
    const int row_base = (tile - second * tiles_first) * kRows;
    const int expert = slot_expert[slot];                  // dense: one slot, expert 0
    if (kPrefetch && lane == 0 && item + gridDim.x < items) {
      const int next = item + gridDim.x, next_expert = slot_expert[next / tiles];
      if (next_expert >= 0) prefetch(next_expert, next % tiles * kRows);
    }
    if (expert < 0) continue;                              // unused slot (uniform over the CTA)
    const uint16_t* x_row = x + (static_cast<size_t>(slot) * m_rows + (has_x ? g : 0)) * k;

    float c[kAll][4] = {};
    if constexpr (kMode == kPipelined) {
      static_assert(kUnroll == 1, "pipelined schedules prefetch one step instead of unrolling");
      // two tiles in turn (no register copies): load step s + 1 into one while computing step s from the other
      typename Format::Tile even[kAll], odd[kAll];
      auto load_step = [&](typename Format::Tile (&tile)[kAll], int step) {
#pragma unroll
        for (int t = 0; t < kAll; ++t) {
          tile[t] = load_tile(std::false_type{}, expert, row_base, t, step * kStep + q * 32, second);
        }
      };
      auto compute_step = [&](const typename Format::Tile (&tile)[kAll], int step) {
        uint32_t xs[16];
        load_x(x_row, step * kStep + q * 32, xs);
#pragma unroll
        for (int t = 0; t < kAll; ++t) Format::mma(tile[t], xs, c[t]);
      };
      if (first < last) load_step(even, first);
      for (int step = first; step < last; step += 2 * stride) {
        if (step + stride < last) load_step(odd, step + stride);
        compute_step(even, step);
        if (step + stride >= last) break;
        if (step + 2 * stride < last) load_step(even, step + 2 * stride);
        compute_step(odd, step + stride);
      }
    } else {
      for (int base = first; base < last; base += stride * kUnroll) {
        typename Format::Tile tile[kUnroll][kAll];
        uint32_t xs[kUnroll][16];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int step = base + u * stride;
          if (step < last) {
            const int k0 = step * kStep + q * 32;
#pragma unroll
            for (int t = 0; t < kAll; ++t) {
              tile[u][t] = load_tile(std::bool_constant<kStream>{}, expert, row_base, t, k0, second);
            }
            load_x(x_row, k0, xs[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * stride < last) {
#pragma unroll
            for (int t = 0; t < kAll; ++t) Format::mma(tile[u][t], xs[u], c[t]);
          }
        }
      }
    }
    if constexpr (kConcat) {
      OutT* y_slot = y + static_cast<size_t>(slot) * m_rows * (n + n2) + second * n;
      store_tiles<Format, kWarps, kTiles, 1>(partial, c, WeightSets<typename Format::Weights, 1>{{pick_set(w, second)}},
                                             expert, y_slot, m_rows, n, row_base, n + n2);
    } else {
      OutT* y_slot = y + static_cast<size_t>(slot) * m_rows * kSets * n;
      store_tiles<Format, kWarps, kTiles, kSets>(partial, c, w, expert, y_slot, m_rows, n, row_base);
    }
  }
}

// The staged schedules' kernel and launcher (gemv_staged.cuh) use the pieces above; the schedule table below
// dispatches to them.
}  // namespace dsv4

#include "gemv_staged.cuh"

namespace dsv4 {

// Schedules (ffi attribute `schedule` = 10000 B + 1000 P + 100 warps + 10 tiles + unroll; P: the Mode, B: the
// minimum CTAs per SM the registers are capped for (0: the compiler's choice; staged: CTAs per SM, 0 = 1); warps
// digit 0 = 16 warps); 0 = the default.
// Measured on the H200 (docs/kernels.md, benchmarks/bench_ffi.py): 811 is the fastest or within ~5-10% on every
// large shape; the persistent, streamed, register-capped and pipelined schedules win a few percent on one shape
// and lose as much or more on another; the staged ones run at 0.46-0.96x of it; unroll > 1 costs occupancy
// (registers); a per-thread cp.async shared-memory ring (3-6 stages, since removed) was 11% to 2.5x slower.
// Routed experts (ffi.moe_gemv) default to 411 instead (ffi/__init__.py, ROUTED_SCHEDULE), and calls of at most one
// wave of tiles to 11 (16 warps: ffi.default_schedule).
constexpr int kDefaultSchedule = 811;

template <class Format, int W, int T, int U, int P, int B, int kSets, bool kConcat, class OutT>
xla::ffi::Error launch_one(cudaStream_t stream, const uint16_t* x, const WeightSets<typename Format::Weights, kSets>& w,
                           const int32_t* slot_expert, int slots, OutT* y, int m_rows, int n, int k, int n2) {
  auto kernel = gemv_kernel<Format, W, T, U, P, B, kSets, kConcat, OutT>;
  const int items = slots * ((kConcat ? n + n2 : n) / (16 * T));
  int grid = items;
  if (P == kPersistent) {                                  // as many CTAs as fit at once
    static int resident = 0;                               // per instantiation, computed once per process
    if (resident == 0) {
      int device = 0, sms = 0, per_sm = 0;
      cudaGetDevice(&device);
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, W * 32, 0);
      resident = sms * (per_sm > 0 ? per_sm : 1);
    }
    grid = items < resident ? items : resident;
  }
  kernel<<<grid, W * 32, 0, stream>>>(x, w, slot_expert, y, m_rows, n, k, items, n2);
  return xla::ffi::Error::Success();
}

// The ffi attribute value of a schedule (16 warps: digit 0).
constexpr int schedule_code(int b, int p, int w, int t, int u) {
  return b * 10000 + p * 1000 + w % 16 * 100 + t * 10 + u;
}

// Schedules compiled for a Format: all of them, or (Format::kAllSchedules false: a variant being measured) the
// default and the few that won somewhere in the sweeps; for two weight sets or a bf16 output (one FP8 weight's
// handler) the defaults only (ffi/__init__.py: PAIR_SCHEDULES, BF16_OUTPUT_SCHEDULES).
template <class Format, int kSets, bool kConcat = false, class OutT = float>
constexpr bool compiled_for(int schedule) {
  if (kConcat) return schedule == kDefaultSchedule || schedule == 11;
  if (kSets > 1 || !std::is_same_v<OutT, float>) {
    return schedule == kDefaultSchedule || schedule == 411 || schedule == 11;
  }
  if (schedule / 1000 % 10 == kStaged) return Format::kStageable;
  return Format::kAllSchedules || schedule == kDefaultSchedule || schedule == 411 || schedule == 11 ||
         schedule == 814 || schedule == 43811 || schedule == 83411;   // 411, 11: ffi's other defaults
}

// kConcat: the two sets are concatenated weights of N and n2 rows (else n2 is unused). OutT: float or __nv_bfloat16.
template <class Format, int kSets, bool kConcat = false, class OutT = float>
xla::ffi::Error launch_gemv(cudaStream_t stream, int schedule, const uint16_t* x,
                            const WeightSets<typename Format::Weights, kSets>& w, const int32_t* slot_expert, int slots,
                            OutT* y, int m_rows, int n, int k, const char* name, int n2 = 0) {
  using xla::ffi::Error;
  if (schedule == 0) schedule = kDefaultSchedule;
  const int tiles = schedule / 10 % 10;
  if (tiles < 1 || n % (16 * tiles) != 0 || (kConcat && n2 % (16 * tiles) != 0)) {
    return Error::InvalidArgument(std::string(name) + ": N must be a multiple of 16 x tiles of the schedule");
  }
  Error launched = Error::InvalidArgument(std::string(name) + ": unknown schedule " + std::to_string(schedule));
  switch (schedule) {
#define DSV4_SCHEDULE(B, P, W, T, U)                                                                      \
  case schedule_code(B, P, W, T, U):                                                                      \
    if constexpr (compiled_for<Format, kSets, kConcat, OutT>(schedule_code(B, P, W, T, U))) {             \
      if constexpr (P == kStaged) {                                                                       \
        launched = launch_staged<Format, W, (B > 0 ? B : 1)>(stream, x, w.set[0], slot_expert, slots, y,  \
                                                              m_rows, n, k, name);                        \
      } else {                                                                                            \
        launched = launch_one<Format, W, T, U, P, B, kSets, kConcat, OutT>(stream, x, w, slot_expert,     \
                                                                           slots, y, m_rows, n, k, n2);   \
      }                                                                                                   \
    }                                                                                                     \
    break;
    DSV4_SCHEDULE(0, 0, 8, 1, 1)
    DSV4_SCHEDULE(0, 0, 8, 2, 1)
    DSV4_SCHEDULE(0, 0, 4, 1, 1)
    DSV4_SCHEDULE(0, 0, 8, 1, 2)
    DSV4_SCHEDULE(0, 0, 8, 1, 4)
    DSV4_SCHEDULE(0, 0, 4, 1, 4)
    DSV4_SCHEDULE(0, 0, 16, 1, 1)
    DSV4_SCHEDULE(0, 0, 16, 1, 2)
    DSV4_SCHEDULE(0, 1, 8, 1, 1)
    DSV4_SCHEDULE(0, 2, 8, 1, 1)
    DSV4_SCHEDULE(0, 2, 4, 1, 1)
    DSV4_SCHEDULE(5, 0, 8, 1, 1)
    DSV4_SCHEDULE(4, 3, 8, 1, 1)
    DSV4_SCHEDULE(0, 3, 4, 1, 1)
    DSV4_SCHEDULE(8, 3, 4, 1, 1)
    DSV4_SCHEDULE(0, 4, 8, 1, 1)
    DSV4_SCHEDULE(2, 4, 8, 1, 1)
    DSV4_SCHEDULE(0, 4, 4, 1, 1)
    DSV4_SCHEDULE(2, 4, 16, 1, 1)
    DSV4_SCHEDULE(0, 4, 16, 1, 1)
#undef DSV4_SCHEDULE
    default:
      break;
  }
  if (launched.failure()) return launched;
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return Error::Success();
}

}  // namespace dsv4

// The XLA FFI binding every GEMV handler shares (ffi/__init__.py passes the operands in this order): the stream,
// x bf16, the weight buffers (WEIGHT_ARGS: one weight's, or a pair's twice), the int32 expert ids, the
// output (float32; DSV4_GEMV_HANDLER_OUT: another type) and the "schedule" attribute, then EXTRA_ATTRS.
// Command-buffer compatible: no host work, no sync.
#define DSV4_GEMV_HANDLER(SYMBOL, IMPL, WEIGHT_ARGS, EXTRA_ATTRS)                                         \
  DSV4_GEMV_HANDLER_OUT(SYMBOL, IMPL, WEIGHT_ARGS, EXTRA_ATTRS, F32)
// The same with the output in OUT_TYPE (F32 or BF16).
#define DSV4_GEMV_HANDLER_OUT(SYMBOL, IMPL, WEIGHT_ARGS, EXTRA_ATTRS, OUT_TYPE)                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYMBOL, IMPL,                                                             \
                                xla::ffi::Ffi::Bind()                                                     \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                        \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>() WEIGHT_ARGS                  \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                               \
                                    .Ret<xla::ffi::Buffer<xla::ffi::OUT_TYPE>>()                          \
                                    .Attr<int32_t>("schedule") EXTRA_ATTRS,                               \
                                {xla::ffi::Traits::kCmdBufferCompatible})
// One weight's buffers: packed bytes (or e4m3 values) u8 and block scales u8, plus NVFP4's f32 global scale.
#define DSV4_U8_WEIGHT_ARGS .Arg<xla::ffi::Buffer<xla::ffi::U8>>().Arg<xla::ffi::Buffer<xla::ffi::U8>>()
#define DSV4_NVFP4_WEIGHT_ARGS DSV4_U8_WEIGHT_ARGS.Arg<xla::ffi::Buffer<xla::ffi::F32>>()
