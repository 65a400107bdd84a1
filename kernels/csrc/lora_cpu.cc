// Grouped multi-LoRA for CPUs, as XLA FFI custom calls (kernels/cpu.py builds and registers them).
//
// One call serves a whole batch: rows are grouped by slot (a counting sort over T <= a few hundred
// rows), and each group reads its slot's matrices ONCE for all of its rows, so the work is what the
// batch needs (Punica's BGMV for one row per slot, SGMV for many) and never the one-hot's S-fold
// flops. Pools are docs/design.md §6's layout, A [S, in, n*R] and n x B [S, R, out_i], in float32 or
// bfloat16; activations, sums and results are float32. bf16 pools halve the bytes a decode step
// streams, which is what bounds many distinct adapters on a CPU.
//
// Handlers (names as registered by kernels/cpu.py):
//   loraserve_lora_delta   (x [T, in], idx [T] i32, A, B_1..B_n) -> x @ A[idx] @ B[idx]  [T, D]
//   loraserve_lora_shrink  (x [T, in], idx [T] i32, A)           -> x @ A[idx]           [T, n*R]
//   loraserve_lora_expand  (h [T, n*R], idx [T] i32, B_1..B_n)   -> h @ B[idx]           [T, D]
// with D = sum(out_i) (slice i of h feeds B_i); a row whose idx is outside [0, S) gets zeros.
//   loraserve_paged_attention (q, k_pages, v_pages, positions, page_tables; its section below)
//   loraserve_linear_bf16  (x [M, K] bf16, w [N, K] bf16)       -> w @ x^T               [N, M]  f32
// The callers add y in XLA: a delta that does not wait for the base projection's output lets XLA
// run this call while the base matmul runs (1-2 ms of a 36 ms decode step on the bench model).
//
// Parallelism: work items (a slot's rows, a range of output columns) go to XLA's intra-op thread
// pool; the calling thread takes items too, so a busy pool only makes the call slower, never stuck.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using v8f = float __attribute__((vector_size(32)));
using v8h = uint16_t __attribute__((vector_size(16)));
using v8u = uint32_t __attribute__((vector_size(32)));

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bf16 -> f32: the bf16 bits are the high half of the f32 bits
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load8(const uint16_t* p) {
#ifdef __AVX2__  // one vpmovzxwd + vpslld; GCC's generic lowering of the vector code below is slower
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v8f>(__builtin_convertvector(h, v8u) << 16);
#endif
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

constexpr int kMaxSlices = 8;

struct Item {
  int32_t slot;
  int32_t row_begin, row_end;  // into Problem::rows
  int64_t lo, hi;              // output columns [lo, hi) of the D = sum(out_i) columns
};

template <class W>
struct Problem {
  int64_t T = 0, in = 0, nR = 0, R = 0, n = 0, D = 0;
  const float* x = nullptr;     // [T, in]      (delta, shrink)
  const float* h_in = nullptr;  // [T, nR]      (expand)
  const W* A = nullptr;         // [S, in, nR]  (delta, shrink)
  const W* B[kMaxSlices] = {};  // [S, R, out_i] (delta, expand)
  int64_t out[kMaxSlices] = {}, off[kMaxSlices] = {};
  float* h_out = nullptr;  // [T, nR] (shrink)
  float* o = nullptr;      // [T, D]  (delta, expand)
  std::vector<int32_t> rows;
  std::vector<Item> items;
};

// h[g, c:c+8NV] = x[row_g] @ A[:, c:c+8NV] for RB rows; A is one slot's [in, nR]. U interleaved
// partial sums over k keep at least 8 independent FMA chains in flight.
template <class W, int RB, int NV>
void shrink_block(const W* A, int64_t in, int64_t nR, int64_t c, const float* const* xr, float* h) {
  constexpr int U = RB * NV >= 8 ? 1 : (8 + RB * NV - 1) / (RB * NV);
  v8f acc[U][RB][NV] = {};
  int64_t k = 0;
  for (; k + U <= in; k += U)
    for (int u = 0; u < U; ++u)
      for (int v = 0; v < NV; ++v) {
        const v8f a = load8(A + (k + u) * nR + c + 8 * v);
        for (int g = 0; g < RB; ++g) acc[u][g][v] += xr[g][k + u] * a;
      }
  for (; k < in; ++k)
    for (int v = 0; v < NV; ++v) {
      const v8f a = load8(A + k * nR + c + 8 * v);
      for (int g = 0; g < RB; ++g) acc[0][g][v] += xr[g][k] * a;
    }
  for (int g = 0; g < RB; ++g)
    for (int v = 0; v < NV; ++v) {
      v8f sum = acc[0][g][v];
      for (int u = 1; u < U; ++u) sum += acc[u][g][v];
      store8(h + g * nR + c + 8 * v, sum);
    }
}

template <class W, int RB>
void shrink_rows(const Problem<W>& p, const W* A, const float* const* xr, float* h) {
  if (RB <= 2 && p.nR % 8 == 0 && p.nR <= 64) {  // one pass over A, every column at once
    switch (p.nR / 8) {
      case 1: return shrink_block<W, RB, 1>(A, p.in, p.nR, 0, xr, h);
      case 2: return shrink_block<W, RB, 2>(A, p.in, p.nR, 0, xr, h);
      case 3: return shrink_block<W, RB, 3>(A, p.in, p.nR, 0, xr, h);
      case 4: return shrink_block<W, RB, 4>(A, p.in, p.nR, 0, xr, h);
      case 5: return shrink_block<W, RB, 5>(A, p.in, p.nR, 0, xr, h);
      case 6: return shrink_block<W, RB, 6>(A, p.in, p.nR, 0, xr, h);
      case 7: return shrink_block<W, RB, 7>(A, p.in, p.nR, 0, xr, h);
      case 8: return shrink_block<W, RB, 8>(A, p.in, p.nR, 0, xr, h);
    }
  }
  int64_t c = 0;  // column blocks of 16 (then 8, then 1); later passes over A hit the cache
  for (; c + 16 <= p.nR; c += 16) shrink_block<W, RB, 2>(A, p.in, p.nR, c, xr, h);
  for (; c + 8 <= p.nR; c += 8) shrink_block<W, RB, 1>(A, p.in, p.nR, c, xr, h);
  for (; c < p.nR; ++c)
    for (int g = 0; g < RB; ++g) {
      float s = 0;
      for (int64_t k = 0; k < p.in; ++k) s += xr[g][k] * widen(A[k * p.nR + c]);
      h[g * p.nR + c] = s;
    }
}

// h [G, nR] = the group's rows of x @ A[slot], four rows at a time
template <class W>
void shrink(const Problem<W>& p, const Item& it, float* h) {
  const W* A = p.A + static_cast<int64_t>(it.slot) * p.in * p.nR;
  const int G = it.row_end - it.row_begin;
  const float* xr[4];
  for (int g0 = 0; g0 < G;) {
    const int rb = G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1;
    for (int g = 0; g < rb; ++g) xr[g] = p.x + static_cast<int64_t>(p.rows[it.row_begin + g0 + g]) * p.in;
    float* hg = h + static_cast<int64_t>(g0) * p.nR;
    if (rb == 4) shrink_rows<W, 4>(p, A, xr, hg);
    else if (rb == 2) shrink_rows<W, 2>(p, A, xr, hg);
    else shrink_rows<W, 1>(p, A, xr, hg);
    g0 += rb;
  }
}

// o[row_g, c0:c0+8NV] = h[g, slice] @ B[:, col:col+8NV] for RB rows; B is one slot's [R, out]
template <class W, int RB, int NV>
void expand_block(const Problem<W>& p, const W* B, int64_t out, int64_t col, int64_t c0,
                  const float* const* hr, const int64_t* row) {
  v8f acc[RB][NV] = {};
  for (int64_t j = 0; j < p.R; ++j)
    for (int v = 0; v < NV; ++v) {
      const v8f b = load8(B + j * out + col + 8 * v);
      for (int g = 0; g < RB; ++g) acc[g][v] += hr[g][j] * b;
    }
  for (int g = 0; g < RB; ++g)
    for (int v = 0; v < NV; ++v) store8(p.o + row[g] * p.D + c0 + 8 * v, acc[g][v]);
}

template <class W, int RB>
void expand_rows(const Problem<W>& p, int i, const W* B, int64_t lo, int64_t hi, const float* const* hr,
                 const int64_t* row) {
  constexpr int NV = RB == 1 ? 8 : 4;  // 8 accumulators either way
  const int64_t out = p.out[i], off = p.off[i];
  int64_t c = lo;
  for (; c + 8 * NV <= hi; c += 8 * NV) expand_block<W, RB, NV>(p, B, out, c - off, c, hr, row);
  for (; c + 8 <= hi; c += 8) expand_block<W, RB, 1>(p, B, out, c - off, c, hr, row);
  for (; c < hi; ++c)
    for (int g = 0; g < RB; ++g) {
      float s = 0;
      for (int64_t j = 0; j < p.R; ++j) s += hr[g][j] * widen(B[j * out + c - off]);
      p.o[row[g] * p.D + c] = s;
    }
}

template <class W>
void expand(const Problem<W>& p, const Item& it, const float* h) {
  const int G = it.row_end - it.row_begin;
  const float* hr[2];
  int64_t row[2];
  for (int i = 0; i < p.n; ++i) {
    const int64_t lo = std::max(it.lo, p.off[i]), hi = std::min(it.hi, p.off[i] + p.out[i]);
    if (lo >= hi) continue;
    const W* B = p.B[i] + static_cast<int64_t>(it.slot) * p.R * p.out[i];
    for (int g0 = 0; g0 < G;) {
      const int rb = G - g0 >= 2 ? 2 : 1;
      for (int g = 0; g < rb; ++g) {
        hr[g] = h + static_cast<int64_t>(g0 + g) * p.nR + i * p.R;
        row[g] = p.rows[it.row_begin + g0 + g];
      }
      if (rb == 2) expand_rows<W, 2>(p, i, B, lo, hi, hr, row);
      else expand_rows<W, 1>(p, i, B, lo, hi, hr, row);
      g0 += rb;
    }
  }
}

template <class W>
void run_item(const Problem<W>& p, const Item& it, std::vector<float>& scratch) {
  const int G = it.row_end - it.row_begin;
  scratch.resize(static_cast<size_t>(G) * p.nR);  // h [G, nR] of the group's rows
  float* h = scratch.data();
  if (p.h_in != nullptr) {  // expand only: gather the group's rows of h
    for (int g = 0; g < G; ++g)
      std::memcpy(h + g * p.nR, p.h_in + static_cast<int64_t>(p.rows[it.row_begin + g]) * p.nR, sizeof(float) * p.nR);
  } else {
    shrink(p, it, h);
  }
  if (p.h_out != nullptr) {  // shrink only: scatter h back to the rows
    for (int g = 0; g < G; ++g)
      std::memcpy(p.h_out + static_cast<int64_t>(p.rows[it.row_begin + g]) * p.nR, h + g * p.nR, sizeof(float) * p.nR);
    return;
  }
  expand(p, it, h);
}

// Runs item(k, scratch) for k in [0, n_items) on XLA's intra-op pool and the calling thread; returns when
// all are done. `item` is copied into each task (capture shared state by shared_ptr); scratch is per task.
template <class Fn>
void parallel_items(ffi::ThreadPool& pool, int64_t n_items, Fn item) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [item, progress, n_items]() {
    std::vector<float> scratch;
    for (int64_t k; (k = progress->next.fetch_add(1)) < n_items;) {
      item(k, scratch);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, n_items); ++i) pool.Schedule(decltype(work)(work));
  work();
  // Only items another thread has already claimed can be outstanding here.
  while (progress->done.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
}

// Group rows by slot, zero the rows without one, cut the groups into work items, run them.
template <class W>
ffi::Error Run(ffi::ThreadPool& pool, std::shared_ptr<Problem<W>> p, const int32_t* idx, int64_t S) {
  std::vector<int32_t> start(S + 1, 0);
  for (int64_t t = 0; t < p->T; ++t) {
    const int32_t s = idx[t];
    if (s >= 0 && s < S) {
      ++start[s + 1];
    } else if (p->h_out != nullptr) {
      std::memset(p->h_out + t * p->nR, 0, sizeof(float) * p->nR);
    } else {
      std::memset(p->o + t * p->D, 0, sizeof(float) * p->D);
    }
  }
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  p->rows.resize(start[S]);
  std::vector<int32_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < p->T; ++t) {
    const int32_t s = idx[t];
    if (s >= 0 && s < S) p->rows[fill[s]++] = static_cast<int32_t>(t);
  }
  int64_t groups = 0;
  for (int64_t s = 0; s < S; ++s) groups += start[s + 1] > start[s];
  if (groups == 0) return ffi::Error::Success();

  // Fewer groups than threads (e.g. one adapter for the whole batch): split the output columns so
  // every thread streams a share of B; each share recomputes its group's small shrink.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = 1;
  if (p->h_out == nullptr && groups < threads)
    chunks = std::min<int64_t>((threads + groups - 1) / groups, std::max<int64_t>(1, p->D / 256));
  const int64_t step = chunks == 1 ? std::max<int64_t>(p->D, 1) : ((p->D + chunks - 1) / chunks + 63) / 64 * 64;
  for (int64_t s = 0; s < S; ++s) {
    if (start[s + 1] == start[s]) continue;
    for (int64_t lo = 0; lo < std::max<int64_t>(p->D, 1); lo += step)
      p->items.push_back({static_cast<int32_t>(s), start[s], start[s + 1], lo, std::min(p->D, lo + step)});
  }

  parallel_items(pool, static_cast<int64_t>(p->items.size()),
                 [p](int64_t k, std::vector<float>& scratch) { run_item(*p, p->items[k], scratch); });
  return ffi::Error::Success();
}

bool is_f32(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::F32; }
bool is_pool(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::F32 || b.element_type() == ffi::DataType::BF16;
}

// Reads the B pools (n of them, same S, same R, same dtype as `like`) into p; D = sum(out_i).
template <class W>
ffi::Error ReadBs(const ffi::RemainingArgs& bs, ffi::DataType like, int64_t S, Problem<W>& p) {
  p.n = static_cast<int64_t>(bs.size());
  if (p.n < 1 || p.n > kMaxSlices) return ffi::Error::InvalidArgument("lora: between 1 and 8 B pools");
  int64_t off = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    auto b = bs.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument("lora: a B pool is not a buffer");
    auto d = b->dimensions();
    if (d.size() != 3 || d[0] != S || b->element_type() != like || (i > 0 && d[1] != p.R))
      return ffi::Error::InvalidArgument("lora: B pools must be [S, R, out] with A's S and dtype");
    p.R = d[1];
    p.B[i] = reinterpret_cast<const W*>(b->untyped_data());
    p.out[i] = d[2];
    p.off[i] = off;
    off += d[2];
  }
  p.D = off;
  return ffi::Error::Success();
}

template <class W>
ffi::Error DeltaImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer idx, ffi::AnyBuffer A,
                     ffi::RemainingArgs bs, ffi::Result<ffi::AnyBuffer> out) {
  auto p = std::make_shared<Problem<W>>();
  auto xd = x.dimensions(), ad = A.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || ad.size() != 3 || idx.dimensions().size() != 1 || !is_f32(x) ||
      idx.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("lora_delta: x [T, in] f32, idx [T] i32, A [S, in, nR]");
  if (auto e = ReadBs(bs, A.element_type(), ad[0], *p); e.failure()) return e;
  p->T = xd[0];
  p->in = xd[1];
  p->nR = ad[2];
  if (idx.dimensions()[0] != p->T || ad[1] != p->in || p->nR != p->n * p->R || od.size() != 2 || od[0] != p->T ||
      od[1] != p->D)
    return ffi::Error::InvalidArgument("lora_delta: shapes do not line up");
  p->x = static_cast<const float*>(x.untyped_data());
  p->A = static_cast<const W*>(A.untyped_data());
  p->o = static_cast<float*>(out->untyped_data());
  return Run(pool, p, static_cast<const int32_t*>(idx.untyped_data()), ad[0]);
}

template <class W>
ffi::Error ShrinkImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer idx, ffi::AnyBuffer A,
                      ffi::Result<ffi::AnyBuffer> h) {
  auto p = std::make_shared<Problem<W>>();
  auto xd = x.dimensions(), ad = A.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || idx.dimensions().size() != 1 || !is_f32(x) ||
      idx.element_type() != ffi::DataType::S32 || idx.dimensions()[0] != xd[0] || ad[1] != xd[1])
    return ffi::Error::InvalidArgument("lora_shrink: x [T, in] f32, idx [T] i32, A [S, in, R]");
  p->T = xd[0];
  p->in = xd[1];
  p->nR = ad[2];
  p->x = static_cast<const float*>(x.untyped_data());
  p->A = static_cast<const W*>(A.untyped_data());
  p->h_out = static_cast<float*>(h->untyped_data());
  return Run(pool, p, static_cast<const int32_t*>(idx.untyped_data()), ad[0]);
}

template <class W>
ffi::Error ExpandImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer idx, ffi::RemainingArgs bs,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto p = std::make_shared<Problem<W>>();
  auto hd = h.dimensions(), od = out->dimensions();
  if (hd.size() != 2 || idx.dimensions().size() != 1 || !is_f32(h) || idx.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("lora_expand: h [T, nR] f32, idx [T] i32");
  auto b0 = bs.get<ffi::AnyBuffer>(0);
  if (!b0.has_value() || b0->dimensions().size() != 3)
    return ffi::Error::InvalidArgument("lora_expand: B pools must be [S, R, out]");
  const int64_t S = b0->dimensions()[0];
  if (auto e = ReadBs(bs, b0->element_type(), S, *p); e.failure()) return e;
  p->T = hd[0];
  p->nR = hd[1];
  if (idx.dimensions()[0] != p->T || p->nR != p->n * p->R || od.size() != 2 || od[0] != p->T || od[1] != p->D)
    return ffi::Error::InvalidArgument("lora_expand: shapes do not line up");
  p->h_in = static_cast<const float*>(h.untyped_data());
  p->o = static_cast<float*>(out->untyped_data());
  return Run(pool, p, static_cast<const int32_t*>(idx.untyped_data()), S);
}

// dtype dispatch: float32 or bfloat16 pools
ffi::Error Delta(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer idx, ffi::AnyBuffer A, ffi::RemainingArgs bs,
                 ffi::Result<ffi::AnyBuffer> out) {
  if (!is_pool(A)) return ffi::Error::InvalidArgument("lora_delta: pools must be float32 or bfloat16");
  return is_f32(A) ? DeltaImpl<float>(pool, x, idx, A, bs, out) : DeltaImpl<uint16_t>(pool, x, idx, A, bs, out);
}

ffi::Error Shrink(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer idx, ffi::AnyBuffer A,
                  ffi::Result<ffi::AnyBuffer> h) {
  if (!is_pool(A)) return ffi::Error::InvalidArgument("lora_shrink: pools must be float32 or bfloat16");
  return is_f32(A) ? ShrinkImpl<float>(pool, x, idx, A, h) : ShrinkImpl<uint16_t>(pool, x, idx, A, h);
}

ffi::Error Expand(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer idx, ffi::RemainingArgs bs,
                  ffi::Result<ffi::AnyBuffer> out) {
  auto b0 = bs.get<ffi::AnyBuffer>(0);
  if (!b0.has_value() || !is_pool(*b0))
    return ffi::Error::InvalidArgument("lora_expand: pools must be float32 or bfloat16");
  return is_f32(*b0) ? ExpandImpl<float>(pool, h, idx, bs, out) : ExpandImpl<uint16_t>(pool, h, idx, bs, out);
}


// ---------------------------------------------------------------------------------------------------
// Paged decode attention (kernels/attention.py, impl "cpu"): one query per row over the keys and values
// its page table lists, read in place (the XLA path gathers every row's pages into a dense copy first:
// 128 MB a step at batch 64 of the bench model). Semantics are _xla's, op for op: logits
// softcap(scale * q.k) over positions [max(0, pos - window + 1), pos], softmax in f32, the probabilities
// rounded to bf16 when the pages are bf16 (as _xla casts them to V's dtype), sums in f32.
//   loraserve_paged_attention (q [B, H, D] f32, k_pages, v_pages [KV, N, P, D] f32 | bf16 | u16 bits,
//                              positions [B] i32, tables [B, W] i32; scale, softcap (0 = none),
//                              window (0 = none)) -> [B, H, D] f32
inline float round_bf16(float f) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float hsum(v8f v) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

template <class W>
struct AttnProblem {
  int64_t B = 0, H = 0, D = 0, KV = 0, N = 0, P = 0, Wd = 0, window = 0;
  float scale = 1, softcap = 0;
  const float* q = nullptr;
  const W* k = nullptr;
  const W* v = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* tables = nullptr;
  float* o = nullptr;
};

template <class W>
void attend(const AttnProblem<W>& p, int64_t b, int64_t kh, std::vector<float>& buf) {
  const int64_t G = p.H / p.KV, D = p.D;
  const int64_t last = std::min<int64_t>(p.pos[b], p.Wd * p.P - 1);
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, last - p.window + 1) : 0;
  const int64_t n = last - first + 1;
  float* out = p.o + (b * p.H + kh * G) * D;
  if (n <= 0) {
    std::memset(out, 0, sizeof(float) * G * D);
    return;
  }
  buf.resize(static_cast<size_t>(G * n));
  const float* q = p.q + (b * p.H + kh * G) * D;
  const bool vec = D % 8 == 0;
  auto row = [&](const W* pages, int64_t s) {
    const int64_t page = p.tables[b * p.Wd + s / p.P];
    return pages + ((kh * p.N + page) * p.P + s % p.P) * D;
  };
  for (int64_t s = first; s <= last; ++s) {
    const W* k = row(p.k, s);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0;
      if (vec) {
        v8f acc = {};
        for (int64_t d = 0; d < D; d += 8) acc += load8(q + g * D + d) * load8(k + d);
        dot = hsum(acc);
      } else {
        for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * widen(k[d]);
      }
      float x = dot * p.scale;
      if (p.softcap > 0) x = std::tanh(x / p.softcap) * p.softcap;
      buf[g * n + (s - first)] = x;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = buf.data() + g * n;
    float m = sc[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sc[i]);
    float total = 0;
    for (int64_t i = 0; i < n; ++i) total += (sc[i] = std::exp(sc[i] - m));
    for (int64_t i = 0; i < n; ++i) {
      const float pr = sc[i] / total;
      sc[i] = std::is_same<W, float>::value ? pr : round_bf16(pr);
    }
    std::memset(out + g * D, 0, sizeof(float) * D);
  }
  for (int64_t s = first; s <= last; ++s) {
    const W* v = row(p.v, s);
    for (int64_t g = 0; g < G; ++g) {
      const float pr = buf[g * n + (s - first)];
      float* og = out + g * D;
      if (vec) {
        for (int64_t d = 0; d < D; d += 8) store8(og + d, load8(og + d) + pr * load8(v + d));
      } else {
        for (int64_t d = 0; d < D; ++d) og[d] += pr * widen(v[d]);
      }
    }
  }
}

template <class W>
ffi::Error AttentionImpl(ffi::ThreadPool& pool, std::shared_ptr<AttnProblem<W>> p) {
  parallel_items(pool, p->B * p->KV,
                 [p](int64_t k, std::vector<float>& buf) { attend(*p, k / p->KV, k % p->KV, buf); });
  return ffi::Error::Success();
}

template <class W>
ffi::Error AttentionTyped(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer pos, ffi::AnyBuffer tables, ffi::Result<ffi::AnyBuffer> out, float scale,
                          float softcap, int64_t window) {
  auto p = std::make_shared<AttnProblem<W>>();
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  p->B = qd[0], p->H = qd[1], p->D = qd[2];
  p->KV = kd[0], p->N = kd[1], p->P = kd[2];
  p->Wd = td[1];
  auto vd = v.dimensions(), od = out->dimensions();
  const bool v_like_k = vd.size() == 4 && vd[0] == kd[0] && vd[1] == kd[1] && vd[2] == kd[2] && vd[3] == kd[3];
  const bool o_like_q = od.size() == 3 && od[0] == qd[0] && od[1] == qd[1] && od[2] == qd[2];
  if (kd[3] != p->D || p->KV < 1 || p->H % p->KV != 0 || td[0] != p->B || pos.dimensions()[0] != p->B ||
      !v_like_k || !o_like_q)
    return ffi::Error::InvalidArgument("paged_attention: shapes do not line up");
  p->scale = scale, p->softcap = softcap, p->window = window;
  p->q = static_cast<const float*>(q.untyped_data());
  p->k = static_cast<const W*>(k.untyped_data());
  p->v = static_cast<const W*>(v.untyped_data());
  p->pos = static_cast<const int32_t*>(pos.untyped_data());
  p->tables = static_cast<const int32_t*>(tables.untyped_data());
  p->o = static_cast<float*>(out->untyped_data());
  return AttentionImpl(pool, p);
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer pos,
                     ffi::AnyBuffer tables, ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                     int64_t window) {
  const auto t = k.element_type();
  if (q.dimensions().size() != 3 || k.dimensions().size() != 4 || tables.dimensions().size() != 2 ||
      pos.dimensions().size() != 1 || !is_f32(q) || pos.element_type() != ffi::DataType::S32 ||
      tables.element_type() != ffi::DataType::S32 || v.element_type() != t)
    return ffi::Error::InvalidArgument("paged_attention: q [B, H, D] f32, pages [KV, N, P, D], i32 positions/tables");
  if (t == ffi::DataType::F32)
    return AttentionTyped<float>(pool, q, k, v, pos, tables, out, scale, softcap, window);
  if (t == ffi::DataType::BF16 || t == ffi::DataType::U16)
    return AttentionTyped<uint16_t>(pool, q, k, v, pos, tables, out, scale, softcap, window);
  return ffi::Error::InvalidArgument("paged_attention: pages must be float32, bfloat16 or bf16 bits (uint16)");
}


// ---------------------------------------------------------------------------------------------------
// bf16 decode projections (kernels/linear.py): y [N, M] = w [N, K] . x [M, K]^T, f32 sums, for the few
// rows of a decode step of a bf16 model. XLA:CPU streams a bf16 weight matrix at 11-14 GB/s for 4-16
// rows; this kernel keeps DRAM busy by prefetching the weights a dozen 4-row blocks ahead of the block it
// multiplies, and on CPUs with AVX-512 BF16 multiplies with vdpbf16ps (two products per f32 lane and
// instruction). Each output is the dot product of two contiguous rows (Hugging Face's layout as is),
// computed as 4 x 4 tiles of 16-lane partial sums, reduced once at the end of K.
//   loraserve_linear_bf16 (x [M, K] bf16, w [N, K] bf16) -> [N, M] f32   (weights-first, like linear)
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
  parallel_items(pool, items, [p](int64_t k, std::vector<float>&) {
    lin_rows(*p, k * kLinItemRows, std::min(p->N, (k + 1) * kLinItemRows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraDelta, Delta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // A
                                  .RemainingArgs()        // B_1..B_n
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraShrink, Shrink,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // A
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraExpand, Expand,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // h
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .RemainingArgs()        // B_1..B_n
                                  .Ret<ffi::AnyBuffer>());

// What -march=native found (kernels/cpu.py): 1 when this build multiplies bf16 with AVX-512 BF16 dot
// products (0: it widens to f32), and 1 when the CPU has AMX tiles (XLA's own GEMMs may use them there).
extern "C" int LoraserveLinearBf16Dot() { return kLinBf16Dot ? 1 : 0; }
#ifdef __AMX_BF16__
extern "C" int LoraserveCpuAmx() { return 1; }
#else
extern "C" int LoraserveCpuAmx() { return 0; }
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearBf16, LinearBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::AnyBuffer>()  // positions
                                  .Arg<ffi::AnyBuffer>()  // tables
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));
