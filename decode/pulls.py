"""A decode worker's pulls: prompts it prefills itself once the KV of their leading tokens has
come from the worker whose prefix cache holds them (kvtransfer/share.py is that worker's side).
Pure bookkeeping; the KV itself arrives through decode.incoming, as a hand-off's does.

A pull ends one of two ways: the prefix arrives whole (its tokens count as cached for the
request, and are written into its blocks at admission), or it falls back: the holder had none
of it cached, its KV did not fit, or the lease ran out; the prompt is then computed here from
what this worker's own cache holds. Either way the request goes on: a pull never fails one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from core.messages import PullTotals, RequestKey
from decode.scheduler import DecodeSequence

_MIN_PACE_TOKENS = 16  # a step computing fewer prompt tokens says little about their cost
_PACE_WEIGHT = 0.2


@dataclass
class PendingPull:
    """A cached prefix asked of another worker, its KV not yet here."""

    choices: list[DecodeSequence]  # the request's choices, the first to get the prefix
    asked_at: float


@dataclass
class Pace:
    """Seconds per prompt token computed here, lately (0: not measured yet): an average over
    the steps that computed prompt tokens, the newest weighing most."""

    s_per_token: float = 0.0

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens < _MIN_PACE_TOKENS:
            return
        sample = seconds / prompt_tokens
        self.s_per_token = sample if not self.s_per_token else (
            (1 - _PACE_WEIGHT) * self.s_per_token + _PACE_WEIGHT * sample)


@dataclass
class Pulls:
    pending: dict[RequestKey, PendingPull] = field(default_factory=dict)
    totals: PullTotals = field(default_factory=PullTotals)
    pace: Pace = field(default_factory=Pace)

    def start(self, choices: list[DecodeSequence], now: float) -> None:
        self.pending[choices[0].key] = PendingPull(choices, now)

    def take(self, key: RequestKey) -> PendingPull | None:
        return self.pending.pop(key, None)

    def received(self, pull: PendingPull, tokens: int, nbytes: int, now: float) -> None:
        """The prefix came whole: count it, and the prefill time it saved as measured here
        (none, rather than a loss, for a pull slower than computing: a counter never falls)."""
        seconds = now - pull.asked_at
        saved = max(0.0, tokens * self.pace.s_per_token - seconds)
        t = self.totals
        self.totals = replace(t, pulls=t.pulls + 1, tokens=t.tokens + tokens,
                              bytes=t.bytes + nbytes, seconds=t.seconds + seconds,
                              saved_s=t.saved_s + saved)

    def fell_back(self) -> None:
        self.totals = replace(self.totals, fallbacks=self.totals.fallbacks + 1)
