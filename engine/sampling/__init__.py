"""Choosing each next token: the sampler (penalties, greedy, temperature, top-k/p, logprobs),
grammars for structured output, and when a sequence stops."""
