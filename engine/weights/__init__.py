"""A model folder and what it holds: the spec (shape, special tokens, KV fingerprint), the
weights, their quant blocks (the GGUF's 4-/8-bit blocks, kept for small-batch products) and the
quant row counts measured here, the tokenizer, and the folder's preparation from a packaged
GGUF. Importing this package (or files, folder, spec, dtypes, tokenizer) does not load torch."""
