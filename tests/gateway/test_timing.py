"""A request's latency breakdown at the gateway (gateway/timing.py)."""

from __future__ import annotations

import pytest

from core.messages import STAGES, StageTime
from gateway.timing import RequestTiming, asks_for_timing


def test_the_breakdown_names_every_stage_in_milliseconds_none_where_not_reached() -> None:
    timing = RequestTiming(arrived=100.0)
    assert timing.breakdown(now=100.5) == {
        **{f"{stage}_ms": None for stage in STAGES}, "ttft_ms": None, "e2e_ms": 500.0,
        "resumed": 0}
    timing.dispatch(100.002)
    timing.record([StageTime("prefill_wait", 0.001), StageTime("prefill_compute", 0.0205)])
    timing.first_token = 100.03
    shown = timing.breakdown(now=101.0)
    assert shown["gateway_queue_ms"] == 2.0 and shown["prefill_wait_ms"] == 1.0
    assert shown["prefill_compute_ms"] == 20.5 and shown["ttft_ms"] == 30.0
    assert shown["kv_transfer_ms"] is None and shown["first_decode_ms"] is None
    assert shown["e2e_ms"] == 1000.0


def test_a_later_report_of_a_stage_replaces_the_earlier_one() -> None:
    """A resumed request: its latest epoch's stages."""
    timing = RequestTiming(arrived=0.0)
    timing.record([StageTime("prefill_compute", 0.5)])
    timing.record([StageTime("prefill_compute", 0.25)])
    assert timing.stages == {"prefill_compute": 0.25}


def test_the_gateway_queue_is_measured_at_the_first_dispatch_only() -> None:
    timing = RequestTiming(arrived=1.0)
    timing.dispatch(1.5)
    assert timing.stages == {"gateway_queue": 0.5}
    with pytest.raises(AssertionError):
        timing.dispatch(2.0)


@pytest.mark.parametrize(("header", "in_body", "asked"), [
    (None, False, False), ("true", False, True), ("TRUE ", False, True), ("1", False, True),
    ("false", False, False), ("no", False, False), ("", True, True), (None, True, True),
])
def test_timing_is_asked_for_by_header_or_body(header: str | None, in_body: bool,
                                               asked: bool) -> None:
    assert asks_for_timing(header, in_body) is asked
