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


@dataclass(frozen=True)
class CpuInfo:
    """The CPU a benchmark ran on: its model name and its /proc/cpuinfo flags."""

    model: str
    flags: tuple[str, ...]

    def simd(self) -> tuple[str, ...]:
        """The flags that decide which kernels can run: AVX*, AMX*, FMA and F16C."""
        return tuple(f for f in self.flags
                     if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))


@dataclass(frozen=True)
class PeerInfo:
    """How a peer was run: which one, its version, its command and extra environment, and the
    model folder or file it served."""

    peer: str
    version: str
    command: tuple[str, ...]
    env: dict[str, str]
    serves: str


@dataclass(frozen=True)
class PeersResults:
    """A `peers` run: serve's results of every target, the CPU, how each peer was run, our
    targets' kernel ISAs (the samples of raging_worker_kernels_info, if exported) and failures."""

    serve: ServeResults
    cpu: CpuInfo
    cpus: str  # the CPUs every target ran on, such as "0-1"
    peers: dict[str, PeerInfo]  # target label -> peer, for the peers' targets
    kernel_isa: dict[str, list[dict[str, str]]]  # our targets' label -> metric labels
    failed: dict[str, str]  # target label -> why it could not be measured

    def concurrencies(self) -> tuple[int, ...]:
        """Every concurrency some target ran at, ascending."""
        return tuple(sorted({m.load.concurrency for t in self.serve.targets for m in t.runs
                             if m.load.concurrency is not None}))

    def run_at(self, label: str, concurrency: int) -> Measured | None:
        """The run of target `label` at `concurrency`, if it has one."""
        return next((m for t in self.serve.targets if t.label == label for m in t.runs
                     if m.load.concurrency == concurrency), None)

    def references(self) -> tuple[str, ...]:
        """The peers' labels, the ones every target's throughput is compared with."""
        return tuple(t.label for t in self.serve.targets if t.label in self.peers)

    def ratio(self, label: str, reference: str, concurrency: int) -> float | None:
        """Output tokens/s of `label` over those of `reference` at `concurrency` (None when
        either did not run there or `reference` produced nothing)."""
        mine, theirs = self.run_at(label, concurrency), self.run_at(reference, concurrency)
        if mine is None or theirs is None or theirs.summary.output_tokens_per_s <= 0:
            return None
        return mine.summary.output_tokens_per_s / theirs.summary.output_tokens_per_s
