// Grouped multi-LoRA for CPUs, as XLA FFI custom calls (kernels/cpu.py builds them, with attention.cc and
// linear.cc, into one library and registers them).
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
// The callers add y in XLA: a delta that does not wait for the base projection's output lets XLA
// run this call while the base matmul runs (1-2 ms of a 36 ms decode step on the bench model).
//
// Parallelism: work items (a slot's rows, a range of output columns) go to XLA's intra-op thread
// pool; the calling thread takes items too, so a busy pool only makes the call slower, never stuck.
#include "common.h"

namespace {

constexpr int kMaxSlices = 8;

// The vectors the shrink and expand blocks use: 16 lanes on AVX-512 builds (half the instructions of 8; each
// lane is one output column with the same chain of operations either way, so the results are the same bits),
// 8 elsewhere; a block of 8 columns left over after the 16-wide ones takes 8-lane vectors.
struct Lanes8 {
  using T = v8f;
  static constexpr int W = 8;
  template <class X>
  static T load(const X* p) {
    return load8(p);
  }
  static void store(float* p, T v) { store8(p, v); }
};
#ifdef __AVX512F__
using v16f = float __attribute__((vector_size(64)));
struct Lanes16 {
  using T = v16f;
  static constexpr int W = 16;
  static T load(const float* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static T load(const uint16_t* p) {  // bf16 -> f32: the bits shifted into the high half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<T>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  static void store(float* p, T v) { std::memcpy(p, &v, sizeof v); }
};
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif

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

// h[g, c:c+8NV] = x[row_g] @ A[:, c:c+8NV] for RB rows; A is one slot's [in, nR]. Every output is summed
// the same way whatever RB and NV are (kChains interleaved partial sums over k, the odd tail of k into the
// first, then added in order), so a row's bits never depend on how many rows share its slot or where it
// sits among them: batch invariance (tests/kernels/test_row_isolation.py).
constexpr int kChains = 2;

template <class V, class W, int RB, int NV>
void shrink_block(const W* A, int64_t in, int64_t nR, int64_t c, const float* const* xr, float* h) {
  typename V::T acc[kChains][RB][NV] = {};
  int64_t k = 0;
  for (; k + kChains <= in; k += kChains)
    for (int u = 0; u < kChains; ++u)
      for (int v = 0; v < NV; ++v) {
        const typename V::T a = V::load(A + (k + u) * nR + c + V::W * v);
        for (int g = 0; g < RB; ++g) acc[u][g][v] += xr[g][k + u] * a;
      }
  for (; k < in; ++k)
    for (int v = 0; v < NV; ++v) {
      const typename V::T a = V::load(A + k * nR + c + V::W * v);
      for (int g = 0; g < RB; ++g) acc[0][g][v] += xr[g][k] * a;
    }
  for (int g = 0; g < RB; ++g)
    for (int v = 0; v < NV; ++v) {
      typename V::T sum = acc[0][g][v];
      for (int u = 1; u < kChains; ++u) sum += acc[u][g][v];
      V::store(h + g * nR + c + V::W * v, sum);
    }
}

// The last `blocks` (< NV + 1) blocks of V::W columns as one pass over A.
template <class V, class W, int RB, int NV>
void shrink_rest(const Problem<W>& p, const W* A, int64_t c, int64_t blocks, const float* const* xr, float* h) {
  if constexpr (NV >= 1) {
    if (blocks == NV) return shrink_block<V, W, RB, NV>(A, p.in, p.nR, c, xr, h);
    shrink_rest<V, W, RB, NV - 1>(p, A, c, blocks, xr, h);
  }
}

template <class W, int RB>
void shrink_rows(const Problem<W>& p, const W* A, const float* const* xr, float* h) {
  constexpr int NV = 8 / RB;  // kChains * RB * NV = 16 accumulators: one pass over A for nR <= W * 8 / RB
  constexpr int L = Lanes::W;
  int64_t c = 0;
  for (; c + L * NV <= p.nR; c += L * NV) shrink_block<Lanes, W, RB, NV>(A, p.in, p.nR, c, xr, h);
  const int64_t blocks = (p.nR - c) / L;
  shrink_rest<Lanes, W, RB, NV - 1>(p, A, c, blocks, xr, h);
  c += L * blocks;
  if constexpr (L > 8) {
    if (c + 8 <= p.nR) shrink_block<Lanes8, W, RB, 1>(A, p.in, p.nR, c, xr, h), c += 8;
  }
  for (; c < p.nR; ++c)  // the last nR % 8 columns: one chain each, for any RB
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

// o[row_g, c0:c0+W NV] = h[g, slice] @ B[:, col:col+W NV] for RB rows; B is one slot's [R, out]
template <class V, class W, int RB, int NV>
void expand_block(const Problem<W>& p, const W* B, int64_t out, int64_t col, int64_t c0,
                  const float* const* hr, const int64_t* row) {
  typename V::T acc[RB][NV] = {};
  for (int64_t j = 0; j < p.R; ++j)
    for (int v = 0; v < NV; ++v) {
      const typename V::T b = V::load(B + j * out + col + V::W * v);
      for (int g = 0; g < RB; ++g) acc[g][v] += hr[g][j] * b;
    }
  for (int g = 0; g < RB; ++g)
    for (int v = 0; v < NV; ++v) V::store(p.o + row[g] * p.D + c0 + V::W * v, acc[g][v]);
}

template <class W, int RB>
void expand_rows(const Problem<W>& p, int i, const W* B, int64_t lo, int64_t hi, const float* const* hr,
                 const int64_t* row) {
  constexpr int NV = RB == 1 ? 8 : 4, L = Lanes::W;  // 8 accumulators either way
  const int64_t out = p.out[i], off = p.off[i];
  int64_t c = lo;
  for (; c + L * NV <= hi; c += L * NV) expand_block<Lanes, W, RB, NV>(p, B, out, c - off, c, hr, row);
  for (; c + L <= hi; c += L) expand_block<Lanes, W, RB, 1>(p, B, out, c - off, c, hr, row);
  for (; c + 8 <= hi; c += 8) expand_block<Lanes8, W, RB, 1>(p, B, out, c - off, c, hr, row);
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
