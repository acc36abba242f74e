"""The simulated engine behind `--model sim` and `--model sim:PROFILE`: the real prefill and
decode workers, schedulers, block allocator, prefix cache, KV transfer and control messages,
with only the forward pass replaced.

- `engine.sim.profile`: a profile, fitted by `python -m bench calibrate`: the model's shape (so
  its KV bytes per token) and its step times, prefill `a + b*tokens + c*tokens*context`, decode
  `d + e*batch + f*sum(context)`;
- `engine.sim.tokens`: the tokens a simulated model answers, a hash chain over the request's
  tokens and positions, carried in its KV cache so that a stream is right only if its KV moved
  right;
- `engine.sim.folder`: the model folder a profile serves (config, byte-level tokenizer);
- `engine.sim.runner`: `SimRunner`, which a worker runs in place of `ModelRunner`: it writes
  the chain into the cache, sleeps the profile's step time (layer by layer where KV streams
  out), and returns logits that pick the chain's token.
"""
