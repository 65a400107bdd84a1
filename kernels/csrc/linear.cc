// bf16 decode projections (kernels/linear.py): y [N, M] = w [N, K] . x [M, K]^T, f32 sums, for the few
// rows of a decode step of a bf16 model. XLA:CPU streams a bf16 weight matrix at 11-14 GB/s for 4-16
// rows; this kernel keeps DRAM busy by prefetching the weights a dozen 4-row blocks ahead of the block it
// multiplies, and on CPUs with AVX-512 BF16 multiplies with vdpbf16ps (two products per f32 lane and
// instruction). Each output is the dot product of two contiguous rows (Hugging Face's layout as is),
// computed as 4 x 4 tiles of 16-lane partial sums, reduced once at the end of K. On CPUs with AMX tiles
// (amx.h) the rows multiply there instead, the weights loaded as A tiles straight from the matrix.
//   loraserve_linear_bf16 (x [M, K] bf16, w [N, K] bf16) -> [N, M] f32   (weights-first, like linear)
#include "amx.h"
#include "common.h"

namespace {

struct LinearProblem {
  int64_t M = 0, K = 0, N = 0;
  const uint16_t* x = nullptr;
  const uint16_t* w = nullptr;
  float* y = nullptr;
};

constexpr int64_t kLinTileRows = 4;     // weight rows (outputs) per tile
constexpr int64_t kLinTileCols = 4;     // x rows per tile
constexpr int64_t kLinPrefetch = 12;    // weight blocks of kLinTileRows rows prefetched ahead
constexpr int64_t kLinItemRows = 256;   // weight rows per work item

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kLinBf16Dot = true;
// 32 elements of K a step; the tail of K (K % 32) as one masked step after the loop (zeros past the
// end). The loop is kept free of branches and masks: with them GCC stored the sums every step.
template <int TO, int TC>
void lin_tile(const LinearProblem& p, int64_t o0, int64_t r0, uintptr_t pf, int64_t pf_step, uintptr_t pf_end) {
  __m512 acc[TO][TC];
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) acc[a][b] = _mm512_setzero_ps();
  const uint16_t* w = p.w + o0 * p.K;
  const uint16_t* x = p.x + r0 * p.K;
  const int64_t K = p.K, K32 = K / 32 * 32;
  pf = std::min<uintptr_t>(pf, pf_end - (K32 / 32) * pf_step);  // the last block re-touches lines
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = (__m512bh)_mm512_loadu_si512(w + a * K + k);
    __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
    pf += pf_step;
    for (int b = 0; b < TC; ++b) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + b * K + k);
      for (int a = 0; a < TO; ++a) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv);
    }
  }
  if (K32 < K) {
    const __mmask32 m = (__mmask32(1) << (K - K32)) - 1;
    __m512bh wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + a * K + K32);
    for (int b = 0; b < TC; ++b) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + b * K + K32);
      for (int a = 0; a < TO; ++a) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv);
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = _mm512_reduce_add_ps(acc[a][b]);
}
#else
constexpr bool kLinBf16Dot = false;
// Without bf16 dot products: each bf16 widened to f32 in registers (8 lanes at a time), the same tiles.
template <int TO, int TC>
void lin_tile(const LinearProblem& p, int64_t o0, int64_t r0, uintptr_t pf, int64_t pf_step, uintptr_t pf_end) {
  v8f acc[TO][TC] = {};
  const uint16_t* w = p.w + o0 * p.K;
  const uint16_t* x = p.x + r0 * p.K;
  const int64_t K8 = p.K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    v8f wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = load8(w + a * p.K + k);
    if (k % 32 == 0) {
      __builtin_prefetch(reinterpret_cast<const void*>(std::min(pf, pf_end)), 0, 1);
      pf += pf_step;
    }
    for (int b = 0; b < TC; ++b) {
      const v8f xv = load8(x + b * p.K + k);
      for (int a = 0; a < TO; ++a) acc[a][b] += wv[a] * xv;
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) {
      float s = hsum(acc[a][b]);
      for (int64_t k = K8; k < p.K; ++k) s += widen(w[a * p.K + k]) * widen(x[b * p.K + k]);
      p.y[(o0 + a) * p.M + r0 + b] = s;
    }
}
#endif

template <int TO>
void lin_block(const LinearProblem& p, int64_t o0, uintptr_t pf, int64_t pf_step, uintptr_t pf_end) {
  const int64_t chunks = (p.K + 31) / 32;  // prefetch slots per tile
  int64_t r = 0;
  for (; r + kLinTileCols <= p.M; r += kLinTileCols, pf += chunks * pf_step)
    lin_tile<TO, kLinTileCols>(p, o0, r, pf, pf_step, pf_end);
  switch (p.M - r) {
    case 3: lin_tile<TO, 3>(p, o0, r, pf, pf_step, pf_end); break;
    case 2: lin_tile<TO, 2>(p, o0, r, pf, pf_step, pf_end); break;
    case 1: lin_tile<TO, 1>(p, o0, r, pf, pf_step, pf_end); break;
    default: break;
  }
}

// Weight rows [lo, hi): 4-row blocks, each prefetching (spread over its tiles' K steps) the block
// kLinPrefetch blocks ahead, so the weights' stream never waits on the multiply.
void lin_rows(const LinearProblem& p, int64_t lo, int64_t hi) {
  const int64_t chunks = (p.K + 31) / 32, tiles = (p.M + kLinTileCols - 1) / kLinTileCols;
  const int64_t block_bytes = kLinTileRows * p.K * 2;
  const int64_t pf_step = std::max<int64_t>(64, (block_bytes / (tiles * chunks) + 63) / 64 * 64);
  const uintptr_t pf_end = reinterpret_cast<uintptr_t>(p.w + hi * p.K) - 64;
  int64_t o = lo;
  for (; o + kLinTileRows <= hi; o += kLinTileRows) {
    const uintptr_t pf = reinterpret_cast<uintptr_t>(p.w) + 2 * (o + kLinTileRows * kLinPrefetch) * p.K;
    lin_block<kLinTileRows>(p, o, pf, pf_step, pf_end);
  }
  for (; o < hi; ++o) lin_block<1>(p, o, pf_end, 0, pf_end);
}

#ifdef LORASERVE_AMX
// Weight rows [lo, hi) (whole blocks of 16) on the tiles (amx.h), A straight from the matrix; the last step's
// zero-padded 16 x 32 blocks built in scratch when K is not a multiple of 32.
void lin_amx_rows(const LinearProblem& p, const uint16_t* xb, int64_t lo, int64_t hi,
                  std::vector<float>& scratch) {
  const AmxScope tiles;
  const int64_t K = p.K, steps = (K + 31) / 32, K32 = K / 32 * 32;
  uint16_t* tails = nullptr;
  if (K32 < K) tails = reinterpret_cast<uint16_t*>(aligned64(scratch, 2 * 512 / 2, true));  // <= 2 blocks a call
  auto a_of = [&](int64_t o, int r, int64_t, int64_t) {  // all steps at once
    AmxBlock b{p.w + o * K, 2 * K, nullptr};
    if (tails != nullptr) {
      b.tail = tails + r * 512;
      for (int i = 0; i < 16; ++i)
        for (int64_t k = 0; k < 32; ++k)
          tails[r * 512 + i * 32 + k] = K32 + k < K ? p.w[(o + i) * K + K32 + k] : uint16_t(0);
    }
    return b;
  };
  auto emit = [&](int64_t o, const float* out, int64_t ld) {
    for (int i = 0; i < 16; ++i) std::memcpy(p.y + (o + i) * p.M, out + i * ld, sizeof(float) * p.M);
  };
  amx_rows(lo, hi - lo, p.M, xb, steps, steps, a_of, emit);
}
#endif

ffi::Error LinearBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 || xd.size() != 2 ||
      wd.size() != 2 || xd[1] != wd[1] || yd.size() != 2 || yd[0] != wd[0] || yd[1] != xd[0] || !is_f32(*y))
    return ffi::Error::InvalidArgument("linear_bf16: x [M, K] bf16, w [N, K] bf16 -> [N, M] f32");
  auto p = std::make_shared<LinearProblem>();
  p->M = xd[0], p->K = xd[1], p->N = wd[0];
  p->x = static_cast<const uint16_t*>(x.untyped_data());
  p->w = static_cast<const uint16_t*>(w.untyped_data());
  p->y = static_cast<float*>(y->untyped_data());
  if (p->M == 0 || p->N == 0) return ffi::Error::Success();
  if (p->K == 0) {
    std::memset(p->y, 0, sizeof(float) * p->M * p->N);
    return ffi::Error::Success();
  }
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
#ifdef LORASERVE_AMX
  if (p->M <= kAmxMaxRows && amx_ready()) {
    auto xb = amx_packed(p->M, p->K);
    amx_pack_x(p->x, p->K, p->M, p->K, xb.get());
    parallel_items(pool, items, [p, xb](int64_t k, std::vector<float>& scratch) {
      const int64_t lo = k * kLinItemRows, hi = std::min(p->N, (k + 1) * kLinItemRows);
      const int64_t amx_hi = lo + (hi - lo) / 16 * 16;
      lin_amx_rows(*p, xb.get(), lo, amx_hi, scratch);
      if (amx_hi < hi) lin_rows(*p, amx_hi, hi);  // rows past the last 16 (no model has them)
    });
    return ffi::Error::Success();
  }
#endif
  parallel_items(pool, items, [p](int64_t k, std::vector<float>&) {
    lin_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows));
  });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------- int8 weights
// y [N, M] = (w [N, K] int8 . x [M, K]^T) * scale [N], f32 sums, for the few rows of a decode step over a
// weight-only int8 base (models.quantization): the weights stream at a byte an element (a quarter of f32's), are
// widened to f32 in registers (vpmovsxbd + vcvtdq2ps) and multiplied with x (f32, or bf16 widened); bf16 x on
// CPUs with AVX-512 BF16 instead meets the weights converted to bf16 in registers, multiplied with vdpbf16ps
// (Int8Bf16), or on AMX tiles where the CPU has them (converted a few steps of K at a time into L1). Each
// output is one chain of 16-lane (AVX-512) or 8-lane partial sums over K in order, or of tile steps, whatever
// the tile: batch-invariant.
//   loraserve_linear_int8 (x [M, K] f32|bf16, w [N, K] s8, scale [N] f32) -> [N, M] f32
template <class X>
struct Int8Problem {
  int64_t M = 0, K = 0, N = 0;
  const X* x = nullptr;
  const int8_t* w = nullptr;
  const float* scale = nullptr;
  float* y = nullptr;
  int64_t ld = 0;         // AVX-512: x's row stride (padded_row)
  std::vector<float> xf;  // AVX-512: x copied (bf16 widened) to rows ld apart once per call; x points here
};

// The weights' prefetch stream of a block of kLinTileRows rows (lin_rows' scheme for bytes_per_row-byte rows):
// each k-step of the block's tiles touches one line pf_step bytes further, kLinPrefetch blocks ahead, ending
// at pf_end (the work item's last line).
struct QuantPrefetch {
  int64_t step = 64;
  uintptr_t end = 0;
  QuantPrefetch(const void* w, int64_t hi, int64_t bytes_per_row, int64_t tiles, int64_t steps)
      : step(std::max<int64_t>(64, (kLinTileRows * bytes_per_row / (tiles * steps) + 63) / 64 * 64)),
        end(reinterpret_cast<uintptr_t>(w) + hi * bytes_per_row - 64) {}
  uintptr_t at(const void* w, int64_t o, int64_t bytes_per_row) const {
    return reinterpret_cast<uintptr_t>(w) + (o + kLinTileRows * kLinPrefetch) * bytes_per_row;
  }
};

// A row stride (in f32) for n values: a multiple of 16 and an odd number of 64-byte lines, so that rows of
// a few thousand elements (K = 4096: 16 KiB apart, all in one L1 set) spread over the cache's sets.
inline int64_t padded_row(int64_t n) { return (n + 31) / 32 * 32 + 16; }

// GCC folds a vector load into each FMA that uses it (a memory operand), loading an x vector once per weight
// row: then loads, not FMAs, bound the loop. An empty asm keeps the vector in a register.
template <class T>
inline T in_register(T v) {
  asm("" : "+v"(v));
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LORASERVE_QUANT_AVX512 1
// 16-lane f32 FMAs. The activations stay f32/bf16 (weight-only quantization: never quantized), so VNNI's
// integer dot products (vpdpbusd: int8 x int8 -> int32) do not apply; the weights are widened instead.
struct V16 {
  using T = __m512;
  static constexpr int L = 16;
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static T zero() { return _mm512_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }  // n < 16; zeros after
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static T load(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), p)));
  }
};

// One TO x TC tile: TO weight rows (int8, widened in registers for each tile: cheaper than widening them once
// into memory for many tiles) and TC x rows (f32); the tail of K (K % 16) one masked step (zeros past the end).
template <int TO, int TC>
void q8_tile(const Int8Problem<float>& p, int64_t o0, int64_t r0, uintptr_t pf, int64_t pf_step,
             uintptr_t pf_end) {
  __m512 acc[TO][TC];
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) acc[a][b] = V16::zero();
  const int8_t* w = p.w + o0 * p.K;
  const float* x = p.x + r0 * p.ld;
  const int64_t K = p.K, ld = p.ld, K16 = K / 16 * 16;
  pf = std::min<uintptr_t>(pf, pf_end - (K16 / 16) * pf_step);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = V16::load(w + a * K + k);
    __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
    pf += pf_step;
    for (int b = 0; b < TC; ++b) {
      const __m512 xv = in_register(V16::load(x + b * ld + k));
      for (int a = 0; a < TO; ++a) acc[a][b] = V16::fma(wv[a], xv, acc[a][b]);
    }
  }
  if (K16 < K) {
    const int n = static_cast<int>(K - K16);
    __m512 wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = V16::load(w + a * K + K16, n);
    for (int b = 0; b < TC; ++b) {
      const __m512 xv = V16::load(x + b * ld + K16, n);
      for (int a = 0; a < TO; ++a) acc[a][b] = V16::fma(wv[a], xv, acc[a][b]);
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = V16::sum(acc[a][b]) * p.scale[o0 + a];
}

template <int TO>
void q8_block(const Int8Problem<float>& p, int64_t o0, uintptr_t pf, int64_t pf_step, uintptr_t pf_end) {
  const int64_t steps = p.K / 16;  // prefetching steps per tile
  int64_t r = 0;
  for (; r + kLinTileCols <= p.M; r += kLinTileCols, pf += steps * pf_step)
    q8_tile<TO, kLinTileCols>(p, o0, r, pf, pf_step, pf_end);
  switch (p.M - r) {
    case 3: q8_tile<TO, 3>(p, o0, r, pf, pf_step, pf_end); break;
    case 2: q8_tile<TO, 2>(p, o0, r, pf, pf_step, pf_end); break;
    case 1: q8_tile<TO, 1>(p, o0, r, pf, pf_step, pf_end); break;
    default: break;
  }
}

void q8_rows(const Int8Problem<float>& p, int64_t lo, int64_t hi) {
  const QuantPrefetch pf(p.w, hi, p.K, (p.M + kLinTileCols - 1) / kLinTileCols, (p.K + 15) / 16);
  int64_t o = lo;
  for (; o + kLinTileRows <= hi; o += kLinTileRows)
    q8_block<kLinTileRows>(p, o, pf.at(p.w, o, p.K), pf.step, pf.end);
  for (; o < hi; ++o) q8_block<1>(p, o, pf.end, 0, pf.end);
}

ffi::Error RunInt8(ffi::ThreadPool& pool, std::shared_ptr<Int8Problem<float>> p) {
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
  parallel_items(pool, items, [p](int64_t k, std::vector<float>&) {
    q8_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows));
  });
  return ffi::Error::Success();
}

#ifdef __AVX512BF16__
#define LORASERVE_QUANT_BF16DOT 1
// bf16 x on CPUs with AVX-512 BF16: the weights converted to bf16 in registers (exact: an int8 needs at most 8
// significant bits, bf16's precision) and multiplied with vdpbf16ps, two products a lane and instruction, f32
// sums: the bf16 matmul of the dequantized weights (each product of two bf16 values is exact in f32).

// A row stride (in bf16) for n values: whole 64-byte lines, an odd number of them (padded_row's reason).
inline int64_t padded_row_bf16(int64_t n) { return (n + 63) / 64 * 64 + 32; }

// bf16 (an f32's high half) of the integer i, 0 <= i < 256: exponent 127 + floor(log2 i), i's bits after its
// leading one the fraction's leading bits (exact: at most 7 of them).
constexpr uint16_t bf16_of_int(int i) {
  int e = 0;
  while ((i >> (e + 1)) != 0) ++e;
  return i == 0 ? 0 : static_cast<uint16_t>(((127 + e) << 7) | ((i << (7 - e)) & 0x7F));
}

// int8 -> bf16 64 at a time by table (vpermi2b: a 128-byte table indexed by the low 7 bits of each byte):
// the low and high bytes of bf16(|q|), q's sign or'ed into the high byte, -128 (|q| = 0x80, index 0) set
// apart, and the bytes interleaved into words in-lane (vpunpck{l,h}bw). Cheaper than widening to f32 and
// packing (vpmovsxbd, vcvtdq2ps, vcvtne2ps2bf16): 8 instructions for 64 weights instead of 10.
struct Q8Bf16Bytes {
  alignas(64) uint8_t lo[128] = {}, hi[128] = {};  // bf16(i)'s low and high bytes
  constexpr Q8Bf16Bytes() {
    for (int i = 0; i < 128; ++i) lo[i] = bf16_of_int(i) & 0xFF, hi[i] = bf16_of_int(i) >> 8;
  }
};
constexpr Q8Bf16Bytes kQ8Bf16Bytes{};

struct Q8Bf16 {
  static constexpr const Q8Bf16Bytes& kBytes = kQ8Bf16Bytes;
  __m512i lo0, lo1, hi0, hi1;
  Q8Bf16()
      : lo0(_mm512_load_si512(kBytes.lo)), lo1(_mm512_load_si512(kBytes.lo + 64)),
        hi0(_mm512_load_si512(kBytes.hi)), hi1(_mm512_load_si512(kBytes.hi + 64)) {}
  // 64 int8 -> a: elements 16 l + i, b: elements 16 l + 8 + i (l = 0 .. 3 the 128-bit lane, i = 0 .. 7), in
  // that order (permute64 puts x in the same order)
  void convert(__m512i q, __m512bh& a, __m512bh& b) const {
    const __m512i m = _mm512_abs_epi8(q);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, m, lo1);
    __m512i hi = _mm512_permutex2var_epi8(hi0, m, hi1);
    hi = _mm512_ternarylogic_epi32(hi, q, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (q & 0x80)
    const __m512i m128 = _mm512_set1_epi8(static_cast<char>(bf16_of_int(128) >> 8 | 0x80));  // -128's high byte
    hi = _mm512_mask_blend_epi8(_mm512_movepi8_mask(m), hi, m128);
    a = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    b = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  }
  void convert(const int8_t* p, __m512bh& a, __m512bh& b) const { convert(_mm512_loadu_si512(p), a, b); }
  void convert(const int8_t* p, int n, __m512bh& a, __m512bh& b) const {  // the first n < 64, zeros after
    convert(_mm512_maskz_loadu_epi8((__mmask64(1) << n) - 1, p), a, b);
  }
};

// x's row in Q8Bf16's order: each 64 elements (zeros past K) as the 32 its a vectors multiply, then the b's
inline void permute64(const uint16_t* x, int64_t K, uint16_t* out) {
  alignas(64) uint16_t ia[32], ib[32];
  for (int t = 0; t < 32; ++t) ia[t] = static_cast<uint16_t>(16 * (t / 8) + t % 8), ib[t] = ia[t] + 8;
  const __m512i a_idx = _mm512_load_si512(ia), b_idx = _mm512_load_si512(ib);
  for (int64_t k = 0; k < K; k += 64) {
    const int64_t n = std::min<int64_t>(64, K - k);
    const __mmask32 m0 = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
    const __mmask32 m1 = n >= 64 ? ~__mmask32(0) : n <= 32 ? 0 : (__mmask32(1) << (n - 32)) - 1;
    const __m512i lo = _mm512_maskz_loadu_epi16(m0, x + k), hi = _mm512_maskz_loadu_epi16(m1, x + k + 32);
    _mm512_storeu_si512(out + k, _mm512_permutex2var_epi16(lo, a_idx, hi));
    _mm512_storeu_si512(out + k + 32, _mm512_permutex2var_epi16(lo, b_idx, hi));
  }
}

struct Int8Bf16Problem {
  int64_t M = 0, K = 0, N = 0, ld = 0;
  const uint16_t* x = nullptr;  // [M, ld]: x's rows permuted (permute64) once per call, zeros past K
  const int8_t* w = nullptr;
  const float* scale = nullptr;
  float* y = nullptr;
  std::vector<uint16_t> xs;
};

// One TO x TC tile, 64 elements of K a step (the last one zero-padded). The weights: int8 rows (S false: K apart,
// converted in registers, a row at a time) or rows already converted (S true: bf16 in Q8Bf16's order, ldw
// apart, zeros past K); the same values either way and the same operations on each output. npf prefetches a
// step, 64 bytes apart.
template <int TO, int TC, bool S>
void q8h_tile(const Int8Bf16Problem& p, const void* wp, int64_t ldw, int64_t o0, int64_t r0, uintptr_t pf,
              int64_t npf, uintptr_t pf_end) {
  __m512 acc[TO][TC];
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) acc[a][b] = _mm512_setzero_ps();
  const uint16_t* x = p.x + r0 * p.ld;
  const int64_t ld = p.ld, K = p.K, K64 = K / 64 * 64, steps = (K + 63) / 64;
  pf = std::min<uintptr_t>(pf, pf_end - steps * npf * 64);
  if constexpr (S) {
    const uint16_t* w = static_cast<const uint16_t*>(wp);
    for (int64_t k = 0; k < steps * 64; k += 64) {
      __m512bh w0[TO], w1[TO];
      for (int a = 0; a < TO; ++a) {
        w0[a] = (__m512bh)_mm512_loadu_si512(w + a * ldw + k);
        w1[a] = (__m512bh)_mm512_loadu_si512(w + a * ldw + k + 32);
      }
      for (int64_t i = 0; i < npf; ++i, pf += 64) __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
      for (int b = 0; b < TC; ++b) {
        const __m512bh x0 = in_register((__m512bh)_mm512_loadu_si512(x + b * ld + k));
        const __m512bh x1 = in_register((__m512bh)_mm512_loadu_si512(x + b * ld + k + 32));
        for (int a = 0; a < TO; ++a)
          acc[a][b] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[a][b], w0[a], x0), w1[a], x1);
      }
    }
  } else {
    const int8_t* w = static_cast<const int8_t*>(wp);
    const Q8Bf16 cv;
    for (int64_t k = 0; k < K64; k += 64) {
      for (int64_t i = 0; i < npf; ++i, pf += 64) __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
      for (int a = 0; a < TO; ++a) {
        __m512bh w0, w1;
        cv.convert(w + a * ldw + k, w0, w1);
        for (int b = 0; b < TC; ++b) {
          const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + b * ld + k);
          const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + b * ld + k + 32);
          acc[a][b] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[a][b], w0, x0), w1, x1);
        }
      }
    }
    if (K64 < K) {
      for (int a = 0; a < TO; ++a) {
        __m512bh w0, w1;
        cv.convert(w + a * ldw + K64, static_cast<int>(K - K64), w0, w1);
        for (int b = 0; b < TC; ++b) {
          const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + b * ld + K64);
          const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + b * ld + K64 + 32);
          acc[a][b] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[a][b], w0, x0), w1, x1);
        }
      }
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = V16::sum(acc[a][b]) * p.scale[o0 + a];
}

template <int TO, bool S>
void q8h_cols(const Int8Bf16Problem& p, const void* w, int64_t ldw, int64_t o0, uintptr_t pf, int64_t npf,
              uintptr_t pf_end) {
  const int64_t span = (p.K + 63) / 64 * npf * 64;  // bytes a tile prefetches
  int64_t r = 0;
  for (; r + kLinTileCols <= p.M; r += kLinTileCols, pf += span)
    q8h_tile<TO, kLinTileCols, S>(p, w, ldw, o0, r, pf, npf, pf_end);
  switch (p.M - r) {
    case 3: q8h_tile<TO, 3, S>(p, w, ldw, o0, r, pf, npf, pf_end); break;
    case 2: q8h_tile<TO, 2, S>(p, w, ldw, o0, r, pf, npf, pf_end); break;
    case 1: q8h_tile<TO, 1, S>(p, w, ldw, o0, r, pf, npf, pf_end); break;
    default: break;
  }
}

// TO weight rows against every x row: converted in registers when one tile covers the x rows, else once into
// ``scratch`` (bf16 rows lds apart, L1/L2-resident) for all the tiles.
template <int TO>
void q8h_block(const Int8Bf16Problem& p, int64_t o0, uint16_t* scratch, int64_t lds, uintptr_t pf, int64_t npf,
               uintptr_t pf_end) {
  const int8_t* w = p.w + o0 * p.K;
  if (p.M <= kLinTileCols) return q8h_cols<TO, false>(p, w, p.K, o0, pf, npf, pf_end);
  const Q8Bf16 cv;
  const int64_t K = p.K, K64 = K / 64 * 64;
  for (int a = 0; a < TO; ++a) {
    __m512bh w0, w1;
    uint16_t* s = scratch + a * lds;
    for (int64_t k = 0; k < K64; k += 64) {
      cv.convert(w + a * K + k, w0, w1);
      _mm512_storeu_si512(s + k, (__m512i)w0);
      _mm512_storeu_si512(s + k + 32, (__m512i)w1);
    }
    if (K64 < K) {
      cv.convert(w + a * K + K64, static_cast<int>(K - K64), w0, w1);
      _mm512_storeu_si512(s + K64, (__m512i)w0);
      _mm512_storeu_si512(s + K64 + 32, (__m512i)w1);
    }
  }
  q8h_cols<TO, true>(p, scratch, lds, o0, pf, npf, pf_end);
}

// Prefetching: each block of kLinTileRows rows, over its tiles' steps, the block kLinPrefetch blocks ahead
// (lin_rows' scheme), npf lines a step so that the tiles together cover it.
void q8h_rows(const Int8Bf16Problem& p, int64_t lo, int64_t hi, std::vector<float>& scratch) {
  const int64_t steps = (p.K + 63) / 64, tiles = (p.M + kLinTileCols - 1) / kLinTileCols;
  const int64_t lines = (kLinTileRows * p.K + 63) / 64;
  const int64_t npf = std::max<int64_t>(1, (lines + tiles * steps - 1) / (tiles * steps));
  const uintptr_t w0 = reinterpret_cast<uintptr_t>(p.w), pf_end = w0 + hi * p.K - 64;
  const int64_t lds = padded_row_bf16(p.K);
  uint16_t* s = nullptr;  // the converted block (M > kLinTileCols)
  if (p.M > kLinTileCols) s = reinterpret_cast<uint16_t*>(aligned64(scratch, kLinTileRows * lds / 2, false));
  int64_t o = lo;
  for (; o + kLinTileRows <= hi; o += kLinTileRows)
    q8h_block<kLinTileRows>(p, o, s, lds, w0 + (o + kLinTileRows * kLinPrefetch) * p.K, npf, pf_end);
  for (; o < hi; ++o) q8h_block<1>(p, o, s, lds, pf_end, 0, pf_end);
}

#ifdef LORASERVE_AMX
// Weight rows [lo, hi) (whole blocks of 16) on the tiles: kAmxSegment steps of K at a time, each block's 16
// rows converted to bf16 (Q8Bf16's order, zeros to a whole 64 of K) into L1, then multiplied there; the sums
// times the rows' scales.
void q8_amx_rows(const Int8Bf16Problem& p, const uint16_t* xb, int64_t lo, int64_t hi,
                 std::vector<float>& scratch) {
  const AmxScope tiles;
  const int64_t K = p.K, steps = (K + 63) / 64 * 2;
  // two blocks of 16 rows x kAmxSegment steps of bf16: 32 KiB, in L1 from conversion to tile load
  uint16_t* s = reinterpret_cast<uint16_t*>(aligned64(scratch, 2 * 16 * kAmxSegment * 32 / 2, false));
  const Q8Bf16 cv;
  auto a_of = [&](int64_t o, int r, int64_t c0, int64_t c1) {
    uint16_t* blk = s + r * 16 * kAmxSegment * 32;
    const int64_t k0 = 32 * c0, k1 = std::min(K, 32 * c1), n = (c1 - c0) * 32;  // c0, c1 even
    for (int i = 0; i < 16; ++i) {
      const int8_t* w = p.w + (o + i) * K;
      uint16_t* row = blk + i * n;
      __m512bh w0, w1;
      int64_t k = k0;
      for (; k + 64 <= k1; k += 64) {
        __builtin_prefetch(w + k + 512, 0, 1);  // ahead of the hardware's stream (measured: 1.17 -> 1.11 ms)
        cv.convert(w + k, w0, w1);
        _mm512_store_si512(row + k - k0, (__m512i)w0);
        _mm512_store_si512(row + k - k0 + 32, (__m512i)w1);
      }
      if (k < k1) {
        cv.convert(w + k, static_cast<int>(k1 - k), w0, w1);
        _mm512_store_si512(row + k - k0, (__m512i)w0);
        _mm512_store_si512(row + k - k0 + 32, (__m512i)w1);
      }
    }
    return AmxBlock{blk, 2 * n, nullptr};
  };
  auto emit = [&](int64_t o, const float* out, int64_t ld) {
    for (int i = 0; i < 16; ++i)
      for (int64_t m = 0; m < p.M; ++m) p.y[(o + i) * p.M + m] = out[i * ld + m] * p.scale[o + i];
  };
  amx_rows(lo, hi - lo, p.M, xb, steps, kAmxSegment, a_of, emit);
}
#endif

#ifdef LORASERVE_AMX_INT8
// Weight rows [lo, hi) on the int8 tiles against x in fixed point (amx.h's amx_pack_fixed: xb, shift): A tiles
// straight from the matrix (the last rows, past a whole 16, copied zero-padded into scratch); each output the
// exact integer sum of its row's planes, times scale * 2^-shift, rounded once (in double, then to f32).
void q8_fixed_rows(const Int8Bf16Problem& p, const uint8_t* xb, const int32_t* shift, int64_t lo, int64_t hi,
                   std::vector<float>& scratch) {
  const AmxScope tiles;
  const int64_t K = p.K, steps = K / 64, ones = 3 * p.M, cols = ones + 1, full = lo + (hi - lo) / 16 * 16;
  const int64_t blocks = (hi - lo + 15) / 16;
  int8_t* tail = nullptr;  // the last rows past a whole 16, zero-padded to 16
  if (full < hi) {
    tail = reinterpret_cast<int8_t*>(aligned64(scratch, 16 * K / 4, true));
    std::memcpy(tail, p.w + full * K, (hi - full) * K);
  }
  auto a_of = [&](int64_t o, int, int64_t, int64_t) {  // all steps at once
    const int8_t* a = o < full ? p.w + o * K : tail;
    return AmxBlock{reinterpret_cast<const uint16_t*>(a), K, nullptr};
  };
  alignas(64) double unit[16] = {};  // 2^-shift[m], zeros past M (to a whole 8)
  for (int64_t m = 0; m < p.M; ++m)  // a row of x holding inf or NaN: NaN outputs (bf16's would be inf or NaN)
    unit[m] = shift[m] == kFixedNonFinite ? std::nan("") : std::ldexp(1.0, -shift[m]);
  const __mmask8 last = static_cast<__mmask8>((1u << (p.M % 8 == 0 ? 8 : p.M % 8)) - 1);
  auto emit = [&](int64_t o, const float* out, int64_t ld) {  // 8 rows of x at a time, in double
    for (int64_t i = 0; i < std::min<int64_t>(16, hi - o); ++i) {
      alignas(64) int32_t c[64 + 8];  // the planes' sums: columns j M + m, the ones at 3 M
      std::memcpy(c, out + i * ld, sizeof(int32_t) * 64);
      const __m512d r = _mm512_set1_pd(-128.0 * c[ones]), scale = _mm512_set1_pd(p.scale[o + i]);
      float* y = p.y + (o + i) * p.M;
      for (int64_t m = 0; m < p.M; m += 8) {
        const __mmask8 k = m + 8 <= p.M ? __mmask8(0xFF) : last;
        auto plane = [&](int j) {
          return _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * p.M + m)));
        };
        __m512d sum = _mm512_fmadd_pd(_mm512_add_pd(plane(2), r), _mm512_set1_pd(65536.0),  // exact: < 2^53
                                      _mm512_fmadd_pd(plane(1), _mm512_set1_pd(256.0), plane(0)));
        sum = _mm512_mul_pd(_mm512_mul_pd(sum, scale), _mm512_load_pd(unit + m));
        _mm256_mask_storeu_ps(y + m, k, _mm512_cvtpd_ps(sum));
      }
    }
  };
  amx_rows<true>(lo, blocks * 16, cols, reinterpret_cast<const uint16_t*>(xb), steps, steps, a_of, emit);
}

// Whether Int8Bf16 takes the fixed-point path (LORASERVE_KERNEL_AMX_INT8=0 switches it off, e.g. to measure
// the tiles' bf16 path it replaces).
inline bool fixed_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("LORASERVE_KERNEL_AMX_INT8");
    return amx_ready() && !(env != nullptr && env[0] == '0');
  }();
  return ready;
}

// Int8Bf16 through q8_fixed_rows where the shape allows (at most kFixedMaxRows rows, K a multiple of 64 up to
// kFixedMaxK); false (nothing written) otherwise.
bool int8_fixed(ffi::ThreadPool& pool, std::shared_ptr<Int8Bf16Problem> p, const uint16_t* x) {
  if (p->M > kFixedMaxRows || p->K == 0 || p->K % 64 != 0 || p->K > kFixedMaxK || !fixed_ready()) return false;
  const int64_t steps = p->K / 64, groups = (3 * p->M + 16) / 16;
  std::shared_ptr<uint8_t[]> xb(new uint8_t[groups * steps * 1024]);
  auto shift = std::make_shared<std::vector<int32_t>>(p->M);
  amx_pack_fixed(x, p->M, p->K, xb.get(), shift->data());
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
  parallel_items(pool, items, [p, xb, shift](int64_t k, std::vector<float>& scratch) {
    q8_fixed_rows(*p, xb.get(), shift->data(), k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows), scratch);
  });
  return true;
}
#endif

// Up to this many x rows the int8 (and int4) weights meet bf16 x in registers (q8h_rows, q4h_rows) even where
// AMX tiles are used for more: converting into L1 and loading tiles costs more than it saves at a row or two
// (the bench model's int8 decode step at one row: 6.0 ms in registers, 8.2 on the tiles; the bf16 model's on
// the tiles: 8.0-9.3; int8, a 5632 x 1024 matrix at 1, 2, 3 rows in registers 0.22, 0.28, 0.34 ms, on the
// tiles 0.31 at any; int4 about even at 2). A row's bits are the same in every batch of 1-2 rows and in every
// batch of 3-64, not across the two: the tiles sum in another order (docs/kernels.md). int8 with AMX-INT8 takes
// neither for 1-10 rows where K allows (int8_fixed, first).
constexpr int64_t kQuantRegisterRows = 2;

ffi::Error Int8Bf16(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                    const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& y) {
  auto p = std::make_shared<Int8Bf16Problem>();
  p->M = x.dimensions()[0], p->K = x.dimensions()[1], p->N = w.dimensions()[0];
  p->w = static_cast<const int8_t*>(w.untyped_data());
  p->scale = static_cast<const float*>(scale.untyped_data());
  p->y = static_cast<float*>(y->untyped_data());
  if (p->M == 0 || p->N == 0) return ffi::Error::Success();
  const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
#ifdef LORASERVE_AMX_INT8
  if (int8_fixed(pool, p, xs)) return ffi::Error::Success();
#endif
  p->ld = padded_row_bf16(p->K);
  uint16_t* xp = aligned64(p->xs, p->M * p->ld, true);
  for (int64_t m = 0; m < p->M; ++m) permute64(xs + m * p->K, p->K, xp + m * p->ld);
  p->x = xp;
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
#ifdef LORASERVE_AMX
  if (p->M > kQuantRegisterRows && p->M <= kAmxMaxRows && amx_ready()) {
    // x in the converted weights' order (permute64), zeros to a whole 64 of K: B tiles over K64 = ld's share
    const int64_t K64 = (p->K + 63) / 64 * 64;
    auto xb = amx_packed(p->M, K64);
    amx_pack_x(xp, p->ld, p->M, K64, xb.get());
    parallel_items(pool, items, [p, xb](int64_t k, std::vector<float>& scratch) {
      const int64_t lo = k * kLinItemRows, hi = std::min(p->N, (k + 1) * kLinItemRows);
      const int64_t amx_hi = lo + (hi - lo) / 16 * 16;
      q8_amx_rows(*p, xb.get(), lo, amx_hi, scratch);
      if (amx_hi < hi) q8h_rows(*p, amx_hi, hi, scratch);  // rows past the last 16 (no model has them)
    });
    return ffi::Error::Success();
  }
#endif
  parallel_items(pool, items, [p](int64_t k, std::vector<float>& scratch) {
    q8h_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows), scratch);
  });
  return ffi::Error::Success();
}
#endif

template <class X>
ffi::Error Int8With(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                    const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& y) {
#ifdef LORASERVE_QUANT_BF16DOT
  if constexpr (std::is_same_v<X, uint16_t>) return Int8Bf16(pool, x, w, scale, y);
#endif
  auto p = std::make_shared<Int8Problem<float>>();
  p->M = x.dimensions()[0], p->K = x.dimensions()[1], p->N = w.dimensions()[0];
  p->w = static_cast<const int8_t*>(w.untyped_data());
  p->scale = static_cast<const float*>(scale.untyped_data());
  p->y = static_cast<float*>(y->untyped_data());
  if (p->M == 0 || p->N == 0) return ffi::Error::Success();
  const X* xs = static_cast<const X*>(x.untyped_data());
  p->ld = padded_row(p->K);  // and bf16 widened once here, not in every tile of every weight block
  p->xf.resize(p->M * p->ld);
  for (int64_t m = 0; m < p->M; ++m)
    for (int64_t k = 0; k < p->K; ++k) p->xf[m * p->ld + k] = widen(xs[m * p->K + k]);
  p->x = p->xf.data();
  return RunInt8(pool, p);
}
#else
// One TO x TC tile: w holds TO rows of K weights (int8 straight from the matrix, or those rows widened to
// f32 once for many tiles), x TC rows; y = sums * scale.
template <class W, class X, int TO, int TC>
void int8_tile(const Int8Problem<X>& p, const W* w, int64_t o0, int64_t r0) {
  v8f acc[TO][TC] = {};
  const X* x = p.x + r0 * p.K;
  const int64_t K8 = p.K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    v8f wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = load8(w + a * p.K + k);
    for (int b = 0; b < TC; ++b) {
      const v8f xv = load8(x + b * p.K + k);
      for (int a = 0; a < TO; ++a) acc[a][b] += wv[a] * xv;
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) {
      float s = hsum(acc[a][b]);
      for (int64_t k = K8; k < p.K; ++k) s += widen(w[a * p.K + k]) * widen(x[b * p.K + k]);
      p.y[(o0 + a) * p.M + r0 + b] = s * p.scale[o0 + a];
    }
}

template <class W, class X, int TO>
void int8_cols(const Int8Problem<X>& p, const W* w, int64_t o0) {
  int64_t r = 0;
  for (; r + kLinTileCols <= p.M; r += kLinTileCols) int8_tile<W, X, TO, kLinTileCols>(p, w, o0, r);
  switch (p.M - r) {
    case 3: int8_tile<W, X, TO, 3>(p, w, o0, r); break;
    case 2: int8_tile<W, X, TO, 2>(p, w, o0, r); break;
    case 1: int8_tile<W, X, TO, 1>(p, w, o0, r); break;
    default: break;
  }
}

// TO weight rows against every x row: read as int8 when one tile covers the rows (decode's few), else
// widened once into ``scratch`` (f32, L1/L2-resident) and shared by the tiles. Exact either way (an int8
// is an f32 exactly), so the sums are the same bits.
template <class X, int TO>
void int8_block(const Int8Problem<X>& p, int64_t o0, std::vector<float>& scratch) {
  const int8_t* w = p.w + o0 * p.K;
  __builtin_prefetch(w + 2 * TO * p.K, 0, 1);
  if (p.M <= kLinTileCols) return int8_cols<int8_t, X, TO>(p, w, o0);
  scratch.resize(static_cast<size_t>(TO) * p.K);
  for (int64_t i = 0; i < TO * p.K; ++i) scratch[i] = static_cast<float>(w[i]);
  int8_cols<float, X, TO>(p, scratch.data(), o0);
}

template <class X>
ffi::Error RunInt8(ffi::ThreadPool& pool, std::shared_ptr<Int8Problem<X>> p) {
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
  parallel_items(pool, items, [p](int64_t k, std::vector<float>& scratch) {
    const int64_t lo = k * kLinItemRows, hi = std::min(p->N, (k + 1) * kLinItemRows);
    int64_t o = lo;
    for (; o + kLinTileRows <= hi; o += kLinTileRows) int8_block<X, kLinTileRows>(*p, o, scratch);
    for (; o < hi; ++o) int8_block<X, 1>(*p, o, scratch);
  });
  return ffi::Error::Success();
}

template <class X>
ffi::Error Int8With(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                    const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& y) {
  auto p = std::make_shared<Int8Problem<X>>();
  p->M = x.dimensions()[0], p->K = x.dimensions()[1], p->N = w.dimensions()[0];
  p->x = static_cast<const X*>(x.untyped_data());
  p->w = static_cast<const int8_t*>(w.untyped_data());
  p->scale = static_cast<const float*>(scale.untyped_data());
  p->y = static_cast<float*>(y->untyped_data());
  if (p->M == 0 || p->N == 0) return ffi::Error::Success();
  return RunInt8(pool, p);
}
#endif

ffi::Error LinearInt8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  const bool x_ok = x.element_type() == ffi::DataType::F32 || x.element_type() == ffi::DataType::BF16;
  if (!x_ok || w.element_type() != ffi::DataType::S8 || !is_f32(scale) || xd.size() != 2 || wd.size() != 2 ||
      xd[1] != wd[1] || sd.size() != 1 || sd[0] != wd[0] || yd.size() != 2 || yd[0] != wd[0] ||
      yd[1] != xd[0] || !is_f32(*y))
    return ffi::Error::InvalidArgument(
        "linear_int8: x [M, K] f32|bf16, w [N, K] s8, scale [N] f32 -> [N, M] f32");
  if (xd[1] == 0) {
    std::memset(y->untyped_data(), 0, sizeof(float) * yd[0] * yd[1]);
    return ffi::Error::Success();
  }
  if (is_f32(x)) return Int8With<float>(pool, x, w, scale, y);
  return Int8With<uint16_t>(pool, x, w, scale, y);
}

// ------------------------------------------------------------------------------------------- int4 weights
// y [N, M] = sum over groups g of scale [N, g] * (q [N, group g] . x [M, group g]), f32 sums, for the few
// rows of a decode step over a group-wise int4 base (models.quantization): w [N, K/2] u8 holds a row's element 2j
// in byte j's low nibble (bits 0-3) and 2j + 1 in its high nibble, each as q + 8 (q in [-8, 7]); scale
// [N, K/G] is one f32 per group of G elements (G even, dividing K). The weights stream at half a byte an
// element. x is de-interleaved once per call into f32 (a row's K/2 even elements, then its odd ones), so the
// low and high nibbles of L bytes multiply L consecutive even and L odd x values. Each output: per group one
// chain of FMAs over its bytes in order (low nibble, then high), those partial-sum lanes times the group's
// scale added to the output's lanes, the lanes summed at the end: the same operations whatever the tile
// (batch-invariant). bf16 x on CPUs with AVX-512 BF16: the same with the nibbles converted to bf16 and
// multiplied with vdpbf16ps (q4h_tile).
//   loraserve_linear_int4 (x [M, K] f32|bf16, w [N, K/2] u8, scale [N, K/G] f32) -> [N, M] f32
struct Int4Problem {
  int64_t M = 0, K = 0, N = 0, G = 0;
  int64_t odd = 0, ld = 0;   // x's layout: a row's odd elements odd floats after its even ones, rows ld apart
  const float* x = nullptr;  // [M, ld], each row de-interleaved (xs)
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  float* y = nullptr;
  std::vector<float> xs;
  const uint16_t* xh = nullptr;  // bf16 x with bf16 dot products (deinterleave_bf16): x's layout, in bf16
  std::vector<uint16_t> xhs;
};

// Both halves and the rows padded (padded_row): K = 4096 would put them 8 KiB apart, all in one L1 set.
template <class X>
void deinterleave(const X* x, Int4Problem& p) {
  const int64_t half = p.K / 2;
  p.odd = padded_row(half), p.ld = padded_row(2 * p.odd);
  p.xs.resize(p.M * p.ld);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t j = 0; j < half; ++j) {
      p.xs[m * p.ld + j] = widen(x[m * p.K + 2 * j]);
      p.xs[m * p.ld + p.odd + j] = widen(x[m * p.K + 2 * j + 1]);
    }
  p.x = p.xs.data();
}

#ifdef LORASERVE_QUANT_AVX512
struct Q4x16 : V16 {
  // 16 bytes -> their low nibbles (even elements) and high nibbles (odd) as q; vpermps indexes its table of
  // the 16 values q by the low 4 bits of each lane, so the low nibble needs no mask
  static void nibbles(const uint8_t* p, T& lo, T& hi) {
    split(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), lo, hi);
  }
  static void nibbles(const uint8_t* p, int n, T& lo, T& hi) {  // the first n bytes, zeros after
    split(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(first(n), p)), lo, hi);
    lo = _mm512_maskz_mov_ps(first(n), lo), hi = _mm512_maskz_mov_ps(first(n), hi);
  }
  static void split(__m512i v, T& lo, T& hi) {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    lo = _mm512_permutexvar_ps(v, q);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), q);
  }
};
using Q4V = Q4x16;
#define LORASERVE_QUANT_INT4_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: 8-lane FMAs; the nibbles masked or shifted, offset and converted in registers.
struct Q4x8 {
  using T = __m256;
  static constexpr int L = 8;
  static __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static T zero() { return _mm256_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static float sum(T v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const float* p, int n) { return _mm256_maskload_ps(p, first(n)); }  // n < 8; zeros after
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static void nibbles(const uint8_t* p, T& lo, T& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i eight = _mm256_set1_epi32(8);
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), eight));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight));
  }
  static void nibbles(const uint8_t* p, int n, T& lo, T& hi) {
    uint8_t bytes[8] = {8 * 17, 8 * 17, 8 * 17, 8 * 17, 8 * 17, 8 * 17, 8 * 17, 8 * 17};  // q = 0 past n
    std::memcpy(bytes, p, n);
    nibbles(bytes, lo, hi);
  }
};
using Q4V = Q4x8;
#define LORASERVE_QUANT_INT4_VECTOR 1
#endif

#ifdef LORASERVE_QUANT_INT4_VECTOR
// One TO x TC tile: TO packed weight rows (unpacked in registers for each tile), TC x rows. A group's bytes in
// steps of L (its tail, G/2 % L bytes, one masked step) into partial sums in registers; at the group's end
// those times its scale are added to the totals, kept in ``part`` ([TO][TC][L]: the registers hold the
// partial sums).
template <int TO, int TC>
void q4_tile(const Int4Problem& p, int64_t o0, int64_t r0, float* part, uintptr_t pf, int64_t pf_step,
             uintptr_t pf_end) {
  using V = Q4V;
  using T = V::T;
  constexpr int L = V::L;
  const int64_t ld = p.ld, odd = p.odd, row = p.K / 2, groups = p.K / p.G, full = p.G / 2 / L * L;
  const int tail = static_cast<int>(p.G / 2 - full);
  const uint8_t* w = p.w + o0 * row;
  const float* x = p.x + r0 * ld;
  const float* s = p.scale + o0 * groups;
  pf = std::min<uintptr_t>(pf, pf_end - groups * (full / L) * pf_step);
  for (int64_t g = 0, j = 0; g < groups; ++g) {
    T acc[TO][TC];
    for (int a = 0; a < TO; ++a)
      for (int b = 0; b < TC; ++b) acc[a][b] = V::zero();
    for (const int64_t end = j + full; j < end; j += L) {
      T lo[TO], hi[TO];
      for (int a = 0; a < TO; ++a) V::nibbles(w + a * row + j, lo[a], hi[a]);
      __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
      pf += pf_step;
      for (int b = 0; b < TC; ++b) {
        const T xe = in_register(V::load(x + b * ld + j)), xo = in_register(V::load(x + b * ld + odd + j));
        for (int a = 0; a < TO; ++a) acc[a][b] = V::fma(hi[a], xo, V::fma(lo[a], xe, acc[a][b]));
      }
    }
    if (tail) {
      T lo[TO], hi[TO];
      for (int a = 0; a < TO; ++a) V::nibbles(w + a * row + j, tail, lo[a], hi[a]);
      for (int b = 0; b < TC; ++b) {
        const T xe = V::load(x + b * ld + j, tail), xo = V::load(x + b * ld + odd + j, tail);
        for (int a = 0; a < TO; ++a) acc[a][b] = V::fma(hi[a], xo, V::fma(lo[a], xe, acc[a][b]));
      }
      j += tail;
    }
    for (int a = 0; a < TO; ++a) {
      const T sv = V::set1(s[a * groups + g]);
      for (int b = 0; b < TC; ++b) {
        float* t = part + (a * TC + b) * L;
        V::store(t, V::fma(acc[a][b], sv, g > 0 ? V::load(t) : V::zero()));
      }
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = V::sum(V::load(part + (a * TC + b) * L));
}

template <int TO>
void q4_block(const Int4Problem& p, int64_t o0, float* part, uintptr_t pf, int64_t pf_step, uintptr_t pf_end) {
  const int64_t steps = p.K / p.G * (p.G / 2 / Q4V::L);  // prefetching steps per tile
  int64_t r = 0;
  for (; r + kLinTileCols <= p.M; r += kLinTileCols, pf += steps * pf_step)
    q4_tile<TO, kLinTileCols>(p, o0, r, part, pf, pf_step, pf_end);
  switch (p.M - r) {
    case 3: q4_tile<TO, 3>(p, o0, r, part, pf, pf_step, pf_end); break;
    case 2: q4_tile<TO, 2>(p, o0, r, part, pf, pf_step, pf_end); break;
    case 1: q4_tile<TO, 1>(p, o0, r, part, pf, pf_step, pf_end); break;
    default: break;
  }
}

void q4_rows(const Int4Problem& p, int64_t lo, int64_t hi, std::vector<float>& scratch) {
  const int64_t steps = std::max<int64_t>(1, p.K / p.G * (p.G / 2 / Q4V::L));
  const QuantPrefetch pf(p.w, hi, p.K / 2, (p.M + kLinTileCols - 1) / kLinTileCols, steps);
  scratch.resize(kLinTileRows * kLinTileCols * Q4V::L);
  int64_t o = lo;
  for (; o + kLinTileRows <= hi; o += kLinTileRows)
    q4_block<kLinTileRows>(p, o, scratch.data(), pf.at(p.w, o, p.K / 2), pf.step, pf.end);
  for (; o < hi; ++o) q4_block<1>(p, o, scratch.data(), pf.end, 0, pf.end);
}

#ifdef LORASERVE_QUANT_BF16DOT
// bf16 x with AVX-512 BF16 (Int8Bf16's reasons): x de-interleaved into bf16 (deinterleave's layout), the
// nibbles of 32 bytes zero-extended to 16-bit lanes, each looked up (vpermw, its low 5 bits) in a table of
// the 16 values q as bf16, twice over (so the high nibble's low bit needs no mask); then the low nibbles'
// words are the even elements 2j .. 2j + 62 matching the even x values j .. j + 31, the high nibbles' the odd
// ones, and vdpbf16ps multiplies their adjacent pairs.
void deinterleave_bf16(const uint16_t* x, Int4Problem& p) {
  const int64_t half = p.K / 2, K64 = p.K / 64 * 64;
  p.odd = padded_row_bf16(half), p.ld = padded_row_bf16(2 * p.odd);
  uint16_t* xp = aligned64(p.xhs, p.M * p.ld, true);
  alignas(64) uint16_t ie[32], io[32];
  for (int i = 0; i < 32; ++i) ie[i] = static_cast<uint16_t>(2 * i), io[i] = static_cast<uint16_t>(2 * i + 1);
  const __m512i even = _mm512_load_si512(ie), odd = _mm512_load_si512(io);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* xm = x + m * p.K;
    uint16_t* out = xp + m * p.ld;
    for (int64_t k = 0; k < K64; k += 64) {
      const __m512i a = _mm512_loadu_si512(xm + k), b = _mm512_loadu_si512(xm + k + 32);
      _mm512_storeu_si512(out + k / 2, _mm512_permutex2var_epi16(a, even, b));
      _mm512_storeu_si512(out + p.odd + k / 2, _mm512_permutex2var_epi16(a, odd, b));
    }
    for (int64_t j = K64 / 2; j < half; ++j) out[j] = xm[2 * j], out[p.odd + j] = xm[2 * j + 1];
  }
  p.xh = xp;
}

constexpr int64_t kQ4Rows = 2, kQ4Cols = 4;  // an int4 tile (weight rows, x rows): its totals fit in registers

struct Q4Bf16Words {
  alignas(64) uint16_t w[32] = {};  // bf16((i & 15) - 8), i = 0 .. 31
  constexpr Q4Bf16Words() {
    for (int i = 0; i < 32; ++i) {
      const int q = (i & 15) - 8;
      w[i] = static_cast<uint16_t>(bf16_of_int(q < 0 ? -q : q) | (q < 0 ? 0x8000 : 0));
    }
  }
};
constexpr Q4Bf16Words kQ4Bf16Words{};

struct Q4Bf16 {
  __m512i table = _mm512_load_si512(kQ4Bf16Words.w);
  void convert(__m256i bytes, __m512bh& lo, __m512bh& hi) const {
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    lo = (__m512bh)_mm512_permutexvar_epi16(v, table);
    hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  }
  void convert(const uint8_t* p, __m512bh& lo, __m512bh& hi) const {
    convert(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), lo, hi);
  }
  void convert(const uint8_t* p, __mmask32 m, __m512bh& lo, __m512bh& hi) const {  // the bytes in m, zeros after
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p));
    lo = (__m512bh)_mm512_maskz_permutexvar_epi16(m, v, table);
    hi = (__m512bh)_mm512_maskz_permutexvar_epi16(m, _mm512_srli_epi16(v, 4), table);
  }
};

// q4_tile's groups and sums with 32 bytes (64 elements) a step, a group's tail (G/2 % 32 bytes) one masked
// step, and vdpbf16ps; the packed weights converted in registers for each tile (cheap: 4 instructions for 64
// weights; converting a block once into memory for all the tiles measured slower), the totals (each group's
// sums times its scale, added up) in registers: hence tiles of 2 weight rows. npf prefetches a step, pf_step
// bytes apart.
// Groups of 4 to 32 elements (2 to 16 bytes: G / 2 even, dividing 32): 32 bytes a step hold 32 / (G / 2) whole
// groups, and a vdpbf16ps lane (2 bytes) one group's; each step's sums (zeroed per step: a step is its groups'
// whole sums) times a vector of the lanes' scales are added to the totals. The same semantics as a group at a
// time, without a masked step and a scale per group of 16 bytes (groups of 32 elements: the bench model's
// 2816-input down_proj, 1024 x 2816 at one row 0.14 -> 0.09 ms).
inline bool q4h_packs_groups(int64_t G) { return G / 2 % 2 == 0 && 32 % (G / 2) == 0; }

// Full 32-byte steps a tile of the rows takes (the prefetch slots of q4h_rows / q4h_cols).
inline int64_t q4h_steps(const Int4Problem& p) {
  if (q4h_packs_groups(p.G)) return std::max<int64_t>(1, p.K / 2 / 32);
  return std::max<int64_t>(1, p.K / p.G * (p.G / 2 / 32));
}

template <int TO, int TC>
void q4h_tile_packed(const Int4Problem& p, int64_t o0, int64_t r0, uintptr_t pf, int64_t npf, int64_t pf_step) {
  const Q4Bf16 cv;
  const int64_t ld = p.ld, odd = p.odd, row = p.K / 2, groups = p.K / p.G, gb = p.G / 2, per = 32 / gb;
  const int64_t full = row / 32 * 32;
  alignas(64) int32_t lane_group[16];
  for (int l = 0; l < 16; ++l) lane_group[l] = static_cast<int32_t>(2 * l / gb);
  const __m512i idx = _mm512_load_si512(lane_group);
  const uint8_t* w = p.w + o0 * row;
  const uint16_t* x = p.xh + r0 * ld;
  const float* s = p.scale + o0 * groups;
  __m512 tot[TO][TC];
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) tot[a][b] = _mm512_setzero_ps();
  auto step = [&](int64_t j, __mmask32 bytes, __mmask16 scales, bool masked) {
    __m512bh lo[TO], hi[TO];
    __m512 sv[TO];
    for (int a = 0; a < TO; ++a) {
      if (masked)
        cv.convert(w + a * row + j, bytes, lo[a], hi[a]);
      else
        cv.convert(w + a * row + j, lo[a], hi[a]);
      sv[a] = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(scales, s + a * groups + j / gb));
    }
    for (int b = 0; b < TC; ++b) {
      const __m512bh xe = in_register((__m512bh)_mm512_maskz_loadu_epi16(bytes, x + b * ld + j));
      const __m512bh xo = in_register((__m512bh)_mm512_maskz_loadu_epi16(bytes, x + b * ld + odd + j));
      for (int a = 0; a < TO; ++a) {
        const __m512 acc = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo[a], xe), hi[a], xo);
        tot[a][b] = _mm512_fmadd_ps(acc, sv[a], tot[a][b]);
      }
    }
  };
  const __mmask16 all = static_cast<__mmask16>((1u << per) - 1);
  for (int64_t j = 0; j < full; j += 32) {
    for (int64_t i = 0; i < npf; ++i, pf += pf_step) __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
    step(j, ~__mmask32(0), all, false);
  }
  if (full < row) {  // whole groups: row and 32 are multiples of gb
    const int64_t rest = row - full;
    step(full, static_cast<__mmask32>((uint64_t(1) << rest) - 1), static_cast<__mmask16>((1u << (rest / gb)) - 1),
         true);
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = _mm512_reduce_add_ps(tot[a][b]);
}

template <int TO, int TC>
void q4h_tile(const Int4Problem& p, int64_t o0, int64_t r0, uintptr_t pf, int64_t npf, int64_t pf_step) {
  if (q4h_packs_groups(p.G)) return q4h_tile_packed<TO, TC>(p, o0, r0, pf, npf, pf_step);
  constexpr int L = 32;
  const Q4Bf16 cv;
  const int64_t ld = p.ld, odd = p.odd, row = p.K / 2, groups = p.K / p.G, full = p.G / 2 / L * L;
  const int tail = static_cast<int>(p.G / 2 - full);
  const __mmask32 tm = static_cast<__mmask32>((uint64_t(1) << tail) - 1);
  const uint8_t* w = p.w + o0 * row;
  const uint16_t* x = p.xh + r0 * ld;
  const float* s = p.scale + o0 * groups;
  __m512 tot[TO][TC];
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) tot[a][b] = _mm512_setzero_ps();
  for (int64_t g = 0, j = 0; g < groups; ++g) {
    __m512 acc[TO][TC];
    for (int a = 0; a < TO; ++a)
      for (int b = 0; b < TC; ++b) acc[a][b] = _mm512_setzero_ps();
    for (const int64_t end = j + full; j < end; j += L) {
      __m512bh lo[TO], hi[TO];
      for (int a = 0; a < TO; ++a) cv.convert(w + a * row + j, lo[a], hi[a]);
      for (int64_t i = 0; i < npf; ++i, pf += pf_step) __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, 1);
      for (int b = 0; b < TC; ++b) {
        const __m512bh xe = in_register((__m512bh)_mm512_loadu_si512(x + b * ld + j));
        const __m512bh xo = in_register((__m512bh)_mm512_loadu_si512(x + b * ld + odd + j));
        for (int a = 0; a < TO; ++a)
          acc[a][b] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[a][b], lo[a], xe), hi[a], xo);
      }
    }
    if (tail) {
      __m512bh lo[TO], hi[TO];
      for (int a = 0; a < TO; ++a) cv.convert(w + a * row + j, tm, lo[a], hi[a]);
      for (int b = 0; b < TC; ++b) {
        const __m512bh xe = (__m512bh)_mm512_maskz_loadu_epi16(tm, x + b * ld + j);
        const __m512bh xo = (__m512bh)_mm512_maskz_loadu_epi16(tm, x + b * ld + odd + j);
        for (int a = 0; a < TO; ++a)
          acc[a][b] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[a][b], lo[a], xe), hi[a], xo);
      }
      j += tail;
    }
    for (int a = 0; a < TO; ++a) {
      const __m512 sv = _mm512_set1_ps(s[a * groups + g]);
      for (int b = 0; b < TC; ++b) tot[a][b] = _mm512_fmadd_ps(acc[a][b], sv, tot[a][b]);
    }
  }
  for (int a = 0; a < TO; ++a)
    for (int b = 0; b < TC; ++b) p.y[(o0 + a) * p.M + r0 + b] = _mm512_reduce_add_ps(tot[a][b]);
}

// All the x rows against TO weight rows, kQ4Cols at a time and the rest (tile's arguments).
template <int TO>
void q4h_cols(const Int4Problem& p, int64_t o0, uintptr_t pf, int64_t npf, int64_t pf_step) {
  constexpr int TC = kQ4Cols;
  const int64_t span = q4h_steps(p) * npf * pf_step;  // bytes a tile prefetches
  int64_t r = 0;
  for (; r + TC <= p.M; r += TC, pf += span) q4h_tile<TO, TC>(p, o0, r, pf, npf, pf_step);
  switch (p.M - r) {
    case 3: q4h_tile<TO, 3>(p, o0, r, pf, npf, pf_step); break;
    case 2: q4h_tile<TO, 2>(p, o0, r, pf, npf, pf_step); break;
    case 1: q4h_tile<TO, 1>(p, o0, r, pf, npf, pf_step); break;
    default: break;
  }
}

// Weight rows [lo, hi), kQ4Rows at a time. Prefetching: each block, over its tiles' full steps, the rows
// kLinTileRows * kLinPrefetch ahead (lin_rows' distance), npf lines (pf_step bytes apart) a step so that the
// tiles together cover the block's lines.
void q4h_rows(const Int4Problem& p, int64_t lo, int64_t hi, std::vector<float>&) {
  constexpr int64_t TO = kQ4Rows;
  const int64_t row = p.K / 2, steps = q4h_steps(p);
  const int64_t slots = (p.M + kQ4Cols - 1) / kQ4Cols * steps, lines = (TO * row + 63) / 64;
  const int64_t npf = (lines + slots - 1) / slots;
  const int64_t pf_step = npf > 1 ? 64 : std::max<int64_t>(1, lines * 64 / slots);
  const uintptr_t w0 = reinterpret_cast<uintptr_t>(p.w), pf_end = w0 + hi * row - 64;
  const int64_t span = slots * npf * pf_step;  // bytes a block prefetches
  int64_t o = lo;
  for (; o + TO <= hi; o += TO) {
    const uintptr_t pf = std::min<uintptr_t>(w0 + (o + kLinTileRows * kLinPrefetch) * row, pf_end - span);
    q4h_cols<TO>(p, o, pf, npf, pf_step);
  }
  for (; o < hi; ++o) q4h_cols<1>(p, o, pf_end, 0, 0);
}

#ifdef LORASERVE_AMX
// int4 on AMX tiles (bf16 x, groups of a multiple of 32): per group, each 16-row block's G weights a row
// converted to bf16 (Q4Bf16: exact) into L1, multiplied into zeroed C tiles, the f32 sums stored and added to
// the rows' totals times the group's scale: q4h_tile's semantics (a group's exact products summed in f32, times
// its scale, the groups added in order), its f32 sums in another order. Within a group the tiles' K order is
// chunk by chunk of cb = min(32, G / 2) bytes: a chunk's low nibbles (its even elements), then its high ones;
// q4_amx_x puts x in that order.
inline int64_t q4_amx_chunk(int64_t G) { return std::min<int64_t>(32, G / 2); }

void q4_amx_x(const uint16_t* x, int64_t M, int64_t K, int64_t G, uint16_t* out) {
  const int64_t cb = q4_amx_chunk(G);
  alignas(64) uint16_t ie[32], io[32], i16[32];
  for (int i = 0; i < 32; ++i)
    ie[i] = static_cast<uint16_t>(2 * i), io[i] = static_cast<uint16_t>(2 * i + 1),
    i16[i] = static_cast<uint16_t>(i < 16 ? 2 * i : 2 * (i - 16) + 1);
  const __m512i even = _mm512_load_si512(ie), odd = _mm512_load_si512(io), split = _mm512_load_si512(i16);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * K;
    uint16_t* o = out + m * K;
    for (int64_t c = 0; c < K; c += 2 * cb) {  // K is a multiple of G, G of 32
      if (cb == 32) {
        const __m512i a = _mm512_loadu_si512(xm + c), b = _mm512_loadu_si512(xm + c + 32);
        _mm512_storeu_si512(o + c, _mm512_permutex2var_epi16(a, even, b));
        _mm512_storeu_si512(o + c + 32, _mm512_permutex2var_epi16(a, odd, b));
      } else {
        _mm512_storeu_si512(o + c, _mm512_permutexvar_epi16(split, _mm512_loadu_si512(xm + c)));
      }
    }
  }
}

void q4_amx_rows(const Int4Problem& p, const uint16_t* xb, int64_t lo, int64_t hi, std::vector<float>& scratch) {
  const AmxScope tiles;
  const int64_t K = p.K, G = p.G, row = K / 2, groups = K / G, gsteps = G / 32, steps = K / 32;
  const int64_t cb = q4_amx_chunk(G), Mp = (p.M + 15) / 16 * 16;
  float* base = aligned64(scratch, 16 * G + 32 * Mp, false);
  uint16_t* blk = reinterpret_cast<uint16_t*>(base);  // two blocks of 16 rows x G bf16: a group, converted
  float* tot = base + 16 * G;                          // two blocks' rows' totals, Mp apart
  const Q4Bf16 cv;
  alignas(64) float out[4 * 16 * 16];
  amx_blocks(lo, hi - lo, p.M, [&](auto r_const, auto g_const, int64_t o) {
    constexpr int R = decltype(r_const)::value, XG = decltype(g_const)::value;
    std::memset(tot, 0, sizeof(float) * R * 16 * Mp);
    AmxA<R> A;
    for (int64_t g = 0; g < groups; ++g) {
      for (int r = 0; r < R; ++r) {
        uint16_t* b = blk + r * 16 * G;
        for (int i = 0; i < 16; ++i) {
          const uint8_t* w = p.w + (o + 16 * r + i) * row + g * (G / 2);
          __builtin_prefetch(w + 512, 0, 1);  // this row a few groups ahead (one line a group at G = 128)
          uint16_t* dst = b + i * G;
          for (int64_t j = 0; j < G / 2; j += cb) {
            __m512bh lo8, hi8;
            if (cb == 32) {
              cv.convert(w + j, lo8, hi8);
              _mm512_store_si512(dst + 2 * j, (__m512i)lo8);
              _mm512_store_si512(dst + 2 * j + 32, (__m512i)hi8);
            } else {  // 16 bytes: their 16 even elements, then the 16 odd ones
              cv.convert(w + j, static_cast<__mmask32>(0xFFFF), lo8, hi8);
              _mm512_store_si512(dst + 2 * j,
                                 _mm512_inserti64x4((__m512i)lo8, _mm512_castsi512_si256((__m512i)hi8), 1));
            }
          }
        }
        A.block[r] = AmxBlock{b, 2 * G, nullptr};
      }
      amx_tiles<R, XG>(A, xb, steps, g * gsteps, (g + 1) * gsteps, out, true, true);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 16; ++i) {
          const __m512 sv = _mm512_set1_ps(p.scale[(o + 16 * r + i) * groups + g]);
          const float* sums = out + r * 256 * XG + i * 16 * XG;
          float* t = tot + (r * 16 + i) * Mp;
          for (int64_t m = 0; m < Mp; m += 16)
            _mm512_store_ps(t + m, _mm512_fmadd_ps(_mm512_load_ps(sums + m), sv, _mm512_load_ps(t + m)));
        }
    }
    for (int r = 0; r < R * 16; ++r) std::memcpy(p.y + (o + r) * p.M, tot + r * Mp, sizeof(float) * p.M);
  });
}
#endif
#endif
#else
// Portable: one output at a time, each group's sum in element order, in scalar f32.
void q4_rows(const Int4Problem& p, int64_t lo, int64_t hi, std::vector<float>&) {
  const int64_t half = p.K / 2, gb = p.G / 2, groups = p.K / p.G;
  for (int64_t o = lo; o < hi; ++o)
    for (int64_t r = 0; r < p.M; ++r) {
      const uint8_t* w = p.w + o * half;
      const float* x = p.x + r * p.ld;
      float tot = 0;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0;
        for (int64_t j = g * gb; j < (g + 1) * gb; ++j) {
          acc += static_cast<float>((w[j] & 15) - 8) * x[j];
          acc += static_cast<float>((w[j] >> 4) - 8) * x[p.odd + j];
        }
        tot += acc * p.scale[o * groups + g];
      }
      p.y[o * p.M + r] = tot;
    }
}
#endif

ffi::Error LinearInt4Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  const bool x_ok = x.element_type() == ffi::DataType::F32 || x.element_type() == ffi::DataType::BF16;
  const bool dims = xd.size() == 2 && wd.size() == 2 && sd.size() == 2 && yd.size() == 2;
  // K = 2 * w's columns = G * scale's columns, G even; K == 0 only with no groups
  const bool groups = dims && (sd[1] == 0 ? xd[1] == 0 : xd[1] % sd[1] == 0 && xd[1] / sd[1] % 2 == 0);
  if (!x_ok || w.element_type() != ffi::DataType::U8 || !is_f32(scale) || !dims || !groups ||
      xd[1] != 2 * wd[1] || sd[0] != wd[0] || yd[0] != wd[0] || yd[1] != xd[0] || !is_f32(*y))
    return ffi::Error::InvalidArgument(
        "linear_int4: x [M, K] f32|bf16, w [N, K/2] u8, scale [N, K/G] f32 (G even, dividing K) -> [N, M] f32");
  auto p = std::make_shared<Int4Problem>();
  p->M = xd[0], p->K = xd[1], p->N = wd[0];
  p->w = static_cast<const uint8_t*>(w.untyped_data());
  p->scale = static_cast<const float*>(scale.untyped_data());
  p->y = static_cast<float*>(y->untyped_data());
  if (p->M == 0 || p->N == 0) return ffi::Error::Success();
  if (p->K == 0) {
    std::memset(p->y, 0, sizeof(float) * p->M * p->N);
    return ffi::Error::Success();
  }
  p->G = p->K / sd[1];
#ifdef LORASERVE_QUANT_BF16DOT
  if (!is_f32(x)) {
    const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
#ifdef LORASERVE_AMX
    if (p->M > kQuantRegisterRows && p->M <= kAmxMaxRows && p->G % 32 == 0 && amx_ready()) {
      auto xo = std::shared_ptr<uint16_t[]>(new uint16_t[p->M * p->K]);
      q4_amx_x(static_cast<const uint16_t*>(x.untyped_data()), p->M, p->K, p->G, xo.get());
      auto xb = amx_packed(p->M, p->K);
      amx_pack_x(xo.get(), p->K, p->M, p->K, xb.get());
      if (p->N % 16 != 0) deinterleave_bf16(static_cast<const uint16_t*>(x.untyped_data()), *p);
      parallel_items(pool, items, [p, xb](int64_t k, std::vector<float>& scratch) {
        const int64_t lo = k * kLinItemRows, hi = std::min(p->N, (k + 1) * kLinItemRows);
        const int64_t amx_hi = lo + (hi - lo) / 16 * 16;
        q4_amx_rows(*p, xb.get(), lo, amx_hi, scratch);
        if (amx_hi < hi) q4h_rows(*p, amx_hi, hi, scratch);  // rows past the last 16
      });
      return ffi::Error::Success();
    }
#endif
    deinterleave_bf16(static_cast<const uint16_t*>(x.untyped_data()), *p);
    parallel_items(pool, items, [p](int64_t k, std::vector<float>& scratch) {
      q4h_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows), scratch);
    });
    return ffi::Error::Success();
  }
#endif
  if (is_f32(x))
    deinterleave(static_cast<const float*>(x.untyped_data()), *p);
  else
    deinterleave(static_cast<const uint16_t*>(x.untyped_data()), *p);
  const int64_t items = (p->N + kLinItemRows - 1) / kLinItemRows;
  parallel_items(pool, items, [p](int64_t k, std::vector<float>& scratch) {
    q4_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows), scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

// What -march=native found (kernels/cpu.py): 1 when this build multiplies bf16 with AVX-512 BF16 dot
// products (0: it widens to f32), and 1 when the CPU has AMX tiles (XLA's own GEMMs may use them there).
extern "C" int LoraserveLinearBf16Dot() { return kLinBf16Dot ? 1 : 0; }
#ifdef LORASERVE_AMX
extern "C" int LoraserveCpuAmx() { return amx_ready() ? 1 : 0; }
#else
extern "C" int LoraserveCpuAmx() { return 0; }
#endif
#if defined(LORASERVE_AMX) && defined(LORASERVE_QUANT_BF16DOT)
extern "C" int LoraserveQuantRegisterRows() { return amx_ready() ? static_cast<int>(kQuantRegisterRows) : 0; }
#else
extern "C" int LoraserveQuantRegisterRows() { return 0; }
#endif
#ifdef LORASERVE_AMX_INT8
extern "C" int LoraserveQuantFixedRows(int64_t K) {
  const bool shape = K > 0 && K % 64 == 0 && K <= kFixedMaxK;
  return fixed_ready() && shape ? static_cast<int>(kFixedMaxRows) : 0;
}
#else
extern "C" int LoraserveQuantFixedRows(int64_t) { return 0; }
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearBf16, LinearBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearInt8, LinearInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w (int8)
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearInt4, LinearInt4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w (packed int4)
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Ret<ffi::AnyBuffer>());
