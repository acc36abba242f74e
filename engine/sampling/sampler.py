"""Token sampling: penalties, allowed and bad tokens, greedy, temperature, min-p, top-k and
top-p, and logprobs; reproducible per request."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.messages import PromptLogprob, Sampling, TokenBias, TopLogprob


@dataclass(frozen=True)
class History:
    """What a row's penalties and min_tokens look at."""

    tokens: Sequence[int] = ()  # the prompt, then the output so far
    output_start: int = 0  # tokens[output_start:] is the output
    banned: Sequence[int] = ()  # ids the draw may not pick (stop tokens, under min_tokens)
    allowed: torch.Tensor | None = None  # bool [vocab]: the only ids a grammar lets it pick


NO_HISTORY = History()


@dataclass(frozen=True)
class Draw:
    """A drawn token; its logprob and the most likely tokens' when the request asked."""

    token_id: int
    logprob: float | None = None
    top: list[TopLogprob] = field(default_factory=list)


_MASK64 = 2**64 - 1


def seed_at(seed: int | None, position: int) -> int | None:
    """The seed of a seeded request's draw of its output token `position` (None: unseeded,
    fresh entropy). A seed of its own for each position makes a seeded request's tokens the
    same whichever worker draws each one, and however often the request resumed elsewhere:
    its draws pick up at the position its output reached (splitmix64 of seed and position)."""
    if seed is None:
        return None
    mixed = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (mixed ^ (mixed >> 31)) >> 1  # 63 bits, which every torch generator takes


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (where the logits it samples are) seeded with `seed`, or from
    fresh entropy when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[Sampling], generators: list[torch.Generator],
    histories: list[History] | None = None,
) -> list[int]:
    """The token ids `draw` picks."""
    return [d.token_id for d in draw(logits, params, generators, histories)]


def draw(
    logits: torch.Tensor, params: list[Sampling], generators: list[torch.Generator],
    histories: list[History] | None = None,
) -> list[Draw]:
    """One token per row of `logits` `[B, V]`; a row's draw depends only on its own logits,
    params, history (none: no penalty applies) and generator, never on the other rows.

    Penalties, allowed_token_ids and bad_words, the grammar's mask and the min_tokens ban
    change the logits first, before greedy argmax as before temperature, min-p, top-k and
    top-p. Logprobs are the log-softmax of
    those penalized logits: before temperature, top-k and top-p, so a greedy request gets the
    model's own numbers."""
    rows = histories if histories is not None else [NO_HISTORY] * len(params)
    assert logits.dim() == 2 and len(params) == len(generators) == len(rows) == logits.shape[0]
    # Plain greedy rows take one argmax together: on a GPU, one copy to the host, not one each.
    plain = [_plain_greedy(p, history) for p, history in zip(params, rows, strict=True)]
    argmax = logits.argmax(dim=-1).tolist() if any(plain) else []
    return [Draw(argmax[row]) if plain[row]
            else _draw_row(logits[row].float(), p, generators[row], rows[row])
            for row, p in enumerate(params)]


def _plain_greedy(params: Sampling, history: History) -> bool:
    """Whether the row's draw is the argmax of its logits as they are."""
    return (params.greedy and params.logprobs is None and params.repetition_penalty == 1
            and not params.frequency_penalty and not params.presence_penalty
            and params.allowed_token_ids is None and not params.bad_words
            and not params.logit_bias and history.allowed is None and not history.banned)


def _draw_row(
    logits: torch.Tensor, params: Sampling, generator: torch.Generator, history: History
) -> Draw:
    logits = _penalized(logits, params, history)
    token = int(logits.argmax()) if params.greedy else _race(logits, params, generator)
    if params.logprobs is None:
        return Draw(token)
    return _with_logprobs(token, logits, params.logprobs)


def _race(logits: torch.Tensor, params: Sampling, generator: torch.Generator) -> int:
    """An exponential race (argmax of p / Exp(1) noise drawn in vocabulary order): the same
    draw as sampling from p, but a logit that moves by a rounding error (another batch shape)
    only changes the pick when two tokens are that close, never by reordering near-ties."""
    logits = logits / params.temperature
    keep = _kept(logits, params.top_k, params.top_p)
    if params.min_p > 0:  # p >= min_p * max p, in logits
        keep &= logits >= logits.max() + math.log(params.min_p)
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _penalized(logits: torch.Tensor, params: Sampling, history: History) -> torch.Tensor:
    """The logits after the repetition, frequency and presence penalties (vLLM's order), the
    request's allowed and bad tokens, the grammar's mask and the ban; the same tensor when
    none applies. Ids outside the vocabulary are skipped. The request's restrictions yield
    when, with the grammar's, they would leave no token."""
    if params.repetition_penalty != 1:
        seen = _ids(history.tokens, logits).unique()
        logits = _repetition(logits, seen, params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        output = _ids(history.tokens[history.output_start:], logits)
        logits = _frequency_presence(logits, output, params)
    if params.logit_bias:
        logits = _biased(logits, params.logit_bias)
    restricted = _restricted(logits, params, history)
    masked = _grammar_masked(restricted, history)
    if restricted is not logits and not bool(masked.isfinite().any()):
        masked = _grammar_masked(logits, history)
    return _banned(masked, history)


def _grammar_masked(logits: torch.Tensor, history: History) -> torch.Tensor:
    if history.allowed is None:
        return logits
    return logits.masked_fill(~history.allowed.to(logits.device), float("-inf"))


def _restricted(logits: torch.Tensor, params: Sampling, history: History) -> torch.Tensor:
    """Only allowed_token_ids may be drawn; nor a bad word's last token after the rest."""
    vocab = logits.shape[0]
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        keep[_ids(params.allowed_token_ids, logits)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    bad = _bad_word_ends(params.bad_words, history)
    if bad:
        logits = logits.index_fill(0, _ids(bad, logits), float("-inf"))
    return logits


def _bad_word_ends(bad_words: Sequence[Sequence[int]], history: History) -> list[int]:
    """vLLM's bad_words: a word's last token, where the output so far ends with the others."""
    tokens, start = history.tokens, history.output_start
    ends = []
    for word in bad_words:
        before = len(word) - 1
        if before == 0 or (len(tokens) - start >= before
                           and list(tokens[len(tokens) - before:]) == list(word[:-1])):
            ends.append(word[-1])
    return ends


def _banned(logits: torch.Tensor, history: History) -> torch.Tensor:
    """The ban; under a grammar it yields when it would leave no token: a finished JSON value
    must end, min_tokens or not."""
    if not history.banned:
        return logits
    banned = logits.index_fill(0, _ids(history.banned, logits), float("-inf"))
    if history.allowed is not None and not bool(banned.isfinite().any()):
        return logits
    return banned


def _ids(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """The ids among `tokens` inside the vocabulary of `logits` `[V]`, on its device."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return ids[(ids >= 0) & (ids < logits.shape[0])].to(logits.device)


def _repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's and vLLM's: a seen token's logit is divided by `penalty` when positive,
    multiplied by it otherwise (both lower it when penalty > 1)."""
    scores = logits[seen]
    scaled = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.index_put((seen,), scaled)


def _biased(logits: torch.Tensor, biases: Sequence[TokenBias]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit plus its bias (ids outside the
    vocabulary skipped, as everywhere here)."""
    inside = [b for b in biases if 0 <= b.token_id < logits.shape[0]]
    ids = torch.tensor([b.token_id for b in inside], dtype=torch.long, device=logits.device)
    values = torch.tensor([b.bias for b in inside], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, values)


def _frequency_presence(logits: torch.Tensor, output: torch.Tensor, params: Sampling
                        ) -> torch.Tensor:
    """OpenAI's: minus frequency_penalty per occurrence in the output, minus
    presence_penalty once for any occurrence."""
    counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
    present = (counts > 0).to(logits.dtype)
    return logits - params.frequency_penalty * counts - params.presence_penalty * present


def _with_logprobs(token: int, logits: torch.Tensor, k: int) -> Draw:
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.shape[0]))
    top = [TopLogprob(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return Draw(token, float(logprobs[token]), top)


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
        kept = int((mass_before < top_p).sum())
        sorted_logits = sorted_logits[:max(kept, 1)]  # NaN logits keep none: keep the first
    return logits >= sorted_logits[-1]


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[PromptLogprob]:
    """Row i's logprob of `targets[i]` (the prompt token that follows it) and the `k` most
    likely tokens there: the model's own numbers, no penalty or bias applied (as vLLM's)."""
    assert logits.shape[0] == len(targets)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(len(targets), device=logits.device)
    targets_at = torch.tensor(targets, dtype=torch.long, device=logits.device)  # [] too
    chosen = logprobs[rows, targets_at].tolist()
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], rows[:, None][:, :0])
    return [PromptLogprob(logprob, [TopLogprob(i, v) for i, v in zip(top_ids, top_values,
                                                                     strict=True)])
            for logprob, top_ids, top_values in zip(chosen, ids.tolist(), values.tolist(),
                                                    strict=True)]
