// Staged decode GEMV schedules (Mode kStaged of gemv_kernel.cuh, which includes this file before its schedule
// table): warp specialization with bulk async copies (TMA, 1-D) into a ring of shared-memory stages and mbarrier
// handshakes (sm_90). Measured on the H200 (docs/kernels.md): correct, but 0.46-0.96x of schedule 811: with
// DRAM latency taken off the consumer warps, the consumers' decode, activation reloads and per-tile K-split
// reductions bound it.
// Not self-contained: included by gemv_kernel.cuh only (it uses load_x, store_tiles, kStep, kMaxRows from there).
#pragma once

namespace dsv4 {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" : : "r"(smem_address(bar)), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" : : "r"(smem_address(bar)) : "memory");
}

// Arrives and announces `bytes` of bulk copies that will complete on the barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" : : "r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Waits until the barrier's phase of the given parity has completed (parity 1 on a fresh barrier: at once).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Bulk async copy (TMA, 1-D) of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory; completes on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               : : "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar)) : "memory");
}

constexpr int kMaxStages = 6;

// Warp-specialized GEMV: warp kWarps (the producer; one lane works) walks the CTA's work items and copies each
// item's 16-row weight tile (Format::tile_pieces: up to 2 contiguous pieces, e.g. e2m1 bytes and scales) into the
// next of `stages` shared-memory stages; consumer warps 0 .. kWarps - 1 wait for a stage, take its 128-input steps
// w, w + kWarps, ... (Format::load_staged reads rows g and g + 8 from the stage), free the stage and sum their
// partial tiles (named barrier: the producer runs ahead). Bytes in flight are bounded by shared memory (up to
// ~200 KB per SM) instead of the registers of loads in flight; the consumers never wait on DRAM while a full
// stage is ready. Producer and consumers walk the same item sequence and skip the same unused slots.
template <class Format, int kWarps, int kBlocksPerSm>
__global__ void __launch_bounds__((kWarps + 1) * 32, kBlocksPerSm)
gemv_staged_kernel(const uint16_t* __restrict__ x, typename Format::Weights w, const int32_t* __restrict__ slot_expert,
                   float* __restrict__ y, int m_rows, int n, int k, int items, int stages, uint32_t stage_bytes) {
  extern __shared__ __align__(128) uint8_t smem[];
  auto& partial = *reinterpret_cast<float(*)[kWarps][16][kMaxRows]>(smem + stages * stage_bytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes + sizeof(float) * kWarps * 16 * kMaxRows);
  uint64_t* empty = full + kMaxStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = n / 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);            // the producer's arrive (+ the copies' bytes)
      mbarrier_init(&empty[s], kWarps);      // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" : : : "memory");
  }
  __syncthreads();

  if (warp == kWarps) {                      // producer
    if (lane == 0) {
      int used = 0;
      for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int expert = slot_expert[item / tiles];
        if (expert < 0) continue;
        const int stage = used % stages;
        const uint32_t parity = (used / stages) & 1;
        ++used;
        mbarrier_wait(&empty[stage], parity ^ 1);
        const uint8_t* src[2];
        uint32_t bytes[2];
        Format::tile_pieces(w, expert, item % tiles * 16, n, k, src, bytes);
        mbarrier_arrive_expect_bytes(&full[stage], bytes[0] + bytes[1]);
        uint8_t* dst = smem + stage * stage_bytes;
        bulk_copy_to_shared(dst, src[0], bytes[0], &full[stage]);
        if (bytes[1] > 0) bulk_copy_to_shared(dst + bytes[0], src[1], bytes[1], &full[stage]);
      }
    }
    return;
  }

  const int g = lane / 4, q = lane % 4;
  const int steps = k / kStep;
  const bool has_x = g < m_rows;
  int used = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / tiles, row_base = item % tiles * 16;
    const int expert = slot_expert[slot];
    if (expert < 0) continue;
    const int stage = used % stages;
    const uint32_t parity = (used / stages) & 1;
    ++used;
    const uint16_t* x_row = x + (static_cast<size_t>(slot) * m_rows + (has_x ? g : 0)) * k;
    const uint8_t* tile = smem + stage * stage_bytes;
    float c[1][4] = {};
    mbarrier_wait(&full[stage], parity);
    for (int step = warp; step < steps; step += kWarps) {
      const int k0 = step * kStep + q * 32;
      uint32_t xs[16];
      load_x(x_row, k0, xs);
      Format::mma(Format::load_staged(tile, g, k0, k), xs, c[0]);
    }
    __syncwarp();                              // the warp's reads of the stage are done
    if (lane == 0) mbarrier_arrive(&empty[stage]);
    store_tiles<Format, kWarps, 1, 1, kWarps * 32>(partial, c, WeightSets<typename Format::Weights, 1>{{w}}, expert,
                                                   y + static_cast<size_t>(slot) * m_rows * n, m_rows, n, row_base);
  }
}

template <class Format, int W, int B>
xla::ffi::Error launch_staged(cudaStream_t stream, const uint16_t* x, const typename Format::Weights& w,
                              const int32_t* slot_expert, int slots, float* y, int m_rows, int n, int k,
                              const char* name) {
  using xla::ffi::Error;
  auto kernel = gemv_staged_kernel<Format, W, B>;
  static int sms = 0, smem_per_sm = 0, smem_per_block = 0, smem_set = 0;   // per instantiation, once per process
  if (sms == 0) {
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  const uint32_t stage_bytes = (Format::stage_bytes(k) + 127) / 128 * 128;
  const int fixed = static_cast<int>(sizeof(float)) * W * 16 * kMaxRows + 2 * kMaxStages * 8;
  int budget = smem_per_sm / B - 1024;                    // 1 KB per CTA is reserved by the system
  if (budget > smem_per_block) budget = smem_per_block;
  int stages = (budget - fixed) / static_cast<int>(stage_bytes);
  if (stages > kMaxStages) stages = kMaxStages;
  if (stages < 2) {
    return Error::InvalidArgument(std::string(name) + ": K = " + std::to_string(k) +
                                  " is too large for two shared-memory stages of a staged schedule");
  }
  const int smem = stages * static_cast<int>(stage_bytes) + fixed;
  if (smem > smem_set) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
    smem_set = smem;
  }
  const int items = slots * (n / 16);
  const int grid = items < sms * B ? items : sms * B;
  kernel<<<grid, (W + 1) * 32, smem, stream>>>(x, w, slot_expert, y, m_rows, n, k, items, stages, stage_bytes);
  return Error::Success();
}

}  // namespace dsv4
