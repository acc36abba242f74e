"""The serving layouts the goodput benchmarks compare on the same CPUs, and how each is probed
unloaded (bench/goodput.py sweeps rates over them; bench/steps.py steps load through them)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from bench.goodput_results import Unloaded, fit_unloaded
from bench.launcher import PURE_DISAGG
from bench.load import Load, run_load
from bench.prompts import PromptMaker
from bench.stats import Slo
from bench.workloads import RequestSpec

# Equal CPUs on a 2-core host: one core per pool (disaggregated), one per colocated worker, or
# one colocated worker with both cores and two threads.
MODES: dict[str, tuple[str, ...]] = {
    "disagg": ("--prefill", "1", "--decode", "1", *PURE_DISAGG),
    "conditional": ("--prefill", "1", "--decode", "1"),
    "coloc-2x1": ("--colocated", "2"),
    "coloc-1x2": ("--colocated", "1", "--set", "decode.threads=2"),
}
PROBE_OUTPUT = 16
LOOSE = 2.0  # a request slower than LOOSE x the SLO misses it anyway: cut off, or stop the sweep


def probe_specs(prompts: PromptMaker, lens: Sequence[int]) -> list[RequestSpec]:
    """A short warm-up request, then one request per probe length."""
    return [RequestSpec(i, "probe", prompts.prompt(i, n), n, PROBE_OUTPUT)
            for i, n in enumerate([lens[0], *lens])]


def request_timeout(slo: Slo, specs: Sequence[RequestSpec]) -> float:
    """A cut-off no request within LOOSE x `slo` can reach: later ones miss the SLO anyway."""
    longest = max(s.input_len or 0 for s in specs)
    outputs = max(s.output_len for s in specs)
    return max(30.0, LOOSE * (slo.ttft_budget(longest) + outputs * slo.tpot_s))


async def probe_unloaded(client: httpx.AsyncClient, model: str,
                         probes: Sequence[RequestSpec]) -> Unloaded:
    """One request at a time; the first warms the server up and is not counted."""
    run = await run_load(client, model, probes, Load(concurrency=1, request_timeout_s=300),
                         "unloaded")
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"unloaded requests failed: {failed[0]}")
    return fit_unloaded([(r.input_len or 0, r.ttft_s or 0.0, r.tpot_s)
                         for r in run.results[1:]])
