// Products with weight matrices kept as the quantized blocks a GGUF file ships: each row of a
// weight is cut into blocks of 32 values, each block stored as a few bits per value plus fp16
// constants. A block is widened to fp32 in registers and multiplied there, so a matrix-vector
// product reads a quarter (4-bit) or half (8-bit) of the bf16 bytes, and the values multiplied
// are exactly those of the dequantized weight (d * q + m is exact in fp32 for fp16 d, m).
#include "tensor.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lanes.h"
#include "quant_format.h"

namespace {

constexpr int kOutputs = 4;     // weight rows multiplied together: four independent sums each
constexpr int kRows = 4;        // input rows multiplied together: each block widened once
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kSums = 4;        // running sums a tile keeps in registers (two AVX2 ones each)
constexpr int kWideRows = 4;    // input rows multiplied together at most
#else
constexpr int kSums = 16;
constexpr int kWideRows = 8;
#endif
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead in a weight row to prefetch

struct Q4_1 {  // quant_format.h
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static void widen(const uint8_t* block, Lanes& low, Lanes& high) {
    const float d = half_to_float(block), m = half_to_float(block + 2);
    const uint8_t* q = block + 4;
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i nibble = _mm512_set1_epi32(0xF);
    low = fma(_mm512_cvtepi32_ps(_mm512_and_si512(v, nibble)), splat(d), splat(m));
    high = fma(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), splat(d), splat(m));
#elif defined(__AVX2__)
    // The 16 bytes in both halves; one byte shuffle puts bytes 0-7 (and one bytes 8-15) in the
    // low byte of each 32-bit lane, so each value is a mask or a shift away (a zero-extension
    // per eight values took 6 shuffles a block and bound the loop: 1.15-1.2x slower, measured
    // at 1-16 rows on a Zen 2 EPYC).
    const __m256i raw = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const auto pick = [](char a) {  // bytes a..a+3 | a+4..a+7 to 32-bit lanes (-1: zero)
      return _mm256_setr_epi8(a, -1, -1, -1, a + 1, -1, -1, -1, a + 2, -1, -1, -1, a + 3, -1,
                              -1, -1, a + 4, -1, -1, -1, a + 5, -1, -1, -1, a + 6, -1, -1, -1,
                              a + 7, -1, -1, -1);
    };
    const __m256i first = _mm256_shuffle_epi8(raw, pick(0));
    const __m256i second = _mm256_shuffle_epi8(raw, pick(8));
    const __m256i nibble = _mm256_set1_epi32(0xF);
    const __m256 scale = _mm256_set1_ps(d), offset = _mm256_set1_ps(m);
    const auto value = [&](__m256i q32) {  // d * q + m
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), scale, offset);
    };
    low = {value(_mm256_and_si256(first, nibble)), value(_mm256_and_si256(second, nibble))};
    high = {value(_mm256_srli_epi32(first, 4)), value(_mm256_srli_epi32(second, 4))};
#else
    for (int64_t i = 0; i < kLanes; ++i) {
      low.v[i] = d * static_cast<float>(q[i] & 0xF) + m;
      high.v[i] = d * static_cast<float>(q[i] >> 4) + m;
    }
#endif
  }
};

struct Q8_0 {  // quant_format.h
  static constexpr int64_t kBytes = kQ8_0Bytes;
  static void widen(const uint8_t* block, Lanes& low, Lanes& high) {
    const float d = half_to_float(block);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#if defined(__AVX512F__)
    const auto load = [](const int8_t* p) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    low = mul(load(q), splat(d));
    high = mul(load(q + kLanes), splat(d));
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(d);
    const auto eight = [&](const int8_t* p) {  // d * q of eight values, widened as loaded
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))), scale);
    };
    low = {eight(q), eight(q + 8)};
    high = {eight(q + 16), eight(q + 24)};
#else
    for (int64_t i = 0; i < kLanes; ++i) {
      low.v[i] = d * static_cast<float>(q[i]);
      high.v[i] = d * static_cast<float>(q[i + kLanes]);
    }
#endif
  }
};

// How a tile multiplies a widened block by rows of x. Fp32: the block's two halves against x
// in fp32, two fused multiply-adds per row (the exact weights); bf16 x is widened to fp32 as
// it is loaded, which is exact.
template <typename InputT>
struct Fp32Math {
  using X = InputT;
  struct Weights {
    Lanes low, high;
  };
  static Weights weights(Lanes low, Lanes high) { return {low, high}; }
  static Lanes multiply_add(Lanes acc, const Weights& w, const X* x) {
    return fma(w.high, load_lanes(x + kLanes), fma(w.low, load_lanes(x), acc));
  }
};

#if defined(__AVX512BF16__)
// Bf16 x on a CPU with AVX512-BF16: the block rounded to bf16 once (as the dense bf16 weights
// are), then one instruction per row for all 32 products.
struct Bf16DotMath {
  using X = at::BFloat16;
  using Weights = __m512bh;
  static Weights weights(Lanes low, Lanes high) { return _mm512_cvtne2ps_pbh(high, low); }
  static Lanes multiply_add(Lanes acc, Weights w, const at::BFloat16* x) {
    return _mm512_dpbf16_ps(acc, w, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)));
  }
};
#endif

// out[r, n + o] = x[r] . weight[n + o] for O weight rows and R input rows, over every block.
template <typename Format, typename Math, int O, int R, typename T>
void tile(const typename Math::X* x, int64_t width, const uint8_t* weight, int64_t row_bytes,
          int64_t n, T* out, int64_t out_stride) {
  Lanes acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = splat(0.0f);
  for (int64_t b = 0; b < width / kBlock; ++b) {
    for (int o = 0; o < O; ++o) {
      const uint8_t* block = weight + (n + o) * row_bytes + b * Format::kBytes;
      __builtin_prefetch(block + kPrefetchBytes);
      Lanes low, high;
      Format::widen(block, low, high);
      const auto w = Math::weights(low, high);
      for (int r = 0; r < R; ++r)
        acc[o][r] = Math::multiply_add(acc[o][r], w, x + r * width + b * kBlock);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[r * out_stride + n + o] = static_cast<T>(sum(acc[o][r]));
}

// One tile of R rows against weight rows n..n+3, split so that every sum stays in a register.
template <typename Format, typename Math, int R, typename T>
void tile_of_four(const typename Math::X* x, int64_t width, const uint8_t* weight,
                  int64_t row_bytes, int64_t n, T* out, int64_t out_stride) {
  constexpr int O = kOutputs * R <= kSums ? kOutputs : 2 * R <= kSums ? 2 : 1;
  for (int64_t first = n; first < n + kOutputs; first += O)
    tile<Format, Math, O, R>(x, width, weight, row_bytes, first, out, out_stride);
}

// The last `rows` (< R) rows as one tile.
template <typename Format, typename Math, int R, typename T>
void last_tile(int64_t rows, const typename Math::X* x, int64_t width, const uint8_t* weight,
               int64_t row_bytes, int64_t n, T* out, int64_t out_stride) {
  if constexpr (R > 1) {
    if (rows == R - 1)
      tile_of_four<Format, Math, R - 1>(x, width, weight, row_bytes, n, out, out_stride);
    else
      last_tile<Format, Math, R - 1>(rows, x, width, weight, row_bytes, n, out, out_stride);
  }
}

template <typename Format, typename Math, typename T>
void product(const typename Math::X* x, int64_t rows, int64_t width, const uint8_t* weight,
             int64_t outputs, T* out) {
  const int64_t row_bytes = width / kBlock * Format::kBytes;
  const int64_t groups = outputs / kOutputs;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kOutputs; n < end * kOutputs; n += kOutputs) {
      int64_t r = 0;
      for (; r + kWideRows <= rows; r += kWideRows)
        tile_of_four<Format, Math, kWideRows>(x + r * width, width, weight, row_bytes, n,
                                              out + r * outputs, outputs);
      last_tile<Format, Math, kWideRows>(rows - r, x + r * width, width, weight, row_bytes, n,
                                         out + r * outputs, outputs);
    }
  });
  for (int64_t n = groups * kOutputs; n < outputs; ++n)  // a last, partial group
    for (int64_t r = 0; r < rows; ++r)
      tile<Format, Math, 1, 1>(x + r * width, width, weight, row_bytes, n, out + r * outputs,
                               outputs);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// fp32 products of many rows: a panel of weight rows is widened once into a buffer that stays
// in the core's cache, then every row of x is multiplied against it in register tiles. The
// tiles above widen each block again for every kWideRows rows of x, which bounds them at these
// row counts (at AVX2 the widening took as long as the sums: a decode step's products of 32
// rows 76 ms against 55 over panels, and 73 dense, on a Xeon with two threads).
namespace panel {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int kOutputs = 4, kInputs = 6;  // 24 sums and 4 weight vectors of 32 registers
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float total(Vec a) { return _mm512_reduce_add_ps(a); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int kOutputs = 3, kInputs = 4;  // 12 sums, 3 weight vectors and one of x: 16
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float total(Vec a) { return sum8(a); }
#endif
constexpr int64_t kPanelRows = 8 * kOutputs;  // weight rows widened together
// Rows of x from which widening a panel once beats widening in registers every kWideRows
// rows (measured on a Xeon at 8 to 64 rows: more than 8 at AVX2; 32 and more at AVX-512,
// whose widening costs less).
constexpr int64_t kPanelFrom = kWideRows < 8 ? 9 : 32;

// out[r * out_stride + o] = w[o] . x[r] for O rows of weights and R rows of x, fp32 rows of
// `width` values each.
template <int O, int R, typename T>
void tile(const float* w, const float* x, int64_t width, T* out, int64_t out_stride) {
  Vec acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = zero();
  for (int64_t k = 0; k < width; k += kWidth) {
    Vec wk[O];
    for (int o = 0; o < O; ++o) wk[o] = load(w + o * width + k);
    for (int r = 0; r < R; ++r) {
      const Vec xk = load(x + r * width + k);
      for (int o = 0; o < O; ++o) acc[o][r] = fma(wk[o], xk, acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[r * out_stride + o] = static_cast<T>(total(acc[o][r]));
}

// `count` weight rows, widened to fp32 in `panel` (rows `width` apart).
template <typename Format>
void widen_rows(const uint8_t* weight, int64_t row_bytes, int64_t width, int64_t count,
                float* panel) {
  for (int64_t o = 0; o < count; ++o)
    for (int64_t b = 0; b < width / kBlock; ++b) {
      const uint8_t* block = weight + o * row_bytes + b * Format::kBytes;
      __builtin_prefetch(block + kPrefetchBytes);
      Lanes low, high;
      Format::widen(block, low, high);
      store(panel + o * width + b * kBlock, low);
      store(panel + o * width + b * kBlock + kLanes, high);
    }
}

// `rows` (at most R) rows of x against the panel's `count` rows: out[r * out_stride + o].
template <int R, typename T>
void multiply_rows(const float* panel, int64_t count, const float* x, int64_t rows,
                   int64_t width, T* out, int64_t out_stride) {
  if constexpr (R > 1) {
    if (rows < R) return multiply_rows<R - 1>(panel, count, x, rows, width, out, out_stride);
  }
  int64_t o = 0;
  for (; o + kOutputs <= count; o += kOutputs)
    tile<kOutputs, R>(panel + o * width, x, width, out + o, out_stride);
  for (; o < count; ++o) tile<1, R>(panel + o * width, x, width, out + o, out_stride);
}

// Every row of x against the panel's `count` rows, kInputs rows at a time.
template <typename T>
void multiply_panel(const float* panel, int64_t count, const float* x, int64_t rows,
                    int64_t width, T* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; r += kInputs)
    multiply_rows<kInputs>(panel, count, x + r * width, std::min<int64_t>(kInputs, rows - r),
                           width, out + r * out_stride, out_stride);
}

// out = x @ weight.T in fp32, for x of at least kPanelFrom rows.
template <typename Format, typename T>
void product(const T* x, int64_t rows, int64_t width, const uint8_t* weight, int64_t outputs,
             T* out) {
  std::vector<float> widened_x;
  const float* fp32_x = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    fp32_x = x;
  } else {
    widened_x.assign(x, x + rows * width);
    fp32_x = widened_x.data();
  }
  const int64_t row_bytes = width / kBlock * Format::kBytes;
  const int64_t panels = (outputs + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * width);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * kPanelRows, count = std::min(kPanelRows, outputs - n);
      widen_rows<Format>(weight + n * row_bytes, row_bytes, width, count, panel.data());
      multiply_panel(panel.data(), count, fp32_x, rows, width, out + n, outputs);
    }
  });
}

}  // namespace panel
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// bf16 x on a CPU with AMX: the matrix unit multiplies a 16 x 32 tile of weights (sixteen weight
// rows' blocks, each widened and rounded to bf16 as the dense bf16 weights are) by 32 values of
// up to 16 rows of x in one instruction, so the cost is widening the blocks, whatever the rows.
namespace amx {

constexpr int64_t kTile = 16;  // weight rows, and rows of x, per tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The kernel lets a process use the tile registers only once it asks (Linux 5.16+).
bool enabled() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Tile 0: weights (16 rows x 32 bf16). Tiles 1 and 3: x, pairs of values by row (16 x `cols`
// pairs), two sets of up to 16 rows; tiles 2 and 4: their sums (16 weight rows x `cols`, fp32).
void configure(const int64_t (&cols)[2]) {
  TileConfig config;
  config.rows[0] = kTile, config.bytes_per_row[0] = 64;
  for (int half = 0; half < 2 && cols[half] > 0; ++half)
    for (int t : {1 + 2 * half, 2 + 2 * half})
      config.rows[t] = kTile, config.bytes_per_row[t] = static_cast<uint16_t>(cols[half] * 4);
  _tile_loadconfig(&config);
}

// x rows [0, cols) as the matrix unit's right operand, one tile per block: pairs[b][k][c]
// holds values 2k and 2k + 1 of block b of row c.
std::vector<uint32_t> pair_rows(const at::BFloat16* x, int64_t width, int64_t cols) {
  const int64_t blocks = width / kBlock;
  std::vector<uint32_t> pairs(blocks * kTile * cols);
  for (int64_t c = 0; c < cols; ++c) {
    const auto* row = reinterpret_cast<const uint32_t*>(x + c * width);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k = 0; k < kTile; ++k) pairs[(b * kTile + k) * cols + c] = row[b * kTile + k];
  }
  return pairs;
}

// Sixteen weight rows' block b, widened and rounded to bf16 into `tile`, then into tile 0.
template <typename Format>
void load_weights(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t b,
                  at::BFloat16* tile) {
  for (int64_t o = 0; o < kTile; ++o) {
    const uint8_t* block = weight + (n + o) * row_bytes + b * Format::kBytes;
    __builtin_prefetch(block + kPrefetchBytes);
    Lanes low, high;
    Format::widen(block, low, high);
    _mm512_store_si512(tile + o * kBlock,
                       reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
  _tile_loadd(0, tile, 64);
}

template <typename T>
void store_sums(const float* sums, int64_t cols, int64_t n, int64_t outputs, T* out) {
  for (int64_t o = 0; o < kTile; ++o)
    for (int64_t c = 0; c < cols; ++c)
      out[c * outputs + n + o] = static_cast<T>(sums[o * cols + c]);
}

// Up to 32 rows of x per pass, so each block is widened once for all of them.
template <typename Format>
void product(const at::BFloat16* x, int64_t rows, int64_t width, const uint8_t* weight,
             int64_t outputs, at::BFloat16* out) {
  const int64_t row_bytes = width / kBlock * Format::kBytes, blocks = width / kBlock;
  for (int64_t first = 0; first < rows; first += 2 * kTile) {
    const int64_t cols[2] = {std::min(kTile, rows - first),
                             std::clamp<int64_t>(rows - first - kTile, 0, kTile)};
    const auto low = pair_rows(x + first * width, width, cols[0]);
    const auto high = pair_rows(x + (first + kTile) * width, width, cols[1]);
    at::parallel_for(0, outputs / kTile, 1, [&](int64_t begin, int64_t end) {
      configure(cols);
      alignas(64) at::BFloat16 tile[kTile * kBlock];
      alignas(64) float sums[kTile * kTile];
      for (int64_t group = begin; group < end; ++group) {
        const int64_t n = group * kTile;
        _tile_zero(2);
        if (cols[1] > 0) _tile_zero(4);
        for (int64_t b = 0; b < blocks; ++b) {
          load_weights<Format>(weight, row_bytes, n, b, tile);
          _tile_loadd(1, low.data() + b * kTile * cols[0], cols[0] * 4);
          _tile_dpbf16ps(2, 0, 1);
          if (cols[1] == 0) continue;
          _tile_loadd(3, high.data() + b * kTile * cols[1], cols[1] * 4);
          _tile_dpbf16ps(4, 0, 3);
        }
        _tile_stored(2, sums, cols[0] * 4);
        store_sums(sums, cols[0], n, outputs, out + first * outputs);
        if (cols[1] == 0) continue;
        _tile_stored(4, sums, cols[1] * 4);
        store_sums(sums, cols[1], n, outputs, out + (first + kTile) * outputs);
      }
      _tile_release();
    });
  }
}

}  // namespace amx
#endif

// out = x @ weight.T in fp32 arithmetic, for x (and out) of type T.
template <typename T>
void fp32_product(const at::Tensor& x, const at::Tensor& weight, int64_t bits, at::Tensor& out) {
  const auto args = std::make_tuple(x.data_ptr<T>(), x.size(0), x.size(1),
                                    weight.data_ptr<uint8_t>(), weight.size(0), out.data_ptr<T>());
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (x.size(0) >= panel::kPanelFrom) {
    std::apply(bits == 4 ? panel::product<Q4_1, T> : panel::product<Q8_0, T>, args);
    return;
  }
#endif
  std::apply(bits == 4 ? product<Q4_1, Fp32Math<T>, T> : product<Q8_0, Fp32Math<T>, T>, args);
}

}  // namespace

// x [rows, K] fp32 or bf16 (rows may be strided); weight uint8 [N, K / 32 * block bytes] of
// 4-bit (Q4_1) or 8-bit (Q8_0) blocks. Returns x @ weight.T as [rows, N] in x's dtype.
at::Tensor quant_linear(at::Tensor x, at::Tensor weight, int64_t bits) {
  check_operands("quant_linear", x, weight, bits);
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  // Up to kRows rows the fp32 path is faster: widening is the cost, and it widens less.
  if (x.scalar_type() == at::kBFloat16 && x.size(0) > kRows) {
    const auto rows = x.contiguous();
    const auto args = std::make_tuple(rows.data_ptr<at::BFloat16>(), x.size(0), x.size(1),
                                      weight.data_ptr<uint8_t>(), weight.size(0),
                                      out.data_ptr<at::BFloat16>());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (weight.size(0) % amx::kTile == 0 && amx::enabled()) {
      std::apply(bits == 4 ? amx::product<Q4_1> : amx::product<Q8_0>, args);
      return out;
    }
#endif
#if defined(__AVX512BF16__)
    std::apply(bits == 4 ? product<Q4_1, Bf16DotMath, at::BFloat16>
                         : product<Q8_0, Bf16DotMath, at::BFloat16>, args);
    return out;
#endif
  }
  if (x.scalar_type() == at::kBFloat16)
    fp32_product<at::BFloat16>(x.contiguous(), weight, bits, out);
  else
    fp32_product<float>(x.contiguous(), weight, bits, out);
  return out;
}
