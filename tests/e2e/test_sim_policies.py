"""`bench policies` end to end: a 40-request trace in prefix groups replayed on a real simulated
cluster (`--model sim --prefill 1 --decode 2`) under two policies; every stream must be the
simulated model's answer, and the report filled."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.policies import BY_NAME, ReplayPlan, prepare_trace, run, write_results
from bench.trace import Grouping, workload_trace
from bench.workloads import Workload
from engine.sim.profile import load_profile

pytestmark = pytest.mark.e2e


def test_two_policies_replay_a_trace_with_every_stream_right(tmp_path: Path) -> None:
    trace = workload_trace(Workload("chat", seed=2, max_output_len=16), 40, rate=20.0,
                           grouping=Grouping(groups=3, prefix_tokens=300))
    prepared = prepare_trace(trace, load_profile("default").mean_output_tokens)
    plan = ReplayPlan("generated", prepared, (BY_NAME["shipped"], BY_NAME["pure-disagg"]),
                      prefill=1, decode=2, request_timeout_s=60)
    runs = run(plan)
    text = write_results(plan, runs, tmp_path)
    for policy_run in runs:
        results = [r.result for r in policy_run.replayed]
        assert [r.error for r in results if not r.ok] == [], policy_run.policy.name
        assert [r.result.index for r in policy_run.replayed if not r.right] == []
        assert sum(policy_run.routes.get(path, 0) for path in (
            "disaggregated", "local_short", "local_saturated", "local_cached")) == 40
        assert sum(r.cached_tokens or 0 for r in results) > 0  # the groups' prefixes were reused
    assert [line.split("|")[-2].strip() for line in text.splitlines()
            if line.startswith("| `")][:2] == ["0", "0"]  # wrong streams
    assert (tmp_path / "results.json").exists() and (tmp_path / "policies.png").exists()
