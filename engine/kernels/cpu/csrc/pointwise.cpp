// Row-wise operations of a decode step that torch runs as several small kernels each: one
// pass each here, computed in fp32 and rounded once to the input's dtype.
#include "tensor.h"

#include <cmath>

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width,
                   int64_t row_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * row_stride;
    float squares = 0.0f;
    for (int64_t i = 0; i < width; ++i) {
      const float value = static_cast<float>(in[i]);
      squares += value * value;
    }
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
    T* o = out + r * width;
    for (int64_t i = 0; i < width; ++i)
      o[i] = static_cast<T>(static_cast<float>(in[i]) * scale * static_cast<float>(weight[i]));
  }
}

// out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], rotate_half(v) = (-v2, v1).
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
               int64_t dim, int64_t token_stride, int64_t head_stride) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const T* in = x + t * token_stride + h * head_stride;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      T* o = out + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(in[i]), b = static_cast<float>(in[i + half]);
        o[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
        o[i + half] = static_cast<T>(b * static_cast<float>(c[i + half]) +
                                     a * static_cast<float>(s[i + half]));
      }
    }
}

void check_float_or_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be fp32 or bf16");
}

}  // namespace

// x [N, H] (rows may be strided), weight [H] of x's dtype. Returns a new contiguous [N, H].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_float_or_bf16(x, "rms_norm's input");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1));
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// x [N, heads, D] (tokens and heads may be strided), cos and sin [N, D] of x's dtype.
// Returns a new contiguous [N, heads, D].
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_float_or_bf16(x, "rope's input");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type() && cos.numel() == x.size(0) * x.size(2) &&
              sin.numel() == cos.numel());
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    rope_rows(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
              out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1));
  });
  return out;
}
