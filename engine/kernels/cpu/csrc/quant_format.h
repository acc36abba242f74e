// The GGUF quant blocks both kinds of quant products read (quant_linear.cpp: fp32 inputs
// against blocks widened in registers; quant_int8.cpp: inputs quantized to 8 bits too).
//   Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes whose low nibbles are values 0-15 of the block and
//         high nibbles values 16-31; value = d * q + m.
//   Q8_0, 34 bytes: fp16 d, 32 signed bytes; value = d * q.
#pragma once

#include <c10/util/Half.h>
#include "tensor.h"

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;     // values per block
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;

inline int64_t block_bytes(int64_t bits) { return bits == 4 ? kQ4_1Bytes : kQ8_0Bytes; }

// Both products' operands: x [rows, K] fp32 or bf16, K a multiple of 32; weight contiguous
// uint8 [N, K / 32 * block bytes] of `bits`-bit blocks.
inline void check_operands(const char* kernel, const at::Tensor& x,
                           const at::Tensor& weight, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, kernel, " takes 4-bit or 8-bit blocks");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [rows, K], K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              kernel, " takes fp32 or bf16 inputs");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 &&
              weight.is_contiguous() && weight.size(1) == x.size(1) / kBlock * block_bytes(bits),
              "weight must be contiguous uint8 [N, K / 32 * ", block_bytes(bits), "]");
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

}  // namespace
