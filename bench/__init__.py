"""Benchmarks: `python -m bench serve` (any OpenAI-compatible server) and `python -m bench runner`.

`serve` streams a workload through /v1/completions and measures TTFT, TPOT, inter-token latency,
end-to-end latency, throughput and SLO attainment from the SSE stream; `runner` times the bare
batched forward pass of our runner against transformers on the same weights.
"""
