"""`bench scale`'s parts that need no cluster: its settings, stream checks and summaries."""

from __future__ import annotations

import pytest

from bench.scale import _loaded_router, route_summary, sim_flags
from bench.sim_streams import SimRequest, StreamOutcome, sim_requests, summarize
from core.config import load_config
from engine.sim.tokens import EOS, continuation, text_of


def test_the_scale_settings_are_real_config_keys() -> None:
    flags = sim_flags("default", 2, 6, "sim.kv_bytes=0.25")
    settings: dict[str, object] = {}
    for flag in flags[flags.index("--set") + 1::2]:
        key, _, value = flag.partition("=")
        settings[key] = value
    config = load_config(None, settings)
    assert config.decode.max_running == 256 and config.sim.kv_bytes == 0.25
    assert flags[:2] == ["--model", "sim"] and sim_flags("x", 1, 1)[1] == "sim:x"


def test_a_stream_is_right_only_with_every_token_and_end_tokens_leave_no_text() -> None:
    requests = sim_requests(3, 40, seed=9, prompt_lens=(5, 9))
    assert len({r.prompt for r in requests}) == 3
    assert all(32 <= t < 127 for r in requests for t in r.prompt)
    right = requests[0].expected(4)
    tokens = continuation(requests[0].prompt, 40, 4, ignore_eos=True)
    assert EOS in tokens and right == text_of(tokens) and len(right) < 40
    outcomes = [StreamOutcome(right, 0.1, 1.0), StreamOutcome(right[:-1], 0.2, 1.0),
                StreamOutcome("", None, 5.0, "TimeoutError: late")]
    summary = summarize(requests[:1] * 3, outcomes, 2.0, 4)
    assert (summary.right, summary.wrong, summary.failed) == (1, 1, 1)
    assert summary.errors == {"TimeoutError": 1} and summary.output_tokens == 40
    assert SimRequest((65,), 3).body("m")["ignore_eos"] is True


def test_route_times_are_read_from_the_histogram() -> None:
    samples = {"raging_route_seconds_count": 100.0, "raging_route_seconds_sum": 0.004,
               'raging_route_seconds_bucket{le="5e-05"}': 90.0,
               'raging_route_seconds_bucket{le="0.0001"}': 99.0,
               'raging_route_seconds_bucket{le="+Inf"}': 100.0}
    summary = route_summary(samples)
    assert summary["decisions"] == 100 and summary["p99_at_most_us"] == 100.0
    assert summary["mean_us"] == pytest.approx(40.0)
    assert summary["decisions_per_cpu_s"] == pytest.approx(25_000)


def test_the_routing_scenario_routes_over_a_registry_as_heartbeats_left_it() -> None:
    router = _loaded_router(8, caching=True)
    registry = router.registry
    assert len(registry.serving("prefill")) == 2 and len(registry.serving("decode")) == 6
    route = router.route(list(range(40, 240)))
    assert route is not None and route.decode.role == "decode"
    assert route.path == "disaggregated" and route.prefill.role == "prefill"
