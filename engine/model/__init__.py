"""The forward pass: `llama.LlamaModel` over a paged KV cache, its attention plan, RoPE, the
weight products (dense or over quant blocks), the batch it runs, and what a chunk costs."""
