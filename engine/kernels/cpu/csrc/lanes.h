// Sixteen fp32 lanes: one AVX-512 register, two AVX2 registers, or a plain array, by the
// instruction set the build targets (engine/kernels/isa.py); the same arithmetic on each.
// Shared by the kernels in engine/kernels/cpu/csrc.
#pragma once

#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define RAGING_LANES "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define RAGING_LANES "avx2"
#else
#define RAGING_LANES "scalar"
#endif

namespace {

constexpr int64_t kLanes = 16;  // floats per vector

// 2^f for |f| <= 1/2, highest power first (Horner): the exp of both vector widths below.
constexpr int kExpTerms = 7;
constexpr float kExpSeries[kExpTerms] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f,
                                         5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};

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
// v[0..16), vectors of partial sums, into one: lane i of the result is the sum of v[i].
inline Lanes sum_each(const Lanes* v) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(halves[2 * i]), b = _mm512_castps_pd(halves[2 * i + 1]);
    quarters[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    eighths[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[2 * i], quarters[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(quarters[2 * i], quarters[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(eighths[0], eighths[1], 0x88),
                       _mm512_shuffle_f32x4(eighths[0], eighths[1], 0xDD));
}
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
  Lanes p = splat(kExpSeries[0]);
  for (int i = 1; i < kExpTerms; ++i) p = fma(p, f, splat(kExpSeries[i]));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline __m256 widen_bf16(__m128i raw) {  // eight bf16, each the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Lanes load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes load_lanes(const at::BFloat16* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes add(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes mul(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline float sum8(__m256 a) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
inline float sum(Lanes a) { return sum8(_mm256_add_ps(a.lo, a.hi)); }
// Eight vectors into one: lane i of the result is the sum of v[i].
inline __m256 sum8_each(const __m256* v) {
  const __m256 quads[2] = {_mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3])),
                           _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]))};
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
// v[0..16), vectors of partial sums, into one: lane i of the result is the sum of v[i].
inline Lanes sum_each(const Lanes* v) {
  __m256 halves[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) halves[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum8_each(halves), sum8_each(halves + 8)};
}
inline __m256 first_mask8(int64_t n) {  // all ones in lanes 0..n-1
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto count = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), index));
}
// The first `n` lanes of `a` (all of them from n = 16), the others 0.
inline Lanes first_lanes(Lanes a, int64_t n) {
  return {_mm256_and_ps(a.lo, first_mask8(n)), _mm256_and_ps(a.hi, first_mask8(n - 8))};
}
// The largest of p[0..n), n >= 1.
inline float max_of(const float* p, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(p + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float out = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) out = std::max(out, p[i]);
  return out;
}
inline void store(float* p, Lanes a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// e^x for x <= 0, as the AVX-512 path computes it, with 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                 _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExpSeries[0]);
  for (int i = 1; i < kExpTerms; ++i)
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpSeries[i]));
  const __m256i power = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
inline Lanes exp_lanes(Lanes x) { return {exp8(x.lo), exp8(x.hi)}; }
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
inline Lanes sum_each(const Lanes* v) {
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out.v[i] = sum(v[i]);
  return out;
}
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
