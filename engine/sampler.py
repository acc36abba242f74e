"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; temperature 0 is greedy, top_k 0 and top_p 1 are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken."""
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from fresh entropy when None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of `logits` `[B, V]`; a row's draw depends only on its own
    logits, params and generator, never on the other rows."""
    assert logits.dim() == 2 and len(params) == len(generators) == logits.shape[0]
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[row] if p.greedy else _sample_row(logits[row].float(), p, generators[row])
        for row, p in enumerate(params)
    ]


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        logits, candidates = logits.topk(params.top_k)  # sorted, descending
    else:
        candidates = None
    if params.top_p < 1:
        if candidates is None:
            logits, candidates = logits.sort(descending=True)
        logits = _top_p_filter(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return choice if candidates is None else int(candidates[choice])


def _top_p_filter(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask out the tail of descending `sorted_logits` beyond cumulative probability `top_p`."""
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass before it is below top_p; the first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    return sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
