// Diagnostic kernels (not used by the model): the decode GEMV skeleton of gemv_kernel.cuh with one side of the
// work taken away, to measure which side limits the FP4 decode GEMV (benchmarks/probe_gemv.py). Their outputs are
// not products: each thread folds what it loaded into its accumulator (so no load is dead code) and the skeleton
// stores the folded values.
//
//   x       bf16 [1, M, Kx]      activations (Kx = K; probe 2: K / 2)
//   packed  u8   [1, N, K / 2]   FP4 bytes (random)
//   scale   u8   [1, N, K / 32]  E8M0 bytes
//   experts s32  [1]             [0]
//   y       f32  [1, M, N]
//
// probe 0  loads only:           the MXFP4 kernel's weight loads (16 bytes of rows g and g + 8 per thread per step)
//                                and activation loads, folded with XOR: the memory side alone
// probe 1  loads + scales:       probe 0 plus the two E8M0 scale-byte loads per thread per step (as Mxfp4::load)
// probe 2  wide loads:           the same matrix bytes read as the FP8 kernel reads its bytes (32 bytes per row per
//                                thread per step, half the steps): does the per-step width matter?
// probe 3  decode only:          the MXFP4 kernel's decode and MMAs (checkpoint nibble order) on weight words made
//                                from the row and step indices, no weight loads: the instruction side alone
// probe 4  decode only, layout:  probe 3 with the GEMV layout's decode

// The production formats (Mxfp4<layout>) for DecodeOnly's mma, included rather than copied so the probe measures
// exactly the production decode. fp4_gemv.cu's handlers are compiled into this diagnostic library too; only the
// probe handler below is registered from it.
#include "fp4_gemv.cu"

namespace dsv4 {
namespace {

struct ProbeWeights { const uint8_t* packed; const uint8_t* scale; };

__device__ __forceinline__ uint32_t fold_x(const uint32_t (&x)[16]) {
  uint32_t v = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) v ^= x[i];
  return v;
}

__device__ __forceinline__ uint32_t fold4(const uint4& a) { return a.x ^ a.y ^ a.z ^ a.w; }

// A finite float from any bits, added so the fold is live.
__device__ __forceinline__ void accumulate(float (&c)[4], uint32_t v) { c[0] += __uint_as_float(v & 0x3F7FFFFFu); }

template <bool kScales>
struct LoadOnly {
  static constexpr bool kAllSchedules = true;
  static constexpr bool kStageable = false;
  using Weights = ProbeWeights;
  struct Tile { uint4 w0, w1; uint32_t s; };

  template <bool kStream>
  static __device__ __forceinline__ Tile load(const Weights& w, int expert, int row, int k0, int n, int k) {
    const size_t r0 = static_cast<size_t>(expert) * n + row;
    Tile t;
    t.w0 = load_weight16<kStream>(w.packed + r0 * (k / 2) + k0 / 2);
    t.w1 = load_weight16<kStream>(w.packed + (r0 + 8) * (k / 2) + k0 / 2);
    t.s = kScales ? __ldg(w.scale + r0 * (k / 32) + k0 / 32) ^ __ldg(w.scale + (r0 + 8) * (k / 32) + k0 / 32) : 0u;
    return t;
  }
  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    accumulate(c, fold4(t.w0) ^ fold4(t.w1) ^ t.s ^ fold_x(x));
  }
  static __device__ __forceinline__ float epilogue(const Weights&, int) { return 1.0f; }
  static __device__ __forceinline__ void prefetch(const Weights&, int, int, int, int, int, int, int) {}
};

// The bytes of packed [N, K/2] as the FP8 kernel walks an [N, K/2] byte matrix: the kernel runs with k = K / 2.
struct WideLoads {
  static constexpr bool kAllSchedules = true;
  static constexpr bool kStageable = false;
  using Weights = ProbeWeights;
  struct Tile { uint4 a[2], b[2]; };

  template <bool kStream>
  static __device__ __forceinline__ Tile load(const Weights& w, int expert, int row, int k0, int n, int k) {
    const uint8_t* pa = w.packed + (static_cast<size_t>(expert) * n + row) * k + k0;
    const uint8_t* pb = pa + 8 * static_cast<size_t>(k);
    Tile t;
    t.a[0] = load_weight16<kStream>(pa), t.a[1] = load_weight16<kStream>(pa + 16);
    t.b[0] = load_weight16<kStream>(pb), t.b[1] = load_weight16<kStream>(pb + 16);
    return t;
  }
  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    accumulate(c, fold4(t.a[0]) ^ fold4(t.a[1]) ^ fold4(t.b[0]) ^ fold4(t.b[1]) ^ fold_x(x));
  }
  static __device__ __forceinline__ float epilogue(const Weights&, int) { return 1.0f; }
  static __device__ __forceinline__ void prefetch(const Weights&, int, int, int, int, int, int, int) {}
};

// The MXFP4 decode + MMAs of fp4_gemv.cu on words computed from (row, k0), no weight loads.
template <bool kGemvLayout>
struct DecodeOnly {
  static constexpr bool kAllSchedules = true;
  static constexpr bool kStageable = false;
  using Weights = ProbeWeights;
  using Tile = Fp4Tile;

  template <bool kStream>
  static __device__ __forceinline__ Tile load(const Weights&, int, int row, int k0, int, int) {
    const uint32_t a = static_cast<uint32_t>(row) * 0x9E3779B1u + static_cast<uint32_t>(k0);
    Tile t;
    t.w0 = make_uint4(a, a ^ 0x5A5A5A5Au, a + 0x01234567u, a * 3u);
    t.w1 = make_uint4(a ^ 0x3C3C3C3Cu, a + 0x76543210u, a * 5u, ~a);
    t.f0 = t.f1 = Mxfp4<kGemvLayout>::factor(120u);
    return t;
  }
  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    Mxfp4<kGemvLayout>::mma(t, x, c);
  }
  static __device__ __forceinline__ float epilogue(const Weights&, int) { return 1.0f; }
  static __device__ __forceinline__ void prefetch(const Weights&, int, int, int, int, int, int, int) {}
};

ffi::Error ProbeGemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                         ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y,
                         int32_t schedule, int32_t probe) {
  const char* name = "dsv4_probe_gemv";
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || pd.size() != 3 || sd.size() != 3 || yd.size() != 3 || xd[0] != 1 || pd[0] != 1) {
    return ffi::Error::InvalidArgument("dsv4_probe_gemv: x [1, M, Kx], packed [1, N, K/2], scale [1, N, K/32]");
  }
  const int m = static_cast<int>(xd[1]), n = static_cast<int>(pd[1]), k = static_cast<int>(pd[2] * 2);
  const int kx = probe == 2 ? k / 2 : k;
  if (m < 1 || m > kMaxRows || xd[2] != kx || kx % kStep != 0 || sd[1] != n || sd[2] * 32 != k || yd[1] != m ||
      yd[2] != n) {
    return ffi::Error::InvalidArgument("dsv4_probe_gemv: shapes (probe 2 takes x with K/2 features)");
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const WeightSets<ProbeWeights, 1> w{{{packed.typed_data(), scale.typed_data()}}};
  const int32_t* e = experts.typed_data();
  float* yp = y->typed_data();
  switch (probe) {
    case 0: return launch_gemv<LoadOnly<false>>(stream, schedule, xp, w, e, 1, yp, m, n, kx, name);
    case 1: return launch_gemv<LoadOnly<true>>(stream, schedule, xp, w, e, 1, yp, m, n, kx, name);
    case 2: return launch_gemv<WideLoads>(stream, schedule, xp, w, e, 1, yp, m, n, kx, name);
    case 3: return launch_gemv<DecodeOnly<false>>(stream, schedule, xp, w, e, 1, yp, m, n, kx, name);
    case 4: return launch_gemv<DecodeOnly<true>>(stream, schedule, xp, w, e, 1, yp, m, n, kx, name);
    default: return ffi::Error::InvalidArgument("dsv4_probe_gemv: probe must be 0..4");
  }
}

}  // namespace
}  // namespace dsv4

DSV4_GEMV_HANDLER(DSV4ProbeGemv, dsv4::ProbeGemvImpl, DSV4_U8_WEIGHT_ARGS, .Attr<int32_t>("probe"));
