"""What a prompt chunk costs a forward pass, so that a step's budget bounds its time.

A chunk of n tokens from position s runs n tokens through the layers' matrices and attends to
n*s + n(n+1)/2 keys. Deep into a long prompt the keys dominate: on one core here a 256-token
chunk takes 120 ms at the start of a prompt and 340 ms 3,072 tokens in. Costs are in tokens at
an empty context; `keys_per_token` keys cost as much as one token's matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.weights.spec import ModelSpec

# Attention's arithmetic runs at about half the speed of the projections' on CPU (bf16, one
# core: ~295 against ~575 GFLOP/s), so a key costs twice its FLOPs' share.
ATTENTION_SPEED = 0.5


@dataclass(frozen=True)
class ChunkCost:
    """Chunk costs for one model; `keys_per_token=inf` counts tokens alone."""

    keys_per_token: float = math.inf

    @classmethod
    def of(cls, spec: ModelSpec) -> ChunkCost:
        """From the model's shape: its projection FLOPs per token over attention's per key."""
        hidden, heads, kv_heads = spec.hidden_size, spec.num_heads, spec.num_kv_heads
        projections = hidden * spec.head_dim * (2 * heads + 2 * kv_heads)
        mlp = 3 * hidden * spec.intermediate_size
        matrix_flops = 2 * (projections + mlp)
        key_flops = 4 * heads * spec.head_dim
        return cls(matrix_flops / key_flops * ATTENTION_SPEED)

    def cost(self, start: int, count: int) -> float:
        """Tokens start..start+count-1, in tokens at an empty context."""
        assert start >= 0 and count >= 0
        keys = count * start + count * (count + 1) / 2
        return count + keys / self.keys_per_token

    def tokens_within(self, budget: float, start: int, pending: int) -> int:
        """The most of `pending` tokens from `start` that cost at most `budget` (0 if none)."""
        if budget <= 0 or pending <= 0:
            return 0
        if self.cost(start, pending) <= budget:
            return pending
        k = self.keys_per_token
        if k == math.inf:
            return min(int(budget), pending)
        linear = 1 + (start + 0.5) / k  # cost = count^2 / 2k + linear * count
        count = int(k * (math.sqrt(linear * linear + 2 * budget / k) - linear))
        while count > 0 and self.cost(start, count) > budget:  # float rounding
            count -= 1
        return min(count, pending)


TOKENS_ONLY = ChunkCost()  # keys free: a chunk costs its token count
