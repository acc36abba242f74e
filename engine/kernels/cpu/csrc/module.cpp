// The Python module of raging's C++ kernels (engine/kernels.py builds it).
#include <torch/extension.h>

#include "lanes.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor contexts, int64_t block_size);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor table, int64_t start, int64_t block_size);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t bits);
torch::Tensor quant_linear_int8(torch::Tensor x, torch::Tensor weight, int64_t bits);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("lanes") = RAGING_LANES;  // the vectors its arithmetic runs in
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
  m.def("paged_prefill", &paged_prefill, "a prompt chunk's causal attention over a paged cache");
  m.def("quant_linear", &quant_linear, "x @ weight.T over 4-bit or 8-bit GGUF quant blocks");
  m.def("quant_linear_int8", &quant_linear_int8,
        "x @ weight.T over 4-bit or 8-bit GGUF quant blocks, x quantized to 8 bits");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, scaled by a weight");
  m.def("rope", &rope, "rotary position embedding of each token's heads");
}
