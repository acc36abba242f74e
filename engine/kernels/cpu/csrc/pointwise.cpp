// Row-wise operations of a decode step that torch runs as several small kernels each: one
// pass each here, computed in fp32 and rounded once to the input's dtype.
#include "tensor.h"

#include <cmath>

namespace {

// Rows (tokens) per task: a prompt chunk's hundreds split over the threads, a decode step's
// few stay on one (starting a task costs more than they do).
constexpr int64_t kRowsPerTask = 16;

template <typename T>
void rms_norm_row(const T* in, const T* weight, T* out, int64_t width, float eps) {
  float squares = 0.0f;
  for (int64_t i = 0; i < width; ++i) {
    const float value = static_cast<float>(in[i]);
    squares += value * value;
  }
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; ++i)
    out[i] = static_cast<T>(static_cast<float>(in[i]) * scale * static_cast<float>(weight[i]));
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width,
                   int64_t row_stride, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(x + r * row_stride, weight, out + r * width, width, eps);
  });
}

// out = in * cos + rotate_half(in) * sin for one head, rotate_half(v) = (-v2, v1).
template <typename T>
void rope_head(const T* in, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(in[i]), b = static_cast<float>(in[i + half]);
    out[i] = static_cast<T>(a * static_cast<float>(cos[i]) - b * static_cast<float>(sin[i]));
    out[i + half] = static_cast<T>(b * static_cast<float>(cos[i + half]) +
                                   a * static_cast<float>(sin[i + half]));
  }
}

// Every head of every token, by the token's cos and sin.
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
               int64_t dim, int64_t token_stride, int64_t head_stride) {
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rope_head(x + t * token_stride + h * head_stride, cos + t * dim, sin + t * dim,
                  out + (t * heads + h) * dim, dim);
  });
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
