// Decode attention straight from the paged KV cache: one query token per sequence, keys and
// values read where they lie (a block at a time), so no gathered copy of the context is made.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, block_size;
  float scale;
};

// One sequence, every head: softmax(q . K * scale) . V over `context` tokens, block by block,
// with the running maximum rescaled once per block rather than once per token. The cache holds
// `T` (float or bfloat16); arithmetic is in float.
template <typename T>
void attend_sequence(const float* q, const T* k_cache, const T* v_cache,
                     const int64_t* table, int64_t context, const Shape& s, float* out) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  std::vector<float> best(s.heads, -std::numeric_limits<float>::infinity());
  std::vector<float> total(s.heads, 0.0f), scores(s.block_size * s.heads);
  std::fill(out, out + s.heads * s.dim, 0.0f);
  for (int64_t start = 0; start < context; start += s.block_size) {
    const int64_t count = std::min(s.block_size, context - start);
    const T* k_block = k_cache + table[start / s.block_size] * s.block_size * row;
    const T* v_block = v_cache + table[start / s.block_size] * s.block_size * row;
    for (int64_t t = 0; t < count; ++t)
      for (int64_t h = 0; h < s.heads; ++h) {
        const T* k = k_block + t * row + (h / group) * s.dim;
        const float* qh = q + h * s.dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < s.dim; ++d) dot += qh[d] * static_cast<float>(k[d]);
        scores[t * s.heads + h] = dot * s.scale;
      }
    for (int64_t h = 0; h < s.heads; ++h) {
      float block_max = best[h];
      for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, scores[t * s.heads + h]);
      const float shrink = std::exp(best[h] - block_max);
      float* acc = out + h * s.dim;
      total[h] *= shrink;
      for (int64_t d = 0; d < s.dim; ++d) acc[d] *= shrink;
      best[h] = block_max;
      for (int64_t t = 0; t < count; ++t) {
        const float weight = std::exp(scores[t * s.heads + h] - block_max);
        const T* v = v_block + t * row + (h / group) * s.dim;
        total[h] += weight;
        for (int64_t d = 0; d < s.dim; ++d) acc[d] += weight * static_cast<float>(v[d]);
      }
    }
  }
  for (int64_t h = 0; h < s.heads; ++h)
    for (int64_t d = 0; d < s.dim; ++d) out[h * s.dim + d] /= total[h];
}

}  // namespace

template <typename T>
torch::Tensor attend_batch(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& tables,
                           const torch::Tensor& contexts, int64_t block_size) {
  const Shape shape{q.size(1), k_cache.size(1), q.size(2), block_size,
                    1.0f / std::sqrt(static_cast<float>(q.size(2)))};
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = contexts.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t width = tables.size(1), per_seq = shape.heads * shape.dim;
  at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      attend_sequence(qp + b * per_seq, kp, vp, tp + b * width, cp[b], shape, op + b * per_seq);
  });
  return out;
}

// q [B, H, D] fp32; k_cache, v_cache [slots, Hkv, D] fp32 or bf16; tables [B, max_blocks];
// contexts [B]. Returns fp32 [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor contexts, int64_t block_size) {
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == torch::kFloat32, "paged_decode takes an fp32 query");
  TORCH_CHECK(v_cache.scalar_type() == kv_type &&
              (kv_type == torch::kFloat32 || kv_type == torch::kBFloat16),
              "paged_decode reads an fp32 or bf16 cache");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(tables.dtype() == torch::kInt64 && tables.is_contiguous());
  TORCH_CHECK(contexts.dtype() == torch::kInt64 && contexts.is_contiguous());
  if (kv_type == torch::kBFloat16)
    return attend_batch<at::BFloat16>(q, k_cache, v_cache, tables, contexts, block_size);
  return attend_batch<float>(q, k_cache, v_cache, tables, contexts, block_size);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
}
