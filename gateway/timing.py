"""One request's latency breakdown at the gateway: its stage here (gateway_queue), the stages
its workers reported with its tokens, and its time to first token.

Each stage is observed into `raging_stage_seconds{stage}` as it becomes known (gateway.dispatch);
`breakdown` is what a client that asks for it gets in its response (docs/api.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.messages import STAGES, Stage, StageTime

TIMING_HEADER = "x-raging-timing"


@dataclass
class RequestTiming:
    """Stamps are the gateway's `time.monotonic()`; `stages` are seconds as measured where each
    stage ran, the latest epoch's where the request was resumed."""

    arrived: float = field(default_factory=time.monotonic)  # its HTTP request came in
    dispatched: float | None = None  # its first PrefillRequest went out
    first_token: float | None = None  # the client's first token was ready
    stages: dict[Stage, float] = field(default_factory=dict)
    resumed: int = 0  # epochs after the first

    def dispatch(self, now: float) -> None:
        """Its first PrefillRequest goes out: the end of its gateway_queue stage."""
        assert self.dispatched is None, "dispatched once; a resumed epoch is not queued here"
        self.dispatched = now
        self.stages["gateway_queue"] = max(now - self.arrived, 0.0)

    def record(self, stages: list[StageTime]) -> None:
        for stage in stages:
            self.stages[stage.stage] = stage.seconds

    def breakdown(self, now: float | None = None) -> dict[str, float | int | None]:
        """Milliseconds per stage (None: not part of this request's path, or not reached),
        time to first token, and arrival to `now` (the response's end)."""
        end = time.monotonic() if now is None else now
        shown: dict[str, float | int | None] = {
            f"{stage}_ms": _ms(self.stages.get(stage)) for stage in STAGES}
        first = None if self.first_token is None else self.first_token - self.arrived
        shown.update(ttft_ms=_ms(first), e2e_ms=_ms(end - self.arrived), resumed=self.resumed)
        return shown


def asks_for_timing(header: str | None, in_body: bool) -> bool:
    """Whether the client asked for the breakdown: `X-Raging-Timing: true` or the body's
    `"raging": {"timing": true}`."""
    return in_body or (header or "").strip().lower() in ("true", "1", "yes")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
