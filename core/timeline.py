"""When a request passed each point of its way through one worker, and the stages that makes.

Stamps are the worker's own `time.monotonic()`; only their differences leave the process, as the
`StageTime`s of the token messages, so no two processes' clocks are ever compared. The worker's
spans (core/tracing.py) are made from the same stamps.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.messages import StageTime


@dataclass
class Timeline:
    """One request's stamps on one worker; None: not reached (yet), or not on this worker."""

    arrived: float | None = None  # the request reached this worker to be prefilled
    started: float | None = None  # the forward pass of its first prompt chunk began here
    computed: float | None = None  # its prompt's KV was computed here: its first token drawn
    first_kv: float | None = None  # the first chunk of its KV arrived here from a prefill worker
    kv_ready: float | None = None  # its prompt's KV is whole here, received or computed
    first_decoded: float | None = None  # the first token a decode step drew for it went out

    def start(self, now: float) -> None:
        """Its prompt's forward pass begins (only the first chunk's counts)."""
        if self.started is None:
            self.started = now

    def prefill_stages(self) -> list[StageTime]:
        """prefill_wait and prefill_compute, once its first token is drawn here."""
        if self.arrived is None or self.started is None or self.computed is None:
            return []
        return [StageTime("prefill_wait", max(self.started - self.arrived, 0.0)),
                StageTime("prefill_compute", max(self.computed - self.started, 0.0))]

    def decode_stages(self) -> list[StageTime]:
        """kv_transfer (when its KV came from a prefill worker) and first_decode, once its first
        decode step's token is out."""
        if self.kv_ready is None or self.first_decoded is None:
            return []
        stages = [StageTime("first_decode", max(self.first_decoded - self.kv_ready, 0.0))]
        if self.first_kv is not None:
            stages.insert(0, StageTime("kv_transfer", max(self.kv_ready - self.first_kv, 0.0)))
        return stages
