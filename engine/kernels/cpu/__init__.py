"""The C++ CPU kernels: their build (`build.kernels()`), and the wrappers that call them where
they apply (`paged_decode`, `paged_prefill`); RMSNorm, RoPE and the quant-block products are
called from engine.model and engine.weights."""
