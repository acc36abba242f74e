"""The input of one model forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ForwardBatch:
    """New tokens of several sequences, each attending to its cached prefix and to itself.

    Sequence i has `start_positions[i]` tokens already in the cache (under `block_tables[i]`)
    and appends `token_ids[i]` at positions start..start+len-1. Prefill chunks (many tokens)
    and decode steps (one token) may be mixed. The forward pass returns the logits of each
    sequence's last new token, or of all its new tokens where `all_logits[i]` (empty: none):
    one row each, in order (`logit_rows`). With `hidden`, the runner also keeps those rows'
    final hidden states (after the model's last norm) as its `hidden`, until the next pass.
    """

    token_ids: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    all_logits: list[bool] = field(default_factory=list)
    hidden: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("empty batch")
        if not len(self.token_ids) == len(self.start_positions) == len(self.block_tables):
            raise ValueError("token_ids, start_positions and block_tables differ in length")
        if any(len(tokens) == 0 for tokens in self.token_ids):
            raise ValueError("every sequence needs at least one new token")
        if any(start < 0 for start in self.start_positions):
            raise ValueError("start positions must be >= 0")
        if self.all_logits and len(self.all_logits) != len(self.token_ids):
            raise ValueError("all_logits, when given, needs one flag per sequence")

    def logit_rows(self, index: int) -> int:
        """How many rows of logits the forward pass returns for sequence `index`."""
        every = bool(self.all_logits) and self.all_logits[index]
        return len(self.token_ids[index]) if every else 1

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens over all sequences."""
        return sum(len(tokens) for tokens in self.token_ids)
