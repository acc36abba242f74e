// Prefill attention straight from the paged KV cache: the new tokens of one prompt (a chunk,
// after any cached prefix) attend causally to its whole context. Two ways: for a bf16 cache on a
// CPU with AVX512-BF16, bf16 pairs multiplied in hardware (below); for fp32 (or bf16 elsewhere),
// the same walk in 16-float lanes (namespace lanes, further down).
//
// For bf16, each KV head's keys and values are first packed, once per call, into the layouts that let
// one instruction multiply 16 pairs of bf16 and add both products to 16 fp32 sums: keys
// transposed, 16 tokens to a vector (lane t holds two elements of token t), values with two
// tokens' elements interleaved. Then each group of query rows (every query head that shares the
// KV head, 16 positions) walks the packed context 16 keys at a time with a running softmax; a
// 16-key tile is read from L1 by all 48 rows before the next is touched.
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {

constexpr int64_t kKeys = kLanes;   // keys per tile: one score vector per query row
constexpr int64_t kPositions = 16;  // query positions per work item

// One call's prompt chunk: its heads, where it starts, how many new tokens, the score scale.
struct Shape {
  int64_t heads, kv_heads, dim, block_size, start, new_tokens;
  float scale;
  int64_t context() const { return start + new_tokens; }
  int64_t tiles() const { return (context() + kKeys - 1) / kKeys; }
  int64_t row_groups() const { return (new_tokens + kPositions - 1) / kPositions; }
};

// Work item `item` of kv_heads * row_groups: its KV head and first query position. A later
// position attends to more keys, so the row groups are taken from both ends in turn, and every
// contiguous range of items (at::parallel_for gives each thread one) costs about the same: in
// position order the second of two threads got three quarters of a fresh prompt's work.
struct Item {
  int64_t kv_head, first;
};

inline Item item_of(int64_t item, const Shape& s) {
  const int64_t k = item / s.kv_heads, groups = s.row_groups();
  const int64_t group = k % 2 == 0 ? k / 2 : groups - 1 - k / 2;
  return {item % s.kv_heads, group * kPositions};
}

}  // namespace

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kMaxChunks = 8;   // head dimensions up to 128 (16 values per accumulator)


// The context of KV head `g`, packed: keys[tile][pair][lane] is elements 2 pair, 2 pair + 1 of
// key 16 tile + lane; values[key pair][element] is that element of keys 2 pair and 2 pair + 1.
// Slots past the context stay zero.
struct Packed {
  std::vector<uint32_t> keys, values;
};

Packed pack(const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* table,
            const Shape& s, int64_t g) {
  const int64_t pairs = s.dim / 2, row = s.kv_heads * s.dim;
  Packed packed{std::vector<uint32_t>(s.tiles() * pairs * kKeys, 0),
                std::vector<uint32_t>(s.tiles() * kKeys / 2 * s.dim, 0)};
  std::vector<uint16_t> pair_values(2 * s.dim);
  for (int64_t token = 0; token < s.context(); ++token) {
    const int64_t slot = table[token / s.block_size] * s.block_size + token % s.block_size;
    const auto* key = reinterpret_cast<const uint32_t*>(k_cache + slot * row + g * s.dim);
    uint32_t* tile = packed.keys.data() + token / kKeys * pairs * kKeys + token % kKeys;
    for (int64_t p = 0; p < pairs; ++p) tile[p * kKeys] = key[p];
    const auto* value = reinterpret_cast<const uint16_t*>(v_cache + slot * row + g * s.dim);
    auto* interleaved = reinterpret_cast<uint16_t*>(packed.values.data() + token / 2 * s.dim);
    for (int64_t e = 0; e < s.dim; ++e) interleaved[2 * e + token % 2] = value[e];
  }
  return packed;
}

constexpr int kRows = 4;  // query rows folded together: independent sums keep the unit busy

// One query row's running softmax: largest score so far, per-lane sums of weights, and the
// weighted sum of values (`Chunks` vectors of 16 elements, in order).
template <int Chunks>
struct RowState {
  float best = -std::numeric_limits<float>::infinity();
  __m512 total = _mm512_setzero_ps();
  __m512 acc[Chunks] = {};
};

inline __m512 broadcast_pair(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(*p)));
}

inline __m512 dot_pairs(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Turns one row's scores of a tile (keys from `visible` on masked) into weights e^(s - best),
// rescaling its state to the new best; returns the weights as bf16 pairs.
template <int Chunks>
void weigh(RowState<Chunks>& state, __m512 scores, int64_t visible, uint32_t (&pairs)[kKeys / 2]) {
  if (visible < kKeys)
    scores = _mm512_mask_blend_ps(static_cast<__mmask16>((1u << visible) - 1),
                                  splat(-std::numeric_limits<float>::infinity()), scores);
  const float best = std::max(state.best, _mm512_reduce_max_ps(scores));
  if (best > state.best) {
    const __m512 shrink = splat(std::exp(state.best - best));
    state.total = mul(state.total, shrink);
    for (int c = 0; c < Chunks; ++c) state.acc[c] = mul(state.acc[c], shrink);
    state.best = best;
  }
  const __m512 weights = exp_lanes(add(scores, splat(-best)));
  state.total = add(state.total, weights);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(weights)));
}

// Folds a tile of 16 keys into kRows rows' states. `visible[r]`: how many of the tile's keys
// row r sees (none: the row is left as it was).
template <int Chunks>
void fold_tile(RowState<Chunks>* (&states)[kRows], const uint32_t* (&queries)[kRows],
               const int64_t (&visible)[kRows], const uint32_t* keys, const uint32_t* values,
               float scale) {
  constexpr int64_t pairs = Chunks * kLanes / 2;
  __m512 even[kRows], odd[kRows];
  for (int r = 0; r < kRows; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512 k0 = _mm512_loadu_ps(keys + p * kKeys), k1 = _mm512_loadu_ps(keys + (p + 1) * kKeys);
    for (int r = 0; r < kRows; ++r) {
      even[r] = dot_pairs(even[r], k0, broadcast_pair(queries[r] + p));
      odd[r] = dot_pairs(odd[r], k1, broadcast_pair(queries[r] + p + 1));
    }
  }
  uint32_t weights[kRows][kKeys / 2] = {};
  for (int r = 0; r < kRows; ++r)
    if (visible[r] > 0)
      weigh(*states[r], mul(add(even[r], odd[r]), splat(scale)), visible[r], weights[r]);
  __m512 acc[kRows][Chunks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < Chunks; ++c) acc[r][c] = states[r]->acc[c];
  for (int64_t j = 0; j < kKeys / 2; ++j)
    for (int c = 0; c < Chunks; ++c) {
      const __m512 v = _mm512_loadu_ps(values + (j * Chunks + c) * kLanes);
      for (int r = 0; r < kRows; ++r)
        acc[r][c] = dot_pairs(acc[r][c], v, broadcast_pair(&weights[r][j]));
    }
  for (int r = 0; r < kRows; ++r)
    if (visible[r] > 0)
      for (int c = 0; c < Chunks; ++c) states[r]->acc[c] = acc[r][c];
}

// Positions first..first+15 (those that exist) of every query head sharing KV head g, as rows
// position by position, kRows at a time.
template <int Chunks>
void attend_rows(const at::BFloat16* q, const Packed& packed, const Shape& s, int64_t g,
                 int64_t first, at::BFloat16* out) {
  const int64_t group = s.heads / s.kv_heads, pairs = s.dim / 2;
  const int64_t positions = std::min(kPositions, s.new_tokens - first);
  const int64_t rows = positions * group;
  std::vector<RowState<Chunks>> states(rows);
  const auto query = [&](int64_t row) {
    return reinterpret_cast<const uint32_t*>(
        q + ((first + row / group) * s.heads + g * group + row % group) * s.dim);
  };
  const int64_t last_key = s.start + first + positions - 1;
  for (int64_t tile = 0; tile * kKeys <= last_key; ++tile) {
    const uint32_t* keys = packed.keys.data() + tile * pairs * kKeys;
    const uint32_t* values = packed.values.data() + tile * kKeys / 2 * s.dim;
    for (int64_t row = 0; row < rows; row += kRows) {
      RowState<Chunks>* block_states[kRows];
      const uint32_t* queries[kRows];
      int64_t visible[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t index = std::min(row + r, rows - 1);  // past the last: a copy, unused
        block_states[r] = &states[index];
        queries[r] = query(index);
        const int64_t position = s.start + first + index / group;
        visible[r] = row + r < rows ? std::min(kKeys, position + 1 - tile * kKeys) : 0;
      }
      fold_tile(block_states, queries, visible, keys, values, s.scale);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const RowState<Chunks>& state = states[row];
    const __m512 inverse = splat(1.0f / _mm512_reduce_add_ps(state.total));
    at::BFloat16* o = out + ((first + row / group) * s.heads + g * group + row % group) * s.dim;
    for (int c = 0; c < Chunks; ++c) store_as(o + c * kLanes, mul(state.acc[c], inverse));
  }
}


// The bf16 walk (a head dimension of 32, 64, 96 or 128).
at::Tensor bf16_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& table,
                        const Shape& s) {
  auto out = at::empty_like(q);
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  std::vector<Packed> packed(s.kv_heads);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      packed[g] = pack(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                       table.data_ptr<int64_t>(), s, g);
  });
  at::parallel_for(0, s.kv_heads * s.row_groups(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [g, first] = item_of(index, s);
      switch (s.dim / kLanes) {
        case 2: attend_rows<2>(qp, packed[g], s, g, first, op); break;
        case 4: attend_rows<4>(qp, packed[g], s, g, first, op); break;
        case 6: attend_rows<6>(qp, packed[g], s, g, first, op); break;
        default: attend_rows<8>(qp, packed[g], s, g, first, op); break;
      }
    }
  });
  return out;
}


}  // namespace
#endif

namespace {

namespace lanes {

constexpr int64_t kMaxChunks = 16;  // head dimensions up to 256


// The context of KV head `g` in fp32: keys[tile][element][lane] is that element of key
// 16 tile + lane (so a query element times 16 keys is one vector operation); values[key] are
// the keys' values in order. Slots past the context stay zero.
struct Packed {
  std::vector<float> keys, values;
};

template <typename T>
Packed pack(const T* k_cache, const T* v_cache, const int64_t* table, const Shape& s,
            int64_t g) {
  const int64_t row = s.kv_heads * s.dim;
  Packed packed{std::vector<float>(s.tiles() * s.dim * kKeys, 0.0f),
                std::vector<float>(s.tiles() * kKeys * s.dim, 0.0f)};
  for (int64_t token = 0; token < s.context(); ++token) {
    const int64_t slot = table[token / s.block_size] * s.block_size + token % s.block_size;
    const T* key = k_cache + slot * row + g * s.dim;
    const T* value = v_cache + slot * row + g * s.dim;
    float* tile = packed.keys.data() + token / kKeys * s.dim * kKeys + token % kKeys;
    float* values = packed.values.data() + token * s.dim;
    for (int64_t e = 0; e < s.dim; ++e) {
      tile[e * kKeys] = static_cast<float>(key[e]);
      values[e] = static_cast<float>(value[e]);
    }
  }
  return packed;
}

// One query row: its elements (scaled), running maximum, sum of weights and weighted values.
struct Row {
  std::vector<float> q;
  float best = -std::numeric_limits<float>::infinity(), total = 0.0f;
  std::vector<Lanes> acc;
};

// Query rows folded together: each key and value vector is loaded once for all of them, and
// their independent sums keep both FMA units busy. One row at a time waited on one chain of
// sums: 224 ms for a 512-token prompt's attention at AVX2 on two cores, against 105 ms now
// (4 rows: 108 ms) and 135 ms for torch's SDPA.
constexpr int kRows = 6;

// Turns one row's scores of a tile into weights e^(s - best) over its first `visible` keys
// (zero after), rescaling the row to the new best.
void weigh(Row& row, Lanes scores, int64_t visible, float (&weights)[kKeys]) {
  float s[kKeys];
  store(s, scores);
  const float best = std::max(row.best, max_of(s, visible));
  if (best > row.best) {
    const float shrink = std::exp(row.best - best);
    for (Lanes& acc : row.acc) acc = mul(acc, splat(shrink));
    row.total *= shrink;
    row.best = best;
  }
  const Lanes w = first_lanes(exp_lanes(add(scores, splat(-best))), visible);
  row.total += sum(w);
  store(weights, w);
}

// Folds a tile of 16 keys into kRows rows. `visible[r]`: how many of the tile's keys row r
// sees (none: the row is left as it was).
void fold_tile(Row* (&rows)[kRows], const int64_t (&visible)[kRows], const float* keys,
               const float* values, int64_t dim) {
  Lanes scores[kRows];
  for (int r = 0; r < kRows; ++r) scores[r] = splat(0.0f);
  for (int64_t e = 0; e < dim; ++e) {
    const Lanes k = load_lanes(keys + e * kKeys);
    for (int r = 0; r < kRows; ++r) scores[r] = fma(splat(rows[r]->q[e]), k, scores[r]);
  }
  float weights[kRows][kKeys] = {};
  int64_t seen = 0;  // keys any row sees
  for (int r = 0; r < kRows; ++r)
    if (visible[r] > 0) {
      weigh(*rows[r], scores[r], visible[r], weights[r]);
      seen = std::max(seen, visible[r]);
    }
  for (int64_t c = 0; c < dim / kLanes; ++c) {
    Lanes acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = rows[r]->acc[c];
    for (int64_t j = 0; j < seen; ++j) {
      const Lanes v = load_lanes(values + j * dim + c * kLanes);
      for (int r = 0; r < kRows; ++r) acc[r] = fma(splat(weights[r][j]), v, acc[r]);
    }
    for (int r = 0; r < kRows; ++r)
      if (visible[r] > 0) rows[r]->acc[c] = acc[r];
  }
}

// Positions first..first+15 (those that exist) of every query head sharing KV head g, as rows
// position by position; each 16-key tile is read by all of them before the next is touched.
template <typename T>
void attend_rows(const T* q, const Packed& packed, const Shape& s, int64_t g, int64_t first,
                 T* out) {
  const int64_t group = s.heads / s.kv_heads, chunks = s.dim / kLanes;
  const int64_t positions = std::min(kPositions, s.new_tokens - first), count = positions * group;
  const auto offset = [&](int64_t index) {
    return ((first + index / group) * s.heads + g * group + index % group) * s.dim;
  };
  std::vector<Row> rows(count, Row{std::vector<float>(s.dim), -std::numeric_limits<float>::infinity(),
                                   0.0f, std::vector<Lanes>(chunks, splat(0.0f))});
  for (int64_t index = 0; index < count; ++index)
    for (int64_t e = 0; e < s.dim; ++e)
      rows[index].q[e] = static_cast<float>(q[offset(index) + e]) * s.scale;
  const int64_t last_key = s.start + first + positions - 1;
  for (int64_t tile = 0; tile * kKeys <= last_key; ++tile)
    for (int64_t index = 0; index < count; index += kRows) {
      Row* block[kRows];
      int64_t visible[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t at = std::min(index + r, count - 1);  // past the last: a copy, unused
        block[r] = &rows[at];
        const int64_t position = s.start + first + at / group;
        visible[r] = index + r < count ? std::min(kKeys, position + 1 - tile * kKeys) : 0;
      }
      fold_tile(block, visible, packed.keys.data() + tile * s.dim * kKeys,
                packed.values.data() + tile * kKeys * s.dim, s.dim);
    }
  for (int64_t index = 0; index < count; ++index)
    for (int64_t c = 0; c < chunks; ++c)
      store_as(out + offset(index) + c * kLanes,
               mul(rows[index].acc[c], splat(1.0f / rows[index].total)));
}

template <typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& table, const Shape& s) {
  auto out = at::empty_like(q);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  std::vector<Packed> packed(s.kv_heads);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      packed[g] = lanes::pack(k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                              table.data_ptr<int64_t>(), s, g);
  });
  at::parallel_for(0, s.kv_heads * s.row_groups(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const auto [g, first] = item_of(index, s);
      lanes::attend_rows(qp, packed[g], s, g, first, op);
    }
  });
  return out;
}

}  // namespace lanes
}  // namespace

// q [T, H, D]: the prompt's new tokens at positions start..start+T-1, whose K and V are in the
// cache already; k_cache, v_cache [slots, Hkv, D]; all fp32 or all bf16. table [blocks] covering
// the context. D a multiple of 16, at most 256. Returns [T, H, D] in q's dtype.
at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor table, int64_t start, int64_t block_size) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
              k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_prefill takes fp32 or bf16 queries and cache, both alike");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= lanes::kMaxChunks * kLanes,
              "paged_prefill needs a head dimension that is a multiple of 16, at most 256");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(table.dtype() == at::kLong && table.is_contiguous());
  const Shape s{q.size(1), k_cache.size(1), q.size(2), block_size, start, q.size(0),
                1.0f / std::sqrt(static_cast<float>(q.size(2)))};
  TORCH_CHECK(table.numel() * block_size >= s.context(), "the table does not cover the context");
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16 && q.size(2) % 32 == 0 && q.size(2) <= kMaxChunks * kLanes)
    return bf16_prefill(q, k_cache, v_cache, table, s);
#endif
  if (dtype == at::kBFloat16)
    return lanes::attend<at::BFloat16>(q, k_cache, v_cache, table, s);
  return lanes::attend<float>(q, k_cache, v_cache, table, s);
}
