// Products over the GGUF quant blocks (quant_format.h) with the inputs quantized to 8 bits too,
// as llama.cpp computes them: each row of x is cut into blocks of 32 values, each kept as 32
// signed bytes q and a scale d = max |x| / 127, and a block's 32 products are integer
// multiply-adds (vpmaddubsw, or vpdpbusd with AVX512-VNNI) scaled once by d_weight * d_x.
// Less arithmetic than widening each weight to fp32 (quant_linear.cpp), but every input value
// is rounded to one of 255 steps of its block: opt-in (`model.quant_inputs: int8`).
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_format.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kOutputs = 4;  // weight rows multiplied together
constexpr int kRows = 2;     // input rows multiplied together: each weight block loaded once
constexpr int64_t kPrefetchBytes = 8192;

// x as 8-bit blocks: block b of row r is q[(r * blocks + b) * 32 ...], its scale d[r * blocks + b]
// and d * (the sum of its q) in sums[...], for Q4_1's m * sum(x) term.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t width) {
  const int64_t blocks = rows * (width / kBlock);
  QuantizedRows out{std::vector<int8_t>(rows * width), std::vector<float>(blocks),
                    std::vector<float>(blocks)};
  for (int64_t i = 0; i < blocks; ++i) {
    const float* values = x + i * kBlock;
    float largest = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) largest = std::max(largest, std::fabs(values[k]));
    const float d = largest / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int total = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      const auto q = static_cast<int8_t>(std::lrintf(values[k] * inverse));
      out.q[i * kBlock + k] = q;
      total += q;
    }
    out.d[i] = d;
    out.sums[i] = d * static_cast<float>(total);
  }
  return out;
}

#if defined(__AVX2__)
using Sums = __m256i;  // eight int32 sums of four products each
using Acc = __m256;

// Unsigned bytes u times signed bytes s, summed four by four.
inline Sums dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline __m256i load_x(const int8_t* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}
inline Acc zero_acc() { return _mm256_setzero_ps(); }
inline Acc scale_add(Acc acc, Sums sums, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
}
inline float total(Acc a) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

struct Q4_1 {
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static constexpr bool kOffset = true;
  struct Weights {
    __m256i q;  // values 0-31 as bytes 0-15
    float d, m;
  };
  static Weights load(const uint8_t* block) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i nibble = _mm_set1_epi8(0xF);
    return {_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble),
                             _mm_and_si128(raw, nibble)),
            half_to_float(block), half_to_float(block + 2)};
  }
  static Sums dot(const Weights& w, __m256i x) { return dot_u8_s8(w.q, x); }
};

struct Q8_0 {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  static constexpr bool kOffset = false;
  struct Weights {
    __m256i q;
    float d, m;
  };
  static Weights load(const uint8_t* block) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2)),
            half_to_float(block), 0.0f};
  }
  // w . x as |w| . (x with w's signs), the form unsigned-times-signed instructions take.
  static Sums dot(const Weights& w, __m256i x) {
    return dot_u8_s8(_mm256_abs_epi8(w.q), _mm256_sign_epi8(x, w.q));
  }
};
#else
using Sums = int32_t;
using Acc = float;

inline const int8_t* load_x(const int8_t* q) { return q; }
inline Acc zero_acc() { return 0.0f; }
inline Acc scale_add(Acc acc, Sums sums, float scale) {
  return acc + static_cast<float>(sums) * scale;
}
inline float total(Acc a) { return a; }

struct Q4_1 {
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static constexpr bool kOffset = true;
  struct Weights {
    const uint8_t* q;
    float d, m;
  };
  static Weights load(const uint8_t* block) {
    return {block + 4, half_to_float(block), half_to_float(block + 2)};
  }
  static Sums dot(const Weights& w, const int8_t* x) {
    Sums out = 0;
    for (int k = 0; k < 16; ++k) out += (w.q[k] & 0xF) * x[k] + (w.q[k] >> 4) * x[k + 16];
    return out;
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  static constexpr bool kOffset = false;
  struct Weights {
    const int8_t* q;
    float d, m;
  };
  static Weights load(const uint8_t* block) {
    return {reinterpret_cast<const int8_t*>(block + 2), half_to_float(block), 0.0f};
  }
  static Sums dot(const Weights& w, const int8_t* x) {
    Sums out = 0;
    for (int k = 0; k < kBlock; ++k) out += w.q[k] * x[k];
    return out;
  }
};
#endif

// out[r, n + o] = x[first + r] . weight[n + o] for O weight rows and R input rows.
template <typename Format, int O, int R, typename T>
void tile(const QuantizedRows& x, int64_t first, int64_t blocks, const uint8_t* weight,
          int64_t row_bytes, int64_t n, T* out, int64_t out_stride) {
  Acc acc[O][R];
  float offset[O][R] = {};
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = zero_acc();
  for (int64_t b = 0; b < blocks; ++b) {
    decltype(load_x(nullptr)) rows[R];
    for (int r = 0; r < R; ++r) rows[r] = load_x(x.q.data() + ((first + r) * blocks + b) * kBlock);
    for (int o = 0; o < O; ++o) {
      const uint8_t* block = weight + (n + o) * row_bytes + b * Format::kBytes;
      __builtin_prefetch(block + kPrefetchBytes);
      const auto w = Format::load(block);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (first + r) * blocks + b;
        acc[o][r] = scale_add(acc[o][r], Format::dot(w, rows[r]), w.d * x.d[i]);
        if constexpr (Format::kOffset) offset[o][r] += w.m * x.sums[i];
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r)
      out[r * out_stride + n + o] = static_cast<T>(total(acc[o][r]) + offset[o][r]);
}

template <typename Format, typename T>
void product(const QuantizedRows& x, int64_t rows, int64_t width, const uint8_t* weight,
             int64_t outputs, T* out) {
  const int64_t blocks = width / kBlock, row_bytes = blocks * Format::kBytes;
  const int64_t groups = outputs / kOutputs;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kOutputs; n < end * kOutputs; n += kOutputs) {
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows)
        tile<Format, kOutputs, kRows>(x, r, blocks, weight, row_bytes, n, out + r * outputs,
                                      outputs);
      for (; r < rows; ++r)
        tile<Format, kOutputs, 1>(x, r, blocks, weight, row_bytes, n, out + r * outputs, outputs);
    }
  });
  for (int64_t n = groups * kOutputs; n < outputs; ++n)  // a last, partial group
    for (int64_t r = 0; r < rows; ++r)
      tile<Format, 1, 1>(x, r, blocks, weight, row_bytes, n, out + r * outputs, outputs);
}

}  // namespace

// x [rows, K] fp32 or bf16; weight uint8 [N, K / 32 * block bytes] of 4-bit (Q4_1) or 8-bit
// (Q8_0) blocks. Returns x @ weight.T as [rows, N] in x's dtype, x quantized to 8-bit blocks.
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor weight, int64_t bits) {
  check_operands("quant_linear_int8", x, weight, bits);
  const auto wide = x.to(at::kFloat).contiguous();
  const QuantizedRows rows = quantize_rows(wide.data_ptr<float>(), x.size(0), x.size(1));
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear_int8", [&] {
    const auto run = bits == 4 ? product<Q4_1, scalar_t> : product<Q8_0, scalar_t>;
    run(rows, x.size(0), x.size(1), weight.data_ptr<uint8_t>(), weight.size(0),
        out.data_ptr<scalar_t>());
  });
  return out;
}
