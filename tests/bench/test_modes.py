"""The layouts compared and their unloaded probes: the requests and the cut-off."""

from __future__ import annotations

import pytest

from bench.modes import MODES, PROBE_OUTPUT, probe_specs, request_timeout
from bench.prompts import TextPrompts
from bench.stats import Slo
from bench.workloads import RequestSpec


def test_probes_warm_up_with_the_shortest_then_take_each_length() -> None:
    probes = probe_specs(TextPrompts(), (64, 512))
    assert [(p.input_len, p.output_len) for p in probes] == [(64, PROBE_OUTPUT),
                                                             (64, PROBE_OUTPUT),
                                                             (512, PROBE_OUTPUT)]
    assert len({p.prompt for p in probes}) == 3  # numbered apart: no prefix cache carry-over


def test_request_timeout_covers_twice_the_slowest_request_in_slo() -> None:
    specs = [RequestSpec(0, "chat", "a", 100, 64), RequestSpec(1, "long", "b", 3000, 16)]
    slo = Slo(1.0, 0.2, ((0, 1.0), (100, 2.0)))  # 1 s + 10 ms per prompt token
    assert request_timeout(slo, specs) == pytest.approx(2 * (1.0 + 0.01 * 3000 + 0.2 * 64))
    assert request_timeout(Slo(0.01, 0.001), specs) == 30.0  # never below 30 s


def test_every_layout_has_both_pools_or_colocated_workers() -> None:
    for flags in MODES.values():
        assert ("--colocated" in flags) != ("--prefill" in flags and "--decode" in flags)
