// FP8-block decode GEMV through XLA FFI; skeleton in gemv_kernel.cuh.
//
//   x       bf16 [1, M, K]                     activations, M <= 8
//   weight  u8   [1, N, K]                     e4m3 bytes as stored
//   scale   u8   [1, ceil(N / 128), K / 128]   E8M0 exponent per 128 x 128 block
//   experts s32  [1]                           [0] (one slot: the skeleton's dense case)
//   y       f32  [1, M, N]
//
// dsv4_fp8_gemv_pair takes two weights of one shape (weight, scale of the first, then of the second: e.g. the
// shared expert's gate and up projections) and returns y [1, M, 2N], both products side by side, in one launch.
//
// Each thread owns 32 consecutive inputs of rows g and g + 8 per step (32 bytes per row: two 128-bit loads);
// the step's 128 inputs and the tile's 16 rows lie in one 128 x 128 scale block. Per 32-bit word w of weights
// (4 e4m3 bytes b0..b3, inputs 4j .. 4j + 3 of the thread's run):
//
//   r02 = ((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000)     (b0, b2) as bf16 bits: sign, then the 7 e4m3
//   r13 = ((w >> 4) & 0x07F007F0) | ( w       & 0x80008000)     (b1, b3)  bits at 4-10 = value * 2^-120
//
// (exact for every e4m3 value, subnormals included: they land on bf16 subnormals), each times the bf16 factor
// 2^(s - 7 - 32) (the block scale 2^(s - 127), times 2^120, times 2^-32 so products stay far from float32's
// subnormal range; exact), and 2^32 is taken back in the epilogue. Block scales up to 2^39 are exact. Word j
// feeds one MMA with A pairs (r02, r13) and B pairs (x[4j], x[4j + 2]), (x[4j + 1], x[4j + 3]).

#include "gemv_kernel.cuh"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

constexpr int kFp8Shift = 32;

struct Fp8Block {
  static constexpr bool kAllSchedules = true;
  static constexpr bool kStageable = false;       // not written for FP8 (already at 1.6-1.8x on the large matrices)
  struct Weights { const uint8_t* weight; const uint8_t* scale; };
  struct Tile {
    uint4 a[2], b[2];  // rows g and g + 8: 32 e4m3 bytes each
    uint32_t factor;   // bf16x2 block factor (same for both rows)
  };

  template <bool kStream>
  static __device__ __forceinline__ Tile load(const Weights& w, int expert, int row, int k0, int n, int k) {
    const size_t r0 = static_cast<size_t>(expert) * n + row;
    const uint8_t* pa = w.weight + r0 * k + k0;
    const uint8_t* pb = pa + 8 * static_cast<size_t>(k);
    Tile t;
    t.a[0] = load_weight16<kStream>(pa), t.a[1] = load_weight16<kStream>(pa + 16);
    t.b[0] = load_weight16<kStream>(pb), t.b[1] = load_weight16<kStream>(pb + 16);
    t.factor = block_factor(w, expert, row, k0, n, k);
    return t;
  }

  // bf16 pair 2^(s - 7 - kFp8Shift) of the tile's 128 x 128 block scale s
  static __device__ __forceinline__ uint32_t block_factor(const Weights& w, int expert, int row, int k0, int n, int k) {
    const int row_blocks = (n + 127) / 128;
    const uint32_t s = __ldg(w.scale + (static_cast<size_t>(expert) * row_blocks + row / 128) * (k / 128) + k0 / 128);
    return (s + 127u - 7u - kFp8Shift) * 0x00800080u;
  }

  static __device__ __forceinline__ uint32_t pair02(uint32_t w) {
    return ((w << 4) & 0x07F007F0u) | ((w << 8) & 0x80008000u);
  }
  static __device__ __forceinline__ uint32_t pair13(uint32_t w) {
    return ((w >> 4) & 0x07F007F0u) | (w & 0x80008000u);
  }

  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    const uint32_t wa[8] = {t.a[0].x, t.a[0].y, t.a[0].z, t.a[0].w, t.a[1].x, t.a[1].y, t.a[1].z, t.a[1].w};
    const uint32_t wb[8] = {t.b[0].x, t.b[0].y, t.b[0].z, t.b[0].w, t.b[1].x, t.b[1].y, t.b[1].z, t.b[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t x01 = x[2 * j], x23 = x[2 * j + 1];
      const uint32_t b02 = __byte_perm(x01, x23, 0x5410), b13 = __byte_perm(x01, x23, 0x7632);
      mma_bf16(c, bf16x2_mul(pair02(wa[j]), t.factor), bf16x2_mul(pair02(wb[j]), t.factor),
               bf16x2_mul(pair13(wa[j]), t.factor), bf16x2_mul(pair13(wb[j]), t.factor), b02, b13);
    }
  }

  static __device__ __forceinline__ float epilogue(const Weights&, int) { return 4294967296.0f; }   // 2^32

  // The weight bytes only: a tile's block scales are one byte per step.
  static __device__ __forceinline__ void prefetch(const Weights& w, int expert, int row, int rows, int n, int k,
                                                  int part, int parts) {
    prefetch_part(w.weight + (static_cast<size_t>(expert) * n + row) * k, static_cast<size_t>(rows) * k, part, parts);
  }
};

// Shapes of x, one weight, the expert ids and y (y has `y_cols` columns); returns an error message or "".
template <ffi::DataType kOut>
std::string check_fp8(const std::string& name, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U8>& weight,
                      ffi::Buffer<ffi::U8>& scale, ffi::Buffer<ffi::S32>& experts, ffi::ResultBuffer<kOut>& y,
                      int64_t y_cols, const char* y_shape) {
  const auto xd = x.dimensions(), wd = weight.dimensions(), sd = scale.dimensions();
  const auto ed = experts.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 3 || sd.size() != 3 || ed.size() != 1 || yd.size() != 3) {
    return name + ": x [S, M, K], weight [E, N, K], scale [E, N/128, K/128], experts [S], y [S, M, N] expected";
  }
  const int64_t slots = xd[0], m = xd[1], k = xd[2], n = wd[1];
  if (m < 1 || m > kMaxRows) return name + ": 1 <= M <= 8 activation rows";
  if (k % kStep != 0 || wd[2] != k || sd[0] != wd[0] || sd[1] != (n + 127) / 128 || sd[2] != k / 128) {
    return name + ": need weight [E, N, K], scale [E, ceil(N/128), K/128], K % 128 == 0";
  }
  if (ed[0] != slots || yd[0] != slots || yd[1] != m || yd[2] != y_cols) {
    return name + ": experts [S], y " + y_shape + " expected";
  }
  return "";
}

// y float32, or bf16 (stored as uint16_t by XLA FFI: the kernel writes __nv_bfloat16).
template <int kSets, bool kConcat = false, ffi::DataType kOut = ffi::F32>
ffi::Error launch_fp8(cudaStream_t stream, int32_t schedule, ffi::Buffer<ffi::BF16>& x,
                      const WeightSets<Fp8Block::Weights, kSets>& w, ffi::Buffer<ffi::U8>& weight,
                      ffi::Buffer<ffi::S32>& experts, ffi::ResultBuffer<kOut>& y, const std::string& name,
                      int n2 = 0) {
  using OutT = std::conditional_t<kOut == ffi::F32, float, __nv_bfloat16>;
  const auto xd = x.dimensions();
  return launch_gemv<Fp8Block, kSets, kConcat>(stream, schedule, reinterpret_cast<const uint16_t*>(x.typed_data()), w,
                                               experts.typed_data(), static_cast<int>(xd[0]),
                                               reinterpret_cast<OutT*>(y->typed_data()),
                                               static_cast<int>(xd[1]), static_cast<int>(weight.dimensions()[1]),
                                               static_cast<int>(xd[2]), name.c_str(), n2);
}

// One weight, y float32 or (kOut BF16: for a bf16 consumer, no cast kernel after the call) bf16.
template <ffi::DataType kOut>
ffi::Error Fp8GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> weight,
                       ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<kOut> y,
                       int32_t schedule) {
  const std::string name = kOut == ffi::F32 ? "dsv4_fp8_gemv" : "dsv4_fp8_gemv_bf16";
  if (auto msg = check_fp8(name, x, weight, scale, experts, y, weight.dimensions()[1], "[S, M, N]"); !msg.empty()) {
    return ffi::Error::InvalidArgument(msg);
  }
  const WeightSets<Fp8Block::Weights, 1> w{{{weight.typed_data(), scale.typed_data()}}};
  return launch_fp8<1, false, kOut>(stream, schedule, x, w, weight, experts, y, name);
}

ffi::Error Fp8GemvPairImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> weight,
                           ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::U8> weight2, ffi::Buffer<ffi::U8> scale2,
                           ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y, int32_t schedule) {
  const std::string name = "dsv4_fp8_gemv_pair";
  std::string msg = check_fp8(name, x, weight, scale, experts, y, 2 * weight.dimensions()[1], "[S, M, 2N]");
  if (msg.empty()) msg = check_pair_shapes(name, weight, scale, weight2, scale2);
  if (!msg.empty()) return ffi::Error::InvalidArgument(msg);
  const WeightSets<Fp8Block::Weights, 2> w{{{weight.typed_data(), scale.typed_data()},
                                            {weight2.typed_data(), scale2.typed_data()}}};
  return launch_fp8(stream, schedule, x, w, weight, experts, y, name);
}

// Two weights of one K and their own N (N, N2), concatenated: y [S, M, N + N2] (gemv_kernel.cuh, kConcat).
ffi::Error Fp8GemvConcatImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> weight,
                             ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::U8> weight2, ffi::Buffer<ffi::U8> scale2,
                             ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y, int32_t schedule) {
  const std::string name = "dsv4_fp8_gemv_concat";
  const auto wd = weight.dimensions(), sd = scale.dimensions(), w2 = weight2.dimensions(), s2 = scale2.dimensions();
  if (wd.size() != 3 || sd.size() != 3 || w2.size() != 3 || s2.size() != 3 || w2[0] != wd[0] || w2[2] != wd[2] ||
      s2[0] != wd[0] || s2[1] != (w2[1] + 127) / 128 || s2[2] != sd[2]) {
    return ffi::Error::InvalidArgument(name + ": weights [E, N, K] and [E, N2, K] with scales [E, ceil(N/128), "
                                       "K/128] and [E, ceil(N2/128), K/128] expected");
  }
  if (auto msg = check_fp8(name, x, weight, scale, experts, y, wd[1] + w2[1], "[S, M, N + N2]"); !msg.empty()) {
    return ffi::Error::InvalidArgument(msg);
  }
  const WeightSets<Fp8Block::Weights, 2> w{{{weight.typed_data(), scale.typed_data()},
                                            {weight2.typed_data(), scale2.typed_data()}}};
  return launch_fp8<2, true>(stream, schedule, x, w, weight, experts, y, name, static_cast<int>(w2[1]));
}

}  // namespace
}  // namespace dsv4

DSV4_GEMV_HANDLER(DSV4Fp8Gemv, dsv4::Fp8GemvImpl<xla::ffi::F32>, DSV4_U8_WEIGHT_ARGS, );
DSV4_GEMV_HANDLER_OUT(DSV4Fp8GemvBf16, dsv4::Fp8GemvImpl<xla::ffi::BF16>, DSV4_U8_WEIGHT_ARGS, , BF16);
DSV4_GEMV_HANDLER(DSV4Fp8GemvPair, dsv4::Fp8GemvPairImpl, DSV4_U8_WEIGHT_ARGS DSV4_U8_WEIGHT_ARGS, );
DSV4_GEMV_HANDLER(DSV4Fp8GemvConcat, dsv4::Fp8GemvConcatImpl, DSV4_U8_WEIGHT_ARGS DSV4_U8_WEIGHT_ARGS, );
