"""Routing policies on a trace, the parts without a cluster: the policy table against the real
config, prompts of a prefix group, expected answers, route counts and the per-policy report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.client import RequestResult
from bench.policies import (
    BY_NAME,
    POLICIES,
    Policy,
    PolicyRun,
    Replayed,
    ReplayPlan,
    as_json,
    markdown,
    policy_named,
    prepare_trace,
    prompt_ids,
    route_counts,
    summarize_run,
    write_results,
)
from bench.sim_streams import expected_text
from bench.stats import Slo
from bench.trace import TraceRequest
from core.config import Config, Routing, load_config
from core.messages import Register
from engine.sim.tokens import continuation
from gateway.packing import Packing
from gateway.registry import Registry
from gateway.routing import LocalPrefill, Router

FP = "fp"


def test_every_policy_sets_real_config_keys_away_from_the_shipped_values() -> None:
    shipped = Config()
    for policy in POLICIES:
        config = load_config(overrides=dict(policy.settings))
        for key, _ in policy.settings:
            section, _, name = key.partition(".")
            assert getattr(getattr(config, section), name) != \
                getattr(getattr(shipped, section), name), (policy.name, key)
    assert BY_NAME["shipped"].settings == ()


def test_policy_flags_and_names() -> None:
    policy = Policy("x", (("gateway.decode_routing", "spread"), ("sim.time_scale", "2")), "")
    assert policy.flags() == ("--set", "gateway.decode_routing=spread",
                              "--set", "sim.time_scale=2")
    assert len(BY_NAME) == len(POLICIES)
    assert all(p.same_as in BY_NAME for p in POLICIES if p.same_as)
    with pytest.raises(ValueError, match="unknown policy"):
        policy_named("fastest")


def test_pure_disaggregation_is_the_launchers() -> None:
    config = load_config(overrides=dict(BY_NAME["pure-disagg"].settings))
    assert config.gateway.local_prefill_max_tokens == 0
    assert config.gateway.prefill_saturated_tokens == 0


def _cpu_less(worker_id: str) -> Register:
    """A prefill worker as a simulated one registers: no CPUs."""
    return Register(worker_id, "i0", "prefill", "", FP, 16, 1000, "host", cpus=[], threads=1,
                    prefix_caching=True)


def test_prefill_pack_and_spread_pick_alike_for_workers_without_cpus() -> None:
    """Why `prefill-spread` is marked the same as `shipped` under the sim."""
    picks = []
    routings: tuple[Routing, ...] = ("pack", "spread")
    for routing in routings:
        registry = Registry(FP, 30.0, 0, 0)
        router = Router(registry, local=LocalPrefill(0, 0), packing=Packing("pack", routing))
        for n in range(3):
            registry.register(_cpu_less(f"p{n}"))
        for n, held in enumerate((700, 300, 300)):
            registry.workers[f"p{n}"].active["r"] = held
        picks.append([router.pick_prefill([n] * length).worker_id  # type: ignore[union-attr]
                      for n, length in enumerate((10, 500, 20, 2000))])
    assert picks[0] == picks[1]


def test_prompts_of_a_group_share_exactly_their_prefix() -> None:
    a = prompt_ids(TraceRequest(0, 300, 4, "g1", 200), 0)
    b = prompt_ids(TraceRequest(1, 250, 4, "g1", 200), 7)
    other = prompt_ids(TraceRequest(1, 300, 4, "g2", 200), 1)
    assert len(a) == 300 and len(b) == 250
    assert a[:200] == b[:200] and a[200] != b[200]
    assert a[:200] != other[:200]
    assert all(32 <= token <= 126 for token in a + b + other)
    assert prompt_ids(TraceRequest(0, 300, 4, "g1", 200), 0) == a  # deterministic


def test_prompts_without_a_shared_prefix_are_their_own() -> None:
    a = prompt_ids(TraceRequest(0, 50, 4, None), 0)
    b = prompt_ids(TraceRequest(0, 50, 4, "label-only"), 1)
    assert len(a) == len(b) == 50 and a[:4] != b[:4]
    whole = prompt_ids(TraceRequest(0, 40, 4, "g", 40), 3)  # all of it shared
    assert whole == prompt_ids(TraceRequest(0, 40, 4, "g", 40), 4)


def test_expected_text_is_the_sim_continuation_without_its_end_tokens() -> None:
    prompt = prompt_ids(TraceRequest(0, 64, 300, None), 0)
    tokens = continuation(prompt, 300, 20, ignore_eos=True)
    text = expected_text(prompt, 300, 20)
    assert len(text) == sum(t < 256 for t in tokens) < 300  # ends passed over, not shown
    assert text == bytes(t for t in tokens if t < 256).decode()


METRICS = """\
# HELP raging_disagg_decision_total Requests routed, by path
# TYPE raging_disagg_decision_total counter
raging_disagg_decision_total{path="disaggregated"} 30.0
raging_disagg_decision_total{path="local_cached"} 9.0
# HELP raging_kv_pulls_routed_total Prompts routed to pull
# TYPE raging_kv_pulls_routed_total counter
raging_kv_pulls_routed_total{holder_role="decode"} 2.0
raging_kv_pulls_routed_total{holder_role="prefill"} 1.0
"""


def test_route_counts_read_paths_and_pulls() -> None:
    assert route_counts(METRICS) == {"disaggregated": 30, "local_cached": 9,
                                     "pull_from_decode": 2, "pull_from_prefill": 1}


def _done(index: int, ttft: float, e2e: float, tokens: int = 11) -> RequestResult:
    return RequestResult(index, "trace", 0.0, 100, tokens, ttft_s=ttft, e2e_s=e2e,
                         chunk_times_s=(ttft,), prompt_tokens=100, output_tokens=tokens,
                         cached_tokens=50)


def _run() -> PolicyRun:
    request = TraceRequest(0, 100, 11, "g", 50)
    replayed = (
        Replayed(request, _done(0, 0.2, 1.2), 0.001, True),  # TPOT 0.1: met
        Replayed(request, _done(1, 0.3, 3.3), 0.002, True),  # TPOT 0.3: missed
        Replayed(request, _done(2, 0.2, 0.7), 0.001, False),  # met, but wrong text
        Replayed(request, RequestResult(3, "trace", 0.0, 100, 11, error="HTTP 429: busy"),
                 0.003, False),
    )
    return PolicyRun(BY_NAME["shipped"], ("--model", "sim"), replayed, 4.0,
                     {"disaggregated": 3, "local_cached": 1})


def test_the_report_of_a_policy() -> None:
    summary = summarize_run(_run(), Slo(0.5, 0.15))
    figures = summary.summary
    assert figures.slo_attainment == 0.5  # 2 of 4: the failure misses
    assert figures.goodput_requests_per_s == pytest.approx(2 / 4.0)
    assert figures.requests_per_s == pytest.approx(3 / 4.0)
    assert figures.failed == 1 and figures.errors == {"HTTP 429": 1}
    assert summary.wrong == 1  # a failed request is not counted as wrong
    assert summary.cached_prompt_share == 0.5
    assert figures.ttft_s.p50 == pytest.approx(0.2)
    assert 0 < summary.send_lag_p99_s < 0.003


def _plan(tmp_path: Path) -> ReplayPlan:
    trace = (TraceRequest(0, 100, 11, "g", 50),) * 4
    return ReplayPlan(str(tmp_path / "t.jsonl"), prepare_trace(trace, 200),
                      (BY_NAME["shipped"],), prefill=1, decode=2, time_scale=0.5,
                      slo=Slo(0.5, 0.15), extra=("--set", "decode.max_running=8"))


def test_plan_flags_launch_a_sim_cluster_with_the_policy() -> None:
    plan = _plan(Path("/tmp"))
    flags = plan.flags(BY_NAME["decode-spread"])
    assert flags[:6] == ("--model", "sim", "--prefill", "1", "--decode", "2")
    assert " ".join(flags).endswith("--set sim.time_scale=0.5 --set gateway.decode_routing="
                                    "spread --set decode.max_running=8")
    assert "sim.kv_bytes" not in " ".join(flags)


def test_written_results(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    text = write_results(plan, [_run()], tmp_path / "out")
    assert text == (tmp_path / "out" / "results.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `shipped`"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:3] == ["0.50", "50.0%"] and cells[-2:] == ["1", "1"]
    assert cells[-3] == "3 / 0 / 0 / 1 / 0"
    assert "(under the sim" not in text and "pack and spread" in text
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    (policy,) = document["policies"]
    assert policy["summary"]["wrong"] == 1 and len(policy["requests"]) == 4
    assert document["trace_shape"]["requests"] == 4
    assert (tmp_path / "out" / "policies.png").stat().st_size > 0


def test_markdown_marks_policies_that_route_alike_under_the_sim(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    plan = ReplayPlan(plan.trace_path, plan.prepared, (BY_NAME["prefill-spread"],))
    summary = summarize_run(_run(), plan.slo)
    assert "(under the sim: routes as `shipped`)" in markdown(plan, [summary])
    assert not math.isnan(as_json(plan, [_run()], [summary])["policies"][0]["duration_s"])
