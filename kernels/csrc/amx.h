// AMX tiles for the decode projections (linear.cc): on CPUs with AMX-BF16 (Intel Sapphire Rapids and
// later: the cloud's C3/C4/M3 machines) a few rows against a weight matrix are bound by the tiles' bf16
// products no longer: one TDPBF16PS multiplies a 16 x 32 block of weights by 32 x 16 of x (8192 products)
// where vdpbf16ps does 32, so 16 rows cost about what one does and the weights stream at DRAM's rate.
//
// The product y [N, M] = w [N, K] . x [M, K]^T (weights-first, as linear.cc): A tiles are 16 weight rows x
// 32 elements of K (bf16, loaded straight from the matrix, or from a block the caller converted, e.g. int8
// to bf16), B tiles x packed once per call (amx_pack_x: for each 32 elements of K, 16 pairs of elements x 16
// rows of x, zeros past M and K), C tiles 16 weight rows x 16 x rows of f32 sums. Each output is one chain of
// TDPBF16PS over K in order, 32 elements a step, whatever M and whichever tiles share the step: a row's bits
// do not depend on the other rows (batch-invariant). The tiles' own rounding inside a step (products exact,
// f32 sums, denormals flushed) differs from vdpbf16ps's, so on an AMX CPU these kernels give other bits than
// on an AVX-512 BF16 one, within the same tolerance of the exact product.
//
// Linux hands a process the tiles' 8 KiB of state only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
// amx_ready() asks once; where the kernel refuses (or LORASERVE_KERNEL_AMX=0), the kernels use their
// AVX-512 paths.
#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define LORASERVE_AMX 1
#if defined(__AMX_INT8__)
#define LORASERVE_AMX_INT8 1
#endif
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

namespace {

constexpr int64_t kAmxSegment = 16;  // steps of 32 of int8 weights converted into L1 at a time: even
constexpr int64_t kAmxMaxRows = 64;  // x rows a call takes on the tiles (4 groups of 16); more: AVX-512

inline bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("LORASERVE_KERNEL_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // <asm/prctl.h>, the XTILEDATA state component
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// Every tile 16 rows of 64 bytes (palette 1): A and B 16 x 32 bf16, C 16 x 16 f32.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AmxConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// Loads the tile configuration on the calling thread for its lifetime in scope, releases the tiles after
// (XLA's pool threads then carry no tile state into other work).
struct AmxScope {
  AmxScope() {
    static const AmxConfig config;
    _tile_loadconfig(&config);
  }
  ~AmxScope() { _tile_release(); }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// x [M, K] bf16 (rows ldx apart) packed as B tiles: group g (x rows 16 g .. 16 g + 15), step c (K elements
// 32 c .. 32 c + 31): a 16 x 16 array of 32-bit pairs, pair p of row n at [p][n] (x[16 g + n][32 c + 2 p],
// then + 1), zeros past M and K. Tile (g, c) starts at out + (g * steps + c) * 512.
// Each row's 32 elements of a step (one 64-byte load, zeros past K) scattered to its column of the tile; a
// last group of fewer than 16 rows zeroed first (the columns past M).
inline void amx_pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out) {
  const int64_t steps = (K + 31) / 32, groups = (M + 15) / 16;
  if (M % 16 != 0) std::memset(out + (groups - 1) * steps * 512, 0, sizeof(uint16_t) * steps * 512);
  const __m512i pair_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * ldx;
    int32_t* tiles = reinterpret_cast<int32_t*>(out) + (m / 16) * steps * 256 + m % 16;
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t n = std::min<int64_t>(32, K - 32 * c);
      const __mmask32 mask = n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
      _mm512_i32scatter_epi32(tiles + c * 256, pair_rows, _mm512_maskz_loadu_epi16(mask, row + 32 * c), 4);
    }
  }
}

// Room for amx_pack_x's tiles, left uninitialised (it writes every element).
inline std::shared_ptr<uint16_t[]> amx_packed(int64_t M, int64_t K) {
  return std::shared_ptr<uint16_t[]>(new uint16_t[(M + 15) / 16 * ((K + 31) / 32) * 512]);
}

// 16 weight rows as A tiles: step c at a + 32 c (rows lda bytes apart), except that `tail` (when not null: K
// not a multiple of 32) is the last step's zero-padded 16 x 32 block (rows 64 bytes apart).
struct AmxBlock {
  const uint16_t* a = nullptr;
  int64_t lda = 0;
  const uint16_t* tail = nullptr;
};

// The R row blocks of one amx_tiles call.
template <int R>
struct AmxA {
  AmxBlock block[R];
};

// One tile product C += A . B: bf16 pairs to f32 (TDPBF16PS) or, I8, signed int8 weights times unsigned bytes
// to int32 (TDPBSUD; amx_pack_fixed's planes). A macro: the intrinsics take the tile numbers as literals.
#ifdef LORASERVE_AMX_INT8
#define LORASERVE_AMX_DP(I8, C, A, B) \
  do {                                \
    if constexpr (I8)                 \
      _tile_dpbsud(C, A, B);          \
    else                              \
      _tile_dpbf16ps(C, A, B);        \
  } while (0)
#else
#define LORASERVE_AMX_DP(I8, C, A, B) _tile_dpbf16ps(C, A, B)
#endif

// One step of G groups against one block of weights, its A tile AT (a literal, like the products' tiles).
#define LORASERVE_AMX_GROUPS(AT)                \
  _tile_loadd(AT, a[0], stride);                \
  _tile_loadd(6, b, 64);                        \
  LORASERVE_AMX_DP(I8, 0, AT, 6);               \
  _tile_loadd(7, b + steps * 512, 64);          \
  LORASERVE_AMX_DP(I8, 1, AT, 7);               \
  if constexpr (G > 2) {                        \
    _tile_loadd(6, b + 2 * steps * 512, 64);    \
    LORASERVE_AMX_DP(I8, 2, AT, 6);             \
  }                                             \
  if constexpr (G > 3) {                        \
    _tile_loadd(7, b + 3 * steps * 512, 64);    \
    LORASERVE_AMX_DP(I8, 3, AT, 7);             \
  }

// R row blocks x G groups of x, steps [c0, c1) of the `steps` steps of 32 (A's pointers at step c0): the C
// tiles zeroed first when `zero`, and stored to out [R * 16][G * 16] (f32, or int32 for I8; row-major, 16 G
// a row) after step c1 - 1 when `store`; in between they stay in the tiles (amx_rows: zeroed at step 0, stored
// after the last; an int4 group's steps: both). Tiles (an AMX instruction's tile numbers are immediates): C
// in 0 .. 3 (row block r, or group g), A in 4 and 5 (two blocks; one block: alternating by step), B in 6 and
// 7, alternating. I8: int8 weights against amx_pack_fixed's bytes (a step is 64 elements of K, 64 bytes too).
template <int R, int G, bool I8 = false>
void amx_tiles(const AmxA<R>& A, const uint16_t* xb, int64_t steps, int64_t c0, int64_t c1, float* out, bool zero,
               bool store) {
  static_assert(G >= 1 && G <= 4 && (G == 1 ? R >= 1 && R <= 2 : R == 1));
  if (zero) {
    _tile_zero(0);
    if constexpr (R * G > 1) _tile_zero(1);
    if constexpr (G > 2) _tile_zero(2);
    if constexpr (G > 3) _tile_zero(3);
  }
  const bool tail = A.block[0].tail != nullptr && c1 == steps;  // the same K for every block
  auto step = [&](const uint16_t* const a[R], int64_t stride, int64_t c) {
    const uint16_t* b = xb + c * 512;  // group g's tile: + g * steps * 512
    if constexpr (G == 1) {
      _tile_loadd(6, b, 64);
      _tile_loadd(4, a[0], stride);
      LORASERVE_AMX_DP(I8, 0, 4, 6);
      if constexpr (R > 1) {
        _tile_loadd(5, a[1], stride);
        LORASERVE_AMX_DP(I8, 1, 5, 6);
      }
    } else if (c % 2 == 0) {  // A in tile 4 on even steps, 5 on odd ones: the next step's weights load while
      LORASERVE_AMX_GROUPS(4);  // this step's products still read its tile (int8 fixed point, 6 rows, 14336 x
                                // 4096: 1.55 -> 1.39 ms)
    } else {
      LORASERVE_AMX_GROUPS(5);
    }
  };
  const uint16_t* a[R];
  const int64_t full = tail ? c1 - 1 : c1;
  for (int64_t c = c0; c < full; ++c) {
    for (int r = 0; r < R; ++r) a[r] = A.block[r].a + 32 * (c - c0);
    step(a, A.block[0].lda, c);
  }
  if (tail) {
    for (int r = 0; r < R; ++r) a[r] = A.block[r].tail;
    step(a, 64, steps - 1);
  }
  if (!store) return;
  if constexpr (G == 1) {  // tile r: rows 16 r ..
    _tile_stored(0, out, 64);
    if constexpr (R > 1) _tile_stored(1, out + 256, 64);
  } else {  // tile g: columns 16 g ..
    _tile_stored(0, out, 64 * G);
    _tile_stored(1, out + 16, 64 * G);
    if constexpr (G > 2) _tile_stored(2, out + 32, 64 * G);
    if constexpr (G > 3) _tile_stored(3, out + 48, 64 * G);
  }
}

// Runs amx_tiles over `rows` (a multiple of 16) weight rows from o0, as many row blocks a call as the x
// groups allow, `seg` steps of K at a time (all of them where the weights are bf16 in memory; a few, which
// a_of converts into L1, where they are not); `a_of(o, r, c0, c1)` gives rows o .. o + 15's steps [c0, c1)
// as the call's block r (AmxBlock, pointing at step c0; a tail of its own for each r), `emit(o, out, ld)`
// takes those rows' sums (out: 16 rows of ld floats, column m = x row m).
// Calls run(integral_constant R, integral_constant G, o) over `rows` (a multiple of 16) weight rows from o0:
// R row blocks of 16 a call, G = the groups of 16 x rows (M rows).
template <class Run>
void amx_blocks(int64_t o0, int64_t rows, int64_t M, Run run) {
  using std::integral_constant;
  const int64_t groups = (M + 15) / 16, end = o0 + rows;
  int64_t o = o0;
  if (groups == 1) {  // two blocks of 16 rows a call (measured: even with one, well ahead of four)
    for (; o + 32 <= end; o += 32) run(integral_constant<int, 2>{}, integral_constant<int, 1>{}, o);
    for (; o < end; o += 16) run(integral_constant<int, 1>{}, integral_constant<int, 1>{}, o);
  } else if (groups == 2) {
    for (; o < end; o += 16) run(integral_constant<int, 1>{}, integral_constant<int, 2>{}, o);
  } else if (groups == 3) {
    for (; o < end; o += 16) run(integral_constant<int, 1>{}, integral_constant<int, 3>{}, o);
  } else {
    for (; o < end; o += 16) run(integral_constant<int, 1>{}, integral_constant<int, 4>{}, o);
  }
}

template <bool I8 = false, class AOf, class Emit>
void amx_rows(int64_t o0, int64_t rows, int64_t M, const uint16_t* xb, int64_t steps, int64_t seg, AOf a_of,
              Emit emit) {
  alignas(64) float out[4 * 16 * 16];
  amx_blocks(o0, rows, M, [&](auto r_const, auto g_const, int64_t o) {
    constexpr int R = decltype(r_const)::value, G = decltype(g_const)::value;
    AmxA<R> A;
    for (int64_t c0 = 0; c0 < steps; c0 += seg) {
      const int64_t c1 = std::min(steps, c0 + seg);
      for (int r = 0; r < R; ++r) A.block[r] = a_of(o + 16 * r, r, c0, c1);
      amx_tiles<R, G, I8>(A, xb, steps, c0, c1, out, c0 == 0, c1 == steps);
    }
    for (int r = 0; r < R; ++r) emit(o + 16 * r, out + r * 16 * 16 * G, 16 * G);
  });
}

#ifdef LORASERVE_AMX_INT8
// ------------------------------------------------------------------ bf16 rows as exact fixed point, int8 tiles
// An int8 weight matrix times bf16 rows without converting a weight: each row of x becomes 24-bit fixed point
// (q = x * 2^s, s = 22 - floor(log2 max|x|), so |q| < 2^23), exact for every element within 16 binades of the
// row's largest (a bf16 has 8 significant bits) and rounded to 2^-s, at most 2^-23 of the row's max|x|,
// below that. q's three bytes are three planes of x: u0 = q & 255, u1 = (q >> 8) & 255, u2 = (q >> 16) + 128
// (the top byte, signed, made unsigned), each a column of B tiles that TDPBSUD multiplies with the weights
// (signed int8 A tiles straight from the matrix, 16 rows x 64 elements of K a step) into exact int32 sums;
// one more column of ones sums the weights (R). Then w . q = P0 + 2^8 P1 + 2^16 (P2 - 128 R) exactly (in
// double: < 2^53), and y = that * scale * 2^-s, rounded once. One product multiplies 16 x 64 weights by 16
// columns, 16 times vdpbf16ps's products: the weights are read once, at a byte an element, and never converted
// (the bf16 path, q8_amx_rows, converts each into L1 first, which binds it below the memory's rate). A row's
// sums are exact integers: its bits do not depend on the other rows, their count, or the order of the steps.
//
// Up to 10 rows (3 M + 1 <= 32 columns: 1-2 B tiles a step). Measured on a 2-core Sapphire Rapids VM
// (2026-12-06), 14336 x 4096: 1 row 1.26-1.33 ms against 1.58-2.05 converting (bf16 weights 2.3), 6 rows 1.39
// vs 2.10; with 3-4 B tiles a step (11-21 rows) no faster than converting (16 rows 1.7-2.5 vs 2.25-2.4 ms;
// 5632 x 1024 0.32-0.37 vs 0.32), nor with the planes in three groups of their own (the top one signed,
// TDPBSSD, no ones), the A tiles double-buffered, the weights prefetched into L1, or copied 8-16 steps at a time
// into L1 first (slower at every row count: 1 row 1.5-1.7 ms): a step with one A tile costs ~70-90 ns whether
// that tile comes from L2 or DRAM (two A tiles a step, as up to 5 rows take, ~90).
constexpr int64_t kFixedMaxRows = 10;
constexpr int64_t kFixedMaxK = 65536;    // |P| <= 255 * 128 * K stays below 2^31

// Column (j M + m, plane j of row m; 3 M the ones) of the B tiles, as amx_pack_x's layout in bytes: tile (g,
// c) at out + (g * steps + c) * 1024 holds columns 16 g .. 16 g + 15 and K elements 64 c .. 64 c + 63, element
// 64 c + 4 d + i of column 16 g + n at byte d * 64 + n * 4 + i.
inline void fixed_column(uint8_t* out, int64_t steps, int64_t col, int64_t c, __m512i bytes) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
  int32_t* tile = reinterpret_cast<int32_t*>(out + ((col / 16) * steps + c) * 1024) + col % 16;
  _mm512_i32scatter_epi32(tile, rows, bytes, 4);
}

// The bytes of lanes (q >> shift) of four vectors of 16, in order: 64 elements of one plane.
inline __m512i fixed_plane(const __m512i q[4], int shift, uint8_t flip) {
  __m512i v = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(_mm512_srai_epi32(q[0], shift)));
  v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(_mm512_srai_epi32(q[1], shift)), 1);
  v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(_mm512_srai_epi32(q[2], shift)), 2);
  v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(_mm512_srai_epi32(q[3], shift)), 3);
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(flip)));
}

// x [M, K] bf16 (M <= kFixedMaxRows, K a multiple of 64, <= kFixedMaxK) as the planes above in out
// ((3 M + 16) / 16 * K / 64 tiles of 1024 bytes); shift[m] = s of row m, or kFixedNonFinite where the row holds
// inf or NaN (its planes then zeros: the caller makes that row's outputs NaN, the other rows' are untouched).
constexpr int32_t kFixedNonFinite = -(1 << 30);
inline void amx_pack_fixed(const uint16_t* x, int64_t M, int64_t K, uint8_t* out, int32_t* shift) {
  const int64_t steps = K / 64, groups = (3 * M + 16) / 16;
  if ((3 * M + 1) % 16 != 0)  // the columns past the ones: zeros (their sums are never read)
    std::memset(out + (groups - 1) * steps * 1024, 0, steps * 1024);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * K;
    __m512i top = _mm512_setzero_si512();  // |x| as bits: ordered like the values
    for (int64_t k = 0; k < K; k += 32)
      top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(row + k), _mm512_set1_epi16(0x7FFF)));
    alignas(64) uint16_t lanes[32];
    _mm512_store_si512(lanes, top);
    const uint16_t big = *std::max_element(lanes, lanes + 32);
    const bool finite = big < 0x7F80;
    const int s = big == 0 || !finite ? 0 : 22 - std::ilogb(widen(big));
    shift[m] = finite ? s : kFixedNonFinite;
    const __m512 scale = _mm512_set1_ps(static_cast<float>(s));
    const __mmask16 keep = finite ? __mmask16(0xFFFF) : __mmask16(0);
    for (int64_t c = 0; c < steps; ++c) {
      __m512i q[4];
      for (int v = 0; v < 4; ++v) {  // bf16 -> f32 (the high half), times 2^s exactly, to the nearest integer
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 64 * c + 16 * v));
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        q[v] = _mm512_maskz_cvtps_epi32(keep, _mm512_scalef_ps(f, scale));
      }
      fixed_column(out, steps, m, c, fixed_plane(q, 0, 0));
      fixed_column(out, steps, M + m, c, fixed_plane(q, 8, 0));
      fixed_column(out, steps, 2 * M + m, c, fixed_plane(q, 16, 0x80));
    }
  }
  for (int64_t c = 0; c < steps; ++c) fixed_column(out, steps, 3 * M, c, _mm512_set1_epi8(1));
}
#endif

}  // namespace
#endif
