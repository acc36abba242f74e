// Decode attention straight from the paged KV cache: one query token per sequence, keys and
// values read where they lie (a block at a time), so no gathered copy of the context is made.
#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "lanes.h"

namespace {

constexpr int kMaxChunks = 16;  // head dimensions up to 256

struct Shape {  // the head dimension is a multiple of kLanes
  int64_t heads, kv_heads, dim, block_size;
  float scale;
};

// Running softmax of the query heads that share one KV head: per head, the largest score so
// far, the sum of weights and the weighted sum of values (`chunks` vectors of kLanes).
struct GroupState {
  std::vector<float> best, total;
  std::vector<Lanes> acc;
  GroupState(int64_t group, int64_t chunks)
      : best(group, -std::numeric_limits<float>::infinity()), total(group, 0.0f),
        acc(group * chunks, splat(0.0f)) {}
};

// Blocks lie scattered in the cache, so the hardware prefetcher cannot guess the next one: a
// token's row of the next block is fetched as the same token's row of this block is read,
// which spreads the requests over the block's work (all of a block's at once stalled the core
// until the memory had taken them).
template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t i = 0; i < elements; i += line) __builtin_prefetch(row + i);
}

// Each group head's scores against `count` cached keys (rows `row` apart), into
// scores[head * stride + token], sixteen tokens at a time: their dot products' partial sums
// are added up together (a sum per token cost as much as its products).
template <int Chunks, typename T>
void score_block(const Lanes* q, int64_t group, const T* keys, const T* next_keys,
                 int64_t count, int64_t row, float* scores, int64_t stride) {
  for (int64_t first = 0; first < count; first += kLanes) {
    const int64_t n = std::min(kLanes, count - first);
    for (int64_t h = 0; h < group; ++h) {
      Lanes dots[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) {
        const T* k = keys + (first + t) * row;
        if (h == 0 && t < n) prefetch_row(next_keys + (first + t) * row, Chunks * kLanes);
        Lanes dot = splat(0.0f);
        for (int c = 0; t < n && c < Chunks; ++c)
          dot = fma(q[h * Chunks + c], load_lanes(k + c * kLanes), dot);
        dots[t] = dot;
      }
      store(scores + h * stride + first, sum_each(dots));
    }
  }
}

// Rescales the running state to one block's new maximum and turns the block's scores into
// weights e^(s - max), in place. Scores past `count` are padding, never used.
inline void weigh_block(GroupState& state, float* scores, int64_t count, int64_t stride) {
  const int64_t group = static_cast<int64_t>(state.best.size());
  const int64_t chunks = static_cast<int64_t>(state.acc.size()) / group;
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * stride;
    const float block_max = std::max(state.best[h], max_of(s, count));
    if (block_max > state.best[h]) {
      const float shrink = std::exp(state.best[h] - block_max);
      for (int64_t c = 0; c < chunks; ++c)
        state.acc[h * chunks + c] = mul(state.acc[h * chunks + c], splat(shrink));
      state.total[h] *= shrink;
      state.best[h] = block_max;
    }
    Lanes total = splat(0.0f);
    for (int64_t t = 0; t < stride; t += kLanes) {
      const Lanes weights = exp_lanes(add(load_lanes(s + t), splat(-block_max)));
      store(s + t, weights);
      total = add(total, first_lanes(weights, count - t));
    }
    state.total[h] += sum(total);
  }
}

// Folds one block into the running state: weigh its scores, then add each head's weighted
// values, its sums held in registers over the block's tokens.
template <int Chunks, typename T>
void fold_block(GroupState& state, float* scores, const T* values, const T* next_values,
                int64_t count, int64_t row, int64_t stride) {
  const int64_t group = static_cast<int64_t>(state.best.size());
  weigh_block(state, scores, count, stride);
  for (int64_t h = 0; h < group; ++h) {
    Lanes acc[Chunks];
    for (int c = 0; c < Chunks; ++c) acc[c] = state.acc[h * Chunks + c];
    for (int64_t t = 0; t < count; ++t) {
      const T* v = values + t * row;
      if (h == 0) prefetch_row(next_values + t * row, Chunks * kLanes);
      const Lanes weight = splat(scores[h * stride + t]);
      for (int c = 0; c < Chunks; ++c) acc[c] = fma(weight, load_lanes(v + c * kLanes), acc[c]);
    }
    for (int c = 0; c < Chunks; ++c) state.acc[h * Chunks + c] = acc[c];
  }
}

// One sequence's KV heads [first, last): softmax(q . K * scale) . V over `context` tokens.
// Blocks are read in turn, each once (those heads' rows), so the memory is streamed; the
// running maximum of each query head is rescaled once a block.
template <int Chunks, typename T>
void attend_heads(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t context, const Shape& s, int64_t first, int64_t last, T* out) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  const int64_t stride = (s.block_size + kLanes - 1) / kLanes * kLanes;
  std::vector<float> scores(group * stride, 0.0f);
  std::vector<Lanes> group_q(s.kv_heads * group * Chunks);
  std::vector<GroupState> states(s.kv_heads, GroupState(group, Chunks));
  for (int64_t i = first * group * Chunks; i < last * group * Chunks; ++i)
    group_q[i] = mul(load_lanes(q + i * kLanes), splat(s.scale));
  const int64_t blocks = (context + s.block_size - 1) / s.block_size;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t count = std::min(s.block_size, context - block * s.block_size);
    const int64_t next = table[std::min(block + 1, blocks - 1)] * s.block_size * row;
    for (int64_t g = first; g < last; ++g) {
      const int64_t offset = table[block] * s.block_size * row + g * s.dim;
      score_block<Chunks>(&group_q[g * group * Chunks], group, k_cache + offset,
                          k_cache + next + g * s.dim, count, row, scores.data(), stride);
      fold_block<Chunks>(states[g], scores.data(), v_cache + offset, v_cache + next + g * s.dim,
                         count, row, stride);
    }
  }
  for (int64_t g = first; g < last; ++g)
    for (int64_t i = 0; i < group * Chunks; ++i)
      store_as(out + (g * group * Chunks + i) * kLanes,
               mul(states[g].acc[i], splat(1.0f / states[g].total[i / Chunks])));
}

// attend_heads for a head dimension of 16 * chunks, chunks from 1 to Chunks.
template <int Chunks, typename T>
void attend_heads_of(int64_t chunks, const T* q, const T* k_cache, const T* v_cache,
                     const int64_t* table, int64_t context, const Shape& s, int64_t first,
                     int64_t last, T* out) {
  if constexpr (Chunks > 1) {
    if (chunks < Chunks)
      return attend_heads_of<Chunks - 1>(chunks, q, k_cache, v_cache, table, context, s, first,
                                         last, out);
  }
  attend_heads<Chunks>(q, k_cache, v_cache, table, context, s, first, last, out);
}

#if defined(__AVX512BF16__)
// A bf16 cache on a CPU with AVX512-BF16: one instruction multiplies 16 pairs of bf16 and adds
// both products to 16 fp32 sums, where the generic path widens each bf16 to fp32 first.
namespace bf16 {

constexpr int64_t kPerVector = 32;  // bf16 in one 512-bit vector; the head dimension's multiple
constexpr int64_t kMaxVectors = 4;  // head dimensions up to 128

inline __m512bh load_pairs(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Each group head's scaled scores against `count` keys, 16 tokens at a time; the lanes of a
// last, partial group of 16 score 0 and are never read as weights.
void score_block(const std::vector<__m512bh>& q, int64_t vectors, const at::BFloat16* keys,
                 const at::BFloat16* next_keys, int64_t count, int64_t row, float scale,
                 float* scores, int64_t stride) {
  const int64_t group = static_cast<int64_t>(q.size()) / vectors;
  for (int64_t first = 0; first < count; first += kLanes) {
    const int64_t n = std::min(kLanes, count - first);
    for (int64_t h = 0; h < group; ++h) {
      __m512 dots[16];
      for (int64_t t = 0; t < kLanes; ++t) {
        dots[t] = _mm512_setzero_ps();
        for (int64_t c = 0; h == 0 && t < n && c < vectors; ++c)
          __builtin_prefetch(next_keys + (first + t) * row + c * kPerVector);
        for (int64_t c = 0; t < n && c < vectors; ++c)
          dots[t] = _mm512_dpbf16_ps(dots[t], q[h * vectors + c],
                                     load_pairs(keys + (first + t) * row + c * kPerVector));
      }
      store(scores + h * stride + first, mul(sum_each(dots), splat(scale)));
    }
  }
}

// Folds one block into the running state, as the generic fold_block does, but adds the values
// two tokens at a time: their elements interleaved, against both tokens' weights in bf16.
// Accumulator 2c holds elements 32c + 8l + {0..3} of 128-bit lane l, accumulator 2c + 1 the
// four after them (the order _mm512_unpack*_epi16 leaves); `finish` puts them back in order.
void fold_block(GroupState& state, float* scores, uint16_t* weights,
                const at::BFloat16* values, const at::BFloat16* next_values, int64_t count,
                int64_t row, int64_t vectors, int64_t stride) {
  const int64_t group = static_cast<int64_t>(state.best.size()), chunks = 2 * vectors;
  weigh_block(state, scores, count, stride);
  for (int64_t i = 0; i < group * stride; i += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(load_lanes(scores + i))));
  for (int64_t t = 0; t < count; t += 2) {
    const bool pair = t + 1 < count;  // an odd last token pairs with zeros, weight 0
    __m512i lo[kMaxVectors], hi[kMaxVectors];
    for (int64_t c = 0; c < vectors; ++c) {
      __builtin_prefetch(next_values + t * row + c * kPerVector);
      if (pair) __builtin_prefetch(next_values + (t + 1) * row + c * kPerVector);
      const __m512i a = _mm512_loadu_si512(values + t * row + c * kPerVector);
      const __m512i b = pair ? _mm512_loadu_si512(values + (t + 1) * row + c * kPerVector)
                             : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t h = 0; h < group; ++h) {
      uint32_t both;
      std::memcpy(&both, weights + h * stride + t, sizeof both);
      const __m512bh w = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(pair ? both : both & 0xFFFFu)));
      for (int64_t c = 0; c < vectors; ++c) {
        Lanes& even = state.acc[h * chunks + 2 * c];
        Lanes& odd = state.acc[h * chunks + 2 * c + 1];
        even = _mm512_dpbf16_ps(even, reinterpret_cast<__m512bh>(lo[c]), w);
        odd = _mm512_dpbf16_ps(odd, reinterpret_cast<__m512bh>(hi[c]), w);
      }
    }
  }
}

// Writes one group's outputs, each head's sums over its total, back in element order.
void finish(const GroupState& state, int64_t dim, at::BFloat16* out) {
  const int64_t group = static_cast<int64_t>(state.best.size()), chunks = dim / kLanes;
  float lanes[kLanes];
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunks; ++c) {
      store(lanes, mul(state.acc[h * chunks + c], splat(1.0f / state.total[h])));
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t element = c / 2 * kPerVector + i / 4 * 8 + c % 2 * 4 + i % 4;
        out[h * dim + element] = static_cast<at::BFloat16>(lanes[i]);
      }
    }
}

// attend_sequence for a bf16 cache whose head dimension is a multiple of 32, at most 128.
void attend_sequence(const at::BFloat16* q, const at::BFloat16* k_cache,
                     const at::BFloat16* v_cache, const int64_t* table, int64_t context,
                     const Shape& s, at::BFloat16* out) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  const int64_t vectors = s.dim / kPerVector;
  const int64_t stride = (s.block_size + kLanes - 1) / kLanes * kLanes;
  std::vector<float> scores(group * stride, 0.0f);
  std::vector<uint16_t> weights(group * stride, 0);
  std::vector<std::vector<__m512bh>> group_q(s.kv_heads, std::vector<__m512bh>(group * vectors));
  std::vector<GroupState> states(s.kv_heads, GroupState(group, 2 * vectors));
  for (int64_t g = 0; g < s.kv_heads; ++g)
    for (int64_t i = 0; i < group * vectors; ++i)
      group_q[g][i] = load_pairs(q + g * group * s.dim + i * kPerVector);
  // Each token's slice of the next block is prefetched as this block's is read, so the
  // prefetches spread out instead of queueing at once.
  const int64_t blocks = (context + s.block_size - 1) / s.block_size;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t count = std::min(s.block_size, context - block * s.block_size);
    const int64_t next = table[std::min(block + 1, blocks - 1)] * s.block_size * row;
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t offset = table[block] * s.block_size * row + g * s.dim;
      score_block(group_q[g], vectors, k_cache + offset, k_cache + next + g * s.dim, count,
                  row, s.scale, scores.data(), stride);
      fold_block(states[g], scores.data(), weights.data(), v_cache + offset,
                 v_cache + next + g * s.dim, count, row, vectors, stride);
    }
  }
  for (int64_t g = 0; g < s.kv_heads; ++g) finish(states[g], s.dim, out + g * group * s.dim);
}

}  // namespace bf16
#endif

}  // namespace

template <typename T>
at::Tensor attend_batch(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& tables,
                        const at::Tensor& contexts, int64_t block_size) {
  const Shape shape{q.size(1), k_cache.size(1), q.size(2), block_size,
                    1.0f / std::sqrt(static_cast<float>(q.size(2)))};
  auto out = at::empty_like(q);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = contexts.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t width = tables.size(1), per_seq = shape.heads * shape.dim;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (shape.dim % bf16::kPerVector == 0 && shape.dim <= bf16::kMaxVectors * bf16::kPerVector) {
      at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b)
          bf16::attend_sequence(qp + b * per_seq, kp, vp, tp + b * width, cp[b], shape,
                                op + b * per_seq);
      });
      return out;
    }
  }
#endif
  // One task per sequence, or per KV head where there are fewer sequences than threads (a
  // lone sequence on one of two cores took 2.2 ms a step of 15).
  const int64_t split = q.size(0) < at::get_num_threads() ? shape.kv_heads : 1;
  at::parallel_for(0, q.size(0) * split, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, first = task % split * shape.kv_heads / split;
      const int64_t last = (task % split + 1) * shape.kv_heads / split;
      attend_heads_of<kMaxChunks, T>(shape.dim / kLanes, qp + b * per_seq, kp, vp,
                                     tp + b * width, cp[b], shape, first, last,
                                     op + b * per_seq);
    }
  });
  return out;
}

// q [B, H, D]; k_cache, v_cache [slots, Hkv, D], all three fp32 or all bf16, D a multiple of
// 16; tables [B, max_blocks]; contexts [B]. Returns [B, H, D] in q's dtype (computed in fp32).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor tables, at::Tensor contexts, int64_t block_size) {
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == kv_type && v_cache.scalar_type() == kv_type &&
              (kv_type == at::kFloat || kv_type == at::kBFloat16),
              "paged_decode takes fp32 or bf16 queries and cache, both alike");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kMaxChunks * kLanes,
              "paged_decode needs a head dimension divisible by 16, at most 256");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(tables.dtype() == at::kLong && tables.is_contiguous());
  TORCH_CHECK(contexts.dtype() == at::kLong && contexts.is_contiguous());
  if (kv_type == at::kBFloat16)
    return attend_batch<at::BFloat16>(q, k_cache, v_cache, tables, contexts, block_size);
  return attend_batch<float>(q, k_cache, v_cache, tables, contexts, block_size);
}
