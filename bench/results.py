"""What `serve` measured: each target (server), each of its runs, and the sweep verdict."""

from __future__ import annotations

from dataclasses import dataclass

from bench.launcher import ProcessMemory
from bench.load import Load, LoadRun
from bench.stats import Slo, goodput_rate
from bench.summary import Summary
from bench.workloads import Workload


@dataclass(frozen=True)
class Measured:
    """One run: one target under one load."""

    load: Load
    run: LoadRun
    summary: Summary

    def label(self, target: str) -> str:
        """`target` with this run's load (see `run_label`)."""
        return run_label(target, self.load)


def run_label(target: str, load: Load) -> str:
    """`target` with the load, such as "ours c=32" or "ours @ 2 req/s"."""
    if load.rate is None:
        return f"{target} c={load.concurrency}"
    return f"{target} @ {load.rate:g} req/s"


@dataclass(frozen=True)
class TargetResults:
    """Every run against one server; `memory` and `launch_flags` only for a server we launched."""

    label: str
    url: str
    model: str
    runs: tuple[Measured, ...]
    launch_flags: tuple[str, ...] | None = None
    run_dir: str | None = None
    memory: dict[str, ProcessMemory] | None = None

    def goodput_rate(self) -> float | None:
        """Highest swept rate keeping SLO attainment >= 90% (None: none, or no sweep)."""
        points = [(m.load.rate, m.summary.slo_attainment) for m in self.runs
                  if m.load.rate is not None]
        return goodput_rate(points) if points else None


@dataclass(frozen=True)
class ServeResults:
    """A whole `serve` invocation: the same requests sent to every target."""

    command: tuple[str, ...]
    workload: Workload
    prompts: str  # how prompts were made: token ids (exact) or text (approximate)
    num_requests: int
    warmup: int
    slo: Slo
    sweep: bool
    targets: tuple[TargetResults, ...]
