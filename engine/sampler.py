"""Token sampling: greedy, temperature, top-k and top-p, reproducible per request."""

from __future__ import annotations

import torch

from core.messages import Sampling


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from fresh entropy when None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[Sampling], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of `logits` `[B, V]`; a row's draw depends only on its own
    logits, params and generator, never on the other rows."""
    assert logits.dim() == 2 and len(params) == len(generators) == logits.shape[0]
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[row] if p.greedy else _sample_row(logits[row].float(), p, generators[row])
        for row, p in enumerate(params)
    ]


def _sample_row(logits: torch.Tensor, params: Sampling, generator: torch.Generator) -> int:
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
