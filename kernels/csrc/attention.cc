// Paged decode attention (kernels/attention.py, impl "cpu"): one query per row over the keys and values
// its page table lists, read in place (the XLA path gathers every row's pages into a dense copy first:
// 128 MB a step at batch 64 of the bench model). Semantics are _xla's, op for op: logits
// softcap(scale * q.k) over positions [max(0, pos - window + 1), pos], softmax in f32, the probabilities
// rounded to bf16 when the pages are bf16 (as _xla casts them to V's dtype), sums in f32.
//   loraserve_paged_attention (q [B, H, D] f32, k_pages, v_pages [KV, N, P, D] f32 | bf16 | u16 bits,
//                              positions [B] i32, tables [B, W] i32; scale, softcap (0 = none),
//                              window (0 = none)) -> [B, H, D] f32
#include "common.h"

namespace {

inline float round_bf16(float f) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp of 8 values at once (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n
// through the exponent bits): within 2 ulp of std::exp, whose scalar calls took half of a decode step's
// attention (a softmax over 16 rows x 16 heads x 80 positions). x <= 0 here (scores minus their maximum); below
// -87.3 the result is 0 (std::exp's denormals there, ~1e-38, vanish beside the softmax's total of >= 1 anyway).
inline v8f exp8(v8f x) {
  using v8i = int32_t __attribute__((vector_size(32)));
  const v8f lo = x < -87.3f ? v8f{} + 1 : v8f{};  // lanes to zero
  x = x < -87.3f ? v8f{} - 87.3f : x;
  v8f fx = x * 1.44269504088896341f + 0.5f;
  const v8i n0 = __builtin_convertvector(fx, v8i);  // toward zero: floor for the positive ones
  v8f n = __builtin_convertvector(n0, v8f);
  n = n > fx ? n - 1 : n;  // floor(x log2e + 0.5)
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v8f z = x * x;
  v8f y = v8f{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  const v8f scale = reinterpret_cast<v8f>(bits);
  const v8f r = y * scale;
  return lo > 0 ? v8f{} : r;
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
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(sc + i, exp8(load8(sc + i) - m));
    for (; i < n; ++i) sc[i] = std::exp(sc[i] - m);
    float total = 0;
    for (i = 0; i < n; ++i) total += sc[i];
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


}  // namespace

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
