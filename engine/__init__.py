"""The model runtime both worker pools share, one sub-package per concept:

- `engine.model`: the Llama-family forward pass over a paged KV cache (attention, RoPE, the
  weight products, the batch it runs, the cost of a prompt chunk);
- `engine.kv`: the paged KV cache, its block allocator, block hashes and the prefix cache
  (pure bookkeeping but the cache tensors);
- `engine.sampling`: drawing tokens (penalties, top-k/p, logprobs), grammars, stopping;
- `engine.weights`: a model folder: its spec, weights, quant blocks, and its preparation
  (`python -m engine`);
- `engine.kernels`: the compiled kernels, by backend (`cpu/`), and what the CPU can do.

`engine.locate.resolve_model` finds a model's folder (a simulated one's or a real one's);
`engine.runner.load_runner` builds a worker's `ModelRunner` from config. Nothing here starts a
process or talks on a socket (core/ does).
"""
