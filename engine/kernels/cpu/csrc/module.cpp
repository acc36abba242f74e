// The Python module of raging's C++ kernels (engine/kernels/cpu/build.py builds it).
// pybind.h has the casters between Python tensors and at::Tensor; torch/extension.h would add
// the whole C++ frontend, which quadrupled this file's build.
#include <torch/csrc/utils/pybind.h>

#include "tensor.h"

#include "lanes.h"

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor tables, at::Tensor contexts, int64_t block_size);
at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor table, int64_t start, int64_t block_size);
at::Tensor quant_linear(at::Tensor x, at::Tensor weight, int64_t bits);
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor weight, int64_t bits);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);

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
