// Shared by the CPU kernels (kernels/csrc/*.cc, built into one library by kernels/cpu.py): vector
// loads of f32 and bf16, the horizontal sum, and the work loop over XLA's intra-op thread pool.
#pragma once

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
inline v8f load8(const int8_t* p) {  // 8 int8 -> 8 f32 (exact)
#ifdef __AVX2__
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8f>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline float widen(int8_t v) { return static_cast<float>(v); }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(v8f v) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
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

// n values in v from a 64-byte boundary (a vector load of a line-aligned row then never splits two lines:
// malloc aligns to 16); zeroed when zero is set.
template <class T>
T* aligned64(std::vector<T>& v, int64_t n, bool zero) {
  const int64_t pad = 64 / sizeof(T);
  if (zero)
    v.assign(n + pad, T(0));
  else
    v.resize(n + pad);
  const uintptr_t a = (reinterpret_cast<uintptr_t>(v.data()) + 63) / 64 * 64;
  return reinterpret_cast<T*>(a);
}

inline bool is_f32(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::F32; }

}  // namespace
