"""KV cache blocks: the paged cache tensors (`cache`), and the bookkeeping over them without
tensors: the block allocator, chained block hashes and the prefix cache."""
