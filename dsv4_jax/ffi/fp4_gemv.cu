// MXFP4 and NVFP4 decode GEMV (and routed-expert GEMV) through XLA FFI; skeleton in gemv_kernel.cuh.
//
//   x       bf16 [S, M, K]        activations (dense: S = 1; routed experts: M rows per slot), M <= 8
//   packed  u8   [E, N, K / 2]    e2m1 pairs, low nibble = even k (layout 0: the checkpoint's, read as stored;
//                                 layout 1: the GEMV layout below)
//   scale   u8   [E, N, K / B]    MXFP4: E8M0 exponents, B = 32; NVFP4: e4m3 bytes, B = 16 (layout 1: reordered)
//   global  f32  [E]              NVFP4 only: the per-matrix global scale
//   experts s32  [S]              expert of each slot (-1: unused slot); dense: [0]
//   y       f32  [S, M, N]
//
// The pair handlers (dsv4_{mx,nv}fp4_gemv_pair) take two weights of one shape (packed, scale[, global] of the
// first, then of the second: e.g. a gate and an up projection) and return y [S, M, 2N], the first's products in
// columns 0 .. N, the second's in N .. 2N, in one launch (gemv_kernel.cuh, "Weight sets").
//
// Each thread owns 32 consecutive inputs of rows g and g + 8 per step (16 bytes per row: one 128-bit load).
// Per 32-bit word of packed weights (8 nibbles, inputs 8t .. 8t + 7 of the thread's run):
//
//   r0 = ((w      & 0x000F000F) * 0x1040) & 0x81C081C0     nibbles 0 and 4 as a bf16 pair (value * 2^-126)
//   r1 = ((w      & 0x00F000F0) * 0x0104) & 0x81C081C0     nibbles 1 and 5
//   r2 = (((w>>8) & 0x000F000F) * 0x1040) & 0x81C081C0     nibbles 2 and 6
//   r3 = (((w>>8) & 0x00F000F0) * 0x0104) & 0x81C081C0     nibbles 3 and 7
//
// (the constants of dsv4_jax/pallas_kernels/gemv.py, checked there for every byte; e2m1 0.5 lands on a bf16 subnormal),
// each times the bf16 block factor (exact: at most 2 significant bits times a power of two):
//   MXFP4: 2^(s - 1 - 32) built in the exponent field; the epilogue multiplies by 2^32 (scales 2^-99 .. 2^33
//          exact, which covers every real checkpoint; the 0xFF NaN scale is not handled);
//   NVFP4: the e4m3 scale placed in bf16 bits (sign, then its 7 bits at bits 4-10: value * 2^-120, subnormal
//          scales included), times 2^119 twice (exact) = scale * 2^118; the epilogue multiplies by 2^8 and the
//          global scale.
// Word t feeds MMA 2t with (r0, r1) and MMA 2t + 1 with (r2, r3); the B pairs are (x[8t], x[8t + 4]),
// (x[8t + 1], x[8t + 5]), (x[8t + 2], x[8t + 6]), (x[8t + 3], x[8t + 7]).
//
// The GEMV layout (layout = 1; made once at load by ffi/fp4_layout.py, same bytes, same scales): each 32-bit word
// holds the same 8 weights with its bits permuted so that weight pair (2p, 2p + 1) becomes a bf16 pair with fewer
// instructions, and in input order, so the activation words are the B pairs as loaded (no PRMT):
//
//   r0 = w & 0x81C081C0                                           weights 0, 1
//   r1 = rotl(w, 13) & 0x81C081C0                                 weights 2, 3
//   r2 = ((w & 0x003A003A) * 0x4008) & 0x81C081C0                 weights 4, 5
//   r3 = ((rotr(w, 6) & 0x05C005C0) * 0x0021) & 0x81C081C0        weights 6, 7
//
// 10 instructions per word instead of 13 (a search over layouts decoded by mask, rotate + mask, byte permute + mask
// and mask-multiply-mask forms found none cheaper), then the same block factors. The layout's scales: a thread's
// bytes of rows g and g + 8 for a step are adjacent and a warp's are contiguous (Fp4Layout::tile_scales): one
// 16-bit (MXFP4) / 32-bit (NVFP4) load per thread per step instead of two. Word t feeds MMA 2t with
// (r0, r1), MMA 2t + 1 with (r2, r3), and B pairs (x[8t], x[8t + 1]), (x[8t + 2], x[8t + 3]) and (x[8t + 4],
// x[8t + 5]), (x[8t + 6], x[8t + 7]).

#include <type_traits>

#include "gemv_kernel.cuh"

namespace ffi = xla::ffi;

namespace dsv4 {
namespace {

constexpr int kMxShift = 32;
constexpr int kNvShift = 8;
constexpr uint32_t kBf16TwoPow119 = 0x7B007B00u;            // (2^119, 2^119)

__device__ __forceinline__ void decode_fp4_word(uint32_t w, uint32_t factor, uint32_t (&r)[4]) {
  const uint32_t mask = 0x81C081C0u;
  const uint32_t v = w >> 8;
  r[0] = bf16x2_mul(((w & 0x000F000Fu) * 0x1040u) & mask, factor);
  r[1] = bf16x2_mul(((w & 0x00F000F0u) * 0x0104u) & mask, factor);
  r[2] = bf16x2_mul(((v & 0x000F000Fu) * 0x1040u) & mask, factor);
  r[3] = bf16x2_mul(((v & 0x00F000F0u) * 0x0104u) & mask, factor);
}

__device__ __forceinline__ void decode_fp4_word_gemv_layout(uint32_t w, uint32_t factor, uint32_t (&r)[4]) {
  const uint32_t mask = 0x81C081C0u;
  r[0] = bf16x2_mul(w & mask, factor);
  r[1] = bf16x2_mul(__funnelshift_l(w, w, 13) & mask, factor);
  r[2] = bf16x2_mul(((w & 0x003A003Au) * 0x4008u) & mask, factor);
  r[3] = bf16x2_mul(((__funnelshift_r(w, w, 6) & 0x05C005C0u) * 0x0021u) & mask, factor);
}

// Two words of packed nibbles (rows g and g + 8) and their factors -> two MMAs into c.
template <bool kGemvLayout>
__device__ __forceinline__ void fp4_word_mma(uint32_t wa, uint32_t fa, uint32_t wb, uint32_t fb, const uint32_t* xw,
                                             float (&c)[4]) {
  uint32_t ra[4], rb[4];
  if constexpr (kGemvLayout) {
    decode_fp4_word_gemv_layout(wa, fa, ra);
    decode_fp4_word_gemv_layout(wb, fb, rb);
    mma_bf16(c, ra[0], rb[0], ra[1], rb[1], xw[0], xw[1]);
    mma_bf16(c, ra[2], rb[2], ra[3], rb[3], xw[2], xw[3]);
  } else {
    decode_fp4_word(wa, fa, ra);
    decode_fp4_word(wb, fb, rb);
    const uint32_t x01 = xw[0], x23 = xw[1], x45 = xw[2], x67 = xw[3];
    const uint32_t b04 = __byte_perm(x01, x45, 0x5410), b15 = __byte_perm(x01, x45, 0x7632);
    const uint32_t b26 = __byte_perm(x23, x67, 0x5410), b37 = __byte_perm(x23, x67, 0x7632);
    mma_bf16(c, ra[0], rb[0], ra[1], rb[1], b04, b15);
    mma_bf16(c, ra[2], rb[2], ra[3], rb[3], b26, b37);
  }
}

struct Fp4Tile {
  uint4 w0, w1;        // rows g and g + 8: 32 nibbles each
  uint32_t f0, f1;     // MXFP4: bf16x2 factor per row; NVFP4: the two 16-blocks' e4m3 bytes (byte 0 | byte 1 << 8)
};

// Where both FP4 formats keep their bytes: e2m1 pairs [E, N, K/2] and one scale byte per kBlock inputs
// [E, N, K/kBlock] (MXFP4: 32, NVFP4: 16). Row r0 below is the flat row expert * N + row.
template <int kBlock>
struct Fp4Layout {
  // Raw scales of one row for a thread's 32 inputs (MXFP4: one E8M0 byte; NVFP4: two e4m3 bytes, first | second
  // << 8), and of both its rows g and g + 8 as the GEMV layout stores them side by side.
  using RowScales = std::conditional_t<kBlock == 32, uint8_t, uint16_t>;
  using BothScales = std::conditional_t<kBlock == 32, uint16_t, uint32_t>;
  static constexpr int kRowScaleBits = 8 * sizeof(RowScales);

  static __device__ __forceinline__ size_t flat_row(int expert, int row, int n) {
    return static_cast<size_t>(expert) * n + row;
  }
  static __device__ __forceinline__ const uint8_t* pairs(const uint8_t* packed, size_t r0, int k0, int k) {
    return packed + r0 * (k / 2) + k0 / 2;
  }
  static __device__ __forceinline__ const uint8_t* scales(const uint8_t* scale, size_t r0, int k0, int k) {
    return scale + r0 * (k / kBlock) + k0 / kBlock;
  }
  // GEMV layout: the 2 x 32 / kBlock scale bytes of rows r0 and r0 + 8 (r0 % 16 < 8) for the 32 inputs at k0,
  // adjacent (row r0's first); order [tile, step, g, q, row g / g + 8, byte] (dsv4_jax/ffi/fp4_layout.py).
  static __device__ __forceinline__ const uint8_t* tile_scales(const uint8_t* scale, size_t r0, int k0, int k) {
    const int g = static_cast<int>(r0 % 16);
    return scale + (r0 - g) * (k / kBlock) + tile_scale_offset(g, k0);
  }
  static __device__ __forceinline__ int tile_scale_offset(int g, int k0) {
    return (k0 / kStep) * (16 * kStep / kBlock) + g * (256 / kBlock) + (k0 / 32 % 4) * (64 / kBlock);
  }

  // Staged schedules: a 16-row tile is its e2m1 bytes [16, K/2] then its scales [16 x K/kBlock] (either order),
  // both contiguous in global memory as stored.
  static __host__ __device__ __forceinline__ size_t stage_bytes(int k) { return 16 * (k / 2 + k / kBlock); }
  static __device__ __forceinline__ void tile_pieces(const uint8_t* packed, const uint8_t* scale, size_t r0, int k,
                                                     const uint8_t* (&src)[2], uint32_t (&bytes)[2]) {
    src[0] = pairs(packed, r0, 0, k), bytes[0] = 16 * (k / 2);
    src[1] = scales(scale, r0, 0, k), bytes[1] = 16 * (k / kBlock);
  }
  // rows g and g + 8 of a staged tile: their 16 e2m1 bytes at k0; the tile's scales follow its e2m1 bytes
  static __device__ __forceinline__ void staged_pairs(const uint8_t* tile, int g, int k0, int k, uint4& w0, uint4& w1) {
    const uint8_t* p = tile + g * (k / 2) + k0 / 2;
    w0 = *reinterpret_cast<const uint4*>(p);
    w1 = *reinterpret_cast<const uint4*>(p + 8 * (k / 2));
  }
  static __device__ __forceinline__ const uint8_t* staged_scales(const uint8_t* tile, int k) { return tile + 8 * k; }

  static __device__ __forceinline__ void prefetch(const uint8_t* packed, const uint8_t* scale, size_t r0, int rows,
                                                  int k, int part, int parts) {
    prefetch_part(pairs(packed, r0, 0, k), static_cast<size_t>(rows) * (k / 2), part, parts);
    prefetch_part(scales(scale, r0, 0, k), static_cast<size_t>(rows) * (k / kBlock), part, parts);
  }
};

struct Mxfp4Weights { const uint8_t* packed; const uint8_t* scale; };
struct Nvfp4Weights { const uint8_t* packed; const uint8_t* scale; const float* global; };

// What MXFP4 and NVFP4 share: where the bytes are and how a step's tile is loaded, from global memory or from a
// staged tile. Format::tile_scale(raw) turns a row's raw scales into Tile::f0 / f1 (MXFP4 at load, NVFP4 in mma).
template <class Format, class WeightsT, int kBlock, bool kGemvLayout>
struct Fp4Format {
  static constexpr bool kAllSchedules = !kGemvLayout;     // the GEMV layout: the few schedules of compiled_for
  static constexpr bool kStageable = true;
  using Weights = WeightsT;
  using Layout = Fp4Layout<kBlock>;
  using Tile = Fp4Tile;
  using RowScales = typename Layout::RowScales;
  using BothScales = typename Layout::BothScales;

  template <bool kStream>
  static __device__ __forceinline__ Tile load(const Weights& w, int expert, int row, int k0, int n, int k) {
    const size_t r0 = Layout::flat_row(expert, row, n);
    Tile t;
    t.w0 = load_weight16<kStream>(Layout::pairs(w.packed, r0, k0, k));
    t.w1 = load_weight16<kStream>(Layout::pairs(w.packed, r0 + 8, k0, k));
    if constexpr (kGemvLayout) {
      const uint32_t both = __ldg(reinterpret_cast<const BothScales*>(Layout::tile_scales(w.scale, r0, k0, k)));
      t.f0 = both & ((1u << Layout::kRowScaleBits) - 1u);
      t.f1 = both >> Layout::kRowScaleBits;
    } else {
      t.f0 = __ldg(reinterpret_cast<const RowScales*>(Layout::scales(w.scale, r0, k0, k)));
      t.f1 = __ldg(reinterpret_cast<const RowScales*>(Layout::scales(w.scale, r0 + 8, k0, k)));
    }
    t.f0 = Format::tile_scale(t.f0), t.f1 = Format::tile_scale(t.f1);
    return t;
  }

  static __host__ __device__ __forceinline__ size_t stage_bytes(int k) { return Layout::stage_bytes(k); }
  static __device__ __forceinline__ void tile_pieces(const Weights& w, int expert, int row0, int n, int k,
                                                     const uint8_t* (&src)[2], uint32_t (&bytes)[2]) {
    Layout::tile_pieces(w.packed, w.scale, Layout::flat_row(expert, row0, n), k, src, bytes);
  }
  static __device__ __forceinline__ Tile load_staged(const uint8_t* tile, int g, int k0, int k) {
    Tile t;
    Layout::staged_pairs(tile, g, k0, k, t.w0, t.w1);
    const uint8_t* s = Layout::staged_scales(tile, k);
    if constexpr (kGemvLayout) {
      const uint32_t both = *reinterpret_cast<const BothScales*>(s + Layout::tile_scale_offset(g, k0));
      t.f0 = both & ((1u << Layout::kRowScaleBits) - 1u);
      t.f1 = both >> Layout::kRowScaleBits;
    } else {
      t.f0 = *reinterpret_cast<const RowScales*>(s + g * (k / kBlock) + k0 / kBlock);
      t.f1 = *reinterpret_cast<const RowScales*>(s + (g + 8) * (k / kBlock) + k0 / kBlock);
    }
    t.f0 = Format::tile_scale(t.f0), t.f1 = Format::tile_scale(t.f1);
    return t;
  }

  static __device__ __forceinline__ void prefetch(const Weights& w, int expert, int row, int rows, int n, int k,
                                                  int part, int parts) {
    Layout::prefetch(w.packed, w.scale, Layout::flat_row(expert, row, n), rows, k, part, parts);
  }
};

template <bool kGemvLayout>
struct Mxfp4 : Fp4Format<Mxfp4<kGemvLayout>, Mxfp4Weights, 32, kGemvLayout> {
  using Tile = Fp4Tile;
  using Weights = Mxfp4Weights;

  // E8M0 byte s -> bf16 2^(s - 1 - kMxShift) in both halves (times the decode's 2^-126: 2^(s - 127 - 32)).
  static __device__ __forceinline__ uint32_t factor(uint32_t s) { return (s + 126u - kMxShift) * 0x00800080u; }
  static __device__ __forceinline__ uint32_t tile_scale(uint32_t raw) { return factor(raw); }

  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    const uint32_t wa[4] = {t.w0.x, t.w0.y, t.w0.z, t.w0.w}, wb[4] = {t.w1.x, t.w1.y, t.w1.z, t.w1.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) fp4_word_mma<kGemvLayout>(wa[j], t.f0, wb[j], t.f1, x + 4 * j, c);
  }

  static __device__ __forceinline__ float epilogue(const Weights&, int) { return 4294967296.0f; }   // 2^32
};

template <bool kGemvLayout>
struct Nvfp4 : Fp4Format<Nvfp4<kGemvLayout>, Nvfp4Weights, 16, kGemvLayout> {
  using Tile = Fp4Tile;
  using Weights = Nvfp4Weights;

  // Two e4m3 bytes (b0 | b1 << 8) -> bf16 pairs (b0 * 2^118, b0 * 2^118) and (b1 * 2^118, b1 * 2^118), exact.
  static __device__ __forceinline__ void factors(uint32_t two, uint32_t& f_lo, uint32_t& f_hi) {
    const uint32_t spread = __byte_perm(two, 0, 0x4140);               // b0 -> bits 0-7, b1 -> bits 16-23
    const uint32_t bits = ((spread & 0x007F007Fu) << 4) | ((spread & 0x00800080u) << 8);   // b * 2^-120
    const uint32_t pair = bf16x2_mul(bf16x2_mul(bits, kBf16TwoPow119), kBf16TwoPow119);   // b * 2^118
    f_lo = __byte_perm(pair, 0, 0x1010);
    f_hi = __byte_perm(pair, 0, 0x3232);
  }
  static __device__ __forceinline__ uint32_t tile_scale(uint32_t raw) { return raw; }   // converted in mma

  static __device__ __forceinline__ void mma(const Tile& t, const uint32_t (&x)[16], float (&c)[4]) {
    uint32_t fa[2], fb[2];                                             // [first 16-block, second 16-block]
    factors(t.f0, fa[0], fa[1]);
    factors(t.f1, fb[0], fb[1]);
    const uint32_t wa[4] = {t.w0.x, t.w0.y, t.w0.z, t.w0.w}, wb[4] = {t.w1.x, t.w1.y, t.w1.z, t.w1.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) fp4_word_mma<kGemvLayout>(wa[j], fa[j / 2], wb[j], fb[j / 2], x + 4 * j, c);
  }

  static __device__ __forceinline__ float epilogue(const Weights& w, int expert) {
    return static_cast<float>(1 << kNvShift) * w.global[expert];
  }
};

// Shapes shared by both formats (y has `sets` x N columns); returns an error message or "".
std::string check_fp4(const char* name, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U8>& packed,
                      ffi::Buffer<ffi::U8>& scale, int block, ffi::Buffer<ffi::S32>& experts,
                      ffi::ResultBuffer<ffi::F32>& y, int sets) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions();
  const auto ed = experts.dimensions(), yd = y->dimensions();
  const std::string who(name);
  if (xd.size() != 3 || pd.size() != 3 || sd.size() != 3 || ed.size() != 1 || yd.size() != 3) {
    return who + ": x [S, M, K], packed [E, N, K/2], scale [E, N, K/B], experts [S], y [S, M, N] expected";
  }
  const int64_t slots = xd[0], m = xd[1], k = xd[2], n = pd[1];
  if (m < 1 || m > kMaxRows) return who + ": 1 <= M <= 8 activation rows per slot";
  if (k % kStep != 0 || pd[2] * 2 != k || sd[0] != pd[0] || sd[1] != n || sd[2] * block != k) {
    return who + ": need packed [E, N, K/2], scale [E, N, K/" + std::to_string(block) + "], K % 128 == 0";
  }
  if (ed[0] != slots || yd[0] != slots || yd[1] != m || yd[2] != sets * n) {
    return who + (sets == 1 ? ": experts [S], y [S, M, N]" : ": experts [S], y [S, M, 2N]");
  }
  return "";
}

// layout 0: the checkpoint's nibble order; 1: the GEMV layout (header comment).
template <template <bool> class Format, class Weights, int kSets>
ffi::Error launch_fp4(cudaStream_t stream, int32_t layout, int32_t schedule, ffi::Buffer<ffi::BF16>& x,
                      const WeightSets<Weights, kSets>& w, ffi::Buffer<ffi::S32>& experts,
                      ffi::ResultBuffer<ffi::F32>& y, int n, const char* name) {
  const auto xd = x.dimensions();
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const int slots = static_cast<int>(xd[0]), m = static_cast<int>(xd[1]), k = static_cast<int>(xd[2]);
  if (layout == 0) {
    return launch_gemv<Format<false>>(stream, schedule, xp, w, experts.typed_data(), slots, y->typed_data(), m, n, k,
                                      name);
  }
  if (layout == 1) {
    return launch_gemv<Format<true>>(stream, schedule, xp, w, experts.typed_data(), slots, y->typed_data(), m, n, k,
                                     name);
  }
  return ffi::Error::InvalidArgument(std::string(name) + ": layout must be 0 (checkpoint) or 1 (GEMV layout)");
}

ffi::Error Mxfp4GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                         ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y,
                         int32_t schedule, int32_t layout) {
  const char* name = "dsv4_mxfp4_gemv";
  if (auto msg = check_fp4(name, x, packed, scale, 32, experts, y, 1); !msg.empty()) {
    return ffi::Error::InvalidArgument(msg);
  }
  const WeightSets<Mxfp4Weights, 1> w{{{packed.typed_data(), scale.typed_data()}}};
  return launch_fp4<Mxfp4>(stream, layout, schedule, x, w, experts, y, static_cast<int>(packed.dimensions()[1]), name);
}

ffi::Error Mxfp4GemvPairImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                             ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::U8> packed2, ffi::Buffer<ffi::U8> scale2,
                             ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y, int32_t schedule,
                             int32_t layout) {
  const char* name = "dsv4_mxfp4_gemv_pair";
  std::string msg = check_fp4(name, x, packed, scale, 32, experts, y, 2);
  if (msg.empty()) msg = check_pair_shapes(name, packed, scale, packed2, scale2);
  if (!msg.empty()) return ffi::Error::InvalidArgument(msg);
  const WeightSets<Mxfp4Weights, 2> w{{{packed.typed_data(), scale.typed_data()},
                                       {packed2.typed_data(), scale2.typed_data()}}};
  return launch_fp4<Mxfp4>(stream, layout, schedule, x, w, experts, y, static_cast<int>(packed.dimensions()[1]), name);
}

std::string check_global(const char* name, ffi::Buffer<ffi::F32>& global, ffi::Buffer<ffi::U8>& packed) {
  if (global.dimensions().size() != 1 || global.dimensions()[0] != packed.dimensions()[0]) {
    return std::string(name) + ": global scale [E] expected";
  }
  return "";
}

ffi::Error Nvfp4GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                         ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global, ffi::Buffer<ffi::S32> experts,
                         ffi::ResultBuffer<ffi::F32> y, int32_t schedule, int32_t layout) {
  const char* name = "dsv4_nvfp4_gemv";
  if (auto msg = check_fp4(name, x, packed, scale, 16, experts, y, 1); !msg.empty()) {
    return ffi::Error::InvalidArgument(msg);
  }
  if (auto msg = check_global(name, global, packed); !msg.empty()) return ffi::Error::InvalidArgument(msg);
  const WeightSets<Nvfp4Weights, 1> w{{{packed.typed_data(), scale.typed_data(), global.typed_data()}}};
  return launch_fp4<Nvfp4>(stream, layout, schedule, x, w, experts, y, static_cast<int>(packed.dimensions()[1]), name);
}

ffi::Error Nvfp4GemvPairImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> packed,
                             ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::F32> global, ffi::Buffer<ffi::U8> packed2,
                             ffi::Buffer<ffi::U8> scale2, ffi::Buffer<ffi::F32> global2, ffi::Buffer<ffi::S32> experts,
                             ffi::ResultBuffer<ffi::F32> y, int32_t schedule, int32_t layout) {
  const char* name = "dsv4_nvfp4_gemv_pair";
  std::string msg = check_fp4(name, x, packed, scale, 16, experts, y, 2);
  if (msg.empty()) msg = check_pair_shapes(name, packed, scale, packed2, scale2);
  if (msg.empty()) msg = check_global(name, global, packed);
  if (msg.empty()) msg = check_global(name, global2, packed);
  if (!msg.empty()) return ffi::Error::InvalidArgument(msg);
  const WeightSets<Nvfp4Weights, 2> w{{{packed.typed_data(), scale.typed_data(), global.typed_data()},
                                       {packed2.typed_data(), scale2.typed_data(), global2.typed_data()}}};
  return launch_fp4<Nvfp4>(stream, layout, schedule, x, w, experts, y, static_cast<int>(packed.dimensions()[1]), name);
}

}  // namespace
}  // namespace dsv4

DSV4_GEMV_HANDLER(DSV4Mxfp4Gemv, dsv4::Mxfp4GemvImpl, DSV4_U8_WEIGHT_ARGS, .Attr<int32_t>("layout"));
DSV4_GEMV_HANDLER(DSV4Nvfp4Gemv, dsv4::Nvfp4GemvImpl, DSV4_NVFP4_WEIGHT_ARGS, .Attr<int32_t>("layout"));
DSV4_GEMV_HANDLER(DSV4Mxfp4GemvPair, dsv4::Mxfp4GemvPairImpl, DSV4_U8_WEIGHT_ARGS DSV4_U8_WEIGHT_ARGS,
                  .Attr<int32_t>("layout"));
DSV4_GEMV_HANDLER(DSV4Nvfp4GemvPair, dsv4::Nvfp4GemvPairImpl, DSV4_NVFP4_WEIGHT_ARGS DSV4_NVFP4_WEIGHT_ARGS,
                  .Attr<int32_t>("layout"));
