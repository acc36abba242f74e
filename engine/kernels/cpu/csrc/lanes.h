// Sixteen fp32 lanes: AVX-512 registers where the compiler targets them, plain arrays
// elsewhere (the same arithmetic, slower). Shared by the kernels in engine/kernels/cpu/csrc.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // floats per vector

#if defined(__AVX512F__)
using Lanes = __m512;
inline Lanes load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes load_lanes(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Lanes splat(float x) { return _mm512_set1_ps(x); }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline Lanes mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline float sum(Lanes a) { return _mm512_reduce_add_ps(a); }
inline __mmask16 first_mask(int64_t n) {  // lanes 0..n-1
  return n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}
// The first `n` lanes of `a` (all of them from n = 16), the others 0.
inline Lanes first_lanes(Lanes a, int64_t n) { return _mm512_maskz_mov_ps(first_mask(n), a); }
// The largest of p[0..n), n >= 1.
inline float max_of(const float* p, int64_t n) {
  Lanes best = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += kLanes)
    best = _mm512_max_ps(best, _mm512_mask_loadu_ps(best, first_mask(n - i), p + i));
  return _mm512_reduce_max_ps(best);
}
inline void store(float* p, Lanes a) { _mm512_storeu_ps(p, a); }
// e^x for x <= 0: 2^n * 2^f with n = round(x log2 e) and 2^f from its Taylor series
// (|f| <= 1/2, relative error about 1e-7).
inline Lanes exp_lanes(Lanes x) {
  const Lanes t = _mm512_mul_ps(_mm512_max_ps(x, splat(-87.0f)), splat(1.44269504f));
  const Lanes n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Lanes f = _mm512_sub_ps(t, n);
  Lanes p = splat(1.5403530e-4f);
  for (float c : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f,
                  1.0f})
    p = fma(p, f, splat(c));
  return _mm512_scalef_ps(p, n);
}
#else
struct Lanes {
  float v[kLanes];
};
template <typename T>
inline Lanes load_lanes(const T* p) {
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out.v[i] = static_cast<float>(p[i]);
  return out;
}
inline Lanes splat(float x) {
  Lanes out;
  std::fill(out.v, out.v + kLanes, x);
  return out;
}
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
  for (int64_t i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Lanes add(Lanes a, Lanes b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Lanes mul(Lanes a, Lanes b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float sum(Lanes a) { return std::accumulate(a.v, a.v + kLanes, 0.0f); }
inline Lanes first_lanes(Lanes a, int64_t n) {
  for (int64_t i = std::max<int64_t>(n, 0); i < kLanes; ++i) a.v[i] = 0.0f;
  return a;
}
inline float max_of(const float* p, int64_t n) { return *std::max_element(p, p + n); }
inline void store(float* p, Lanes a) { std::copy(a.v, a.v + kLanes, p); }
inline Lanes exp_lanes(Lanes x) {
  for (float& value : x.v) value = std::exp(value);
  return x;
}
#endif

// Writes `a` as T (bf16 rounded to nearest even).
template <typename T>
inline void store_as(T* p, Lanes a) {
  float lanes[kLanes];
  store(lanes, a);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(lanes[i]);
}
template <>
inline void store_as<float>(float* p, Lanes a) { store(p, a); }

}  // namespace
