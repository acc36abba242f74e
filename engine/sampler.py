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
    """An exponential race (argmax of p / Exp(1) noise drawn in vocabulary order): the same
    draw as sampling from p, but a logit that moves by a rounding error (another batch shape)
    only changes the pick when two tokens are that close, never by reordering near-ties."""
    logits = logits / params.temperature
    keep = _kept(logits, params.top_k, params.top_p)
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _kept(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens top-k and top-p keep, as a mask in vocabulary order (the smallest kept logit
    is the threshold, so the mask does not depend on how ties were sorted)."""
    if not (0 < top_k < logits.shape[0] or top_p < 1):
        return torch.ones_like(logits, dtype=torch.bool)
    sorted_logits = logits.sort(descending=True).values
    if 0 < top_k < logits.shape[0]:
        sorted_logits = sorted_logits[:top_k]
    if top_p < 1:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass before it is below top_p; the first is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits[mass_before < top_p]
    return logits >= sorted_logits[-1]
