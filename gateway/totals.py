"""Cumulative counts that workers report since they started, kept monotonic at the gateway.

A worker's own count starts again at 0 when its process restarts (a new instance id), and its
series would vanish when it leaves; Prometheus counters must never go down. `WorkerTotals`
keeps, per worker id, what every earlier instance had reached plus what the current one
reports, for as long as the gateway runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Tally:
    instance_id: str
    reported: float = 0  # the current instance's own count, as last reported
    earlier: float = 0  # what the previous instances of this worker id had reached

    @property
    def total(self) -> float:
        return self.earlier + self.reported


class WorkerTotals:
    """One cumulative count per worker id, fed each heartbeat's since-start value."""

    def __init__(self) -> None:
        self._tallies: dict[str, _Tally] = {}

    def report(self, worker_id: str, instance_id: str, since_start: float) -> None:
        """A worker's count since its process started. A new instance (or a count that went
        down, which only a restart does) starts a new run on top of the old total."""
        tally = self._tallies.get(worker_id)
        if tally is None:
            tally = self._tallies[worker_id] = _Tally(instance_id)
        elif tally.instance_id != instance_id or since_start < tally.reported:
            tally.earlier, tally.instance_id = tally.total, instance_id
            tally.reported = 0
        tally.reported = since_start

    def by_worker(self) -> dict[str, float]:
        """Every worker id ever reported, gone ones included, with its total."""
        return {worker_id: tally.total for worker_id, tally in self._tallies.items()}

    def total(self) -> float:
        return sum(tally.total for tally in self._tallies.values())
