"""The stages a worker reports, from its own stamps."""

from __future__ import annotations

from core.messages import StageTime
from core.timeline import Timeline


def test_a_prompt_prefilled_here_reports_its_wait_and_compute_once_its_token_is_drawn() -> None:
    timeline = Timeline(arrived=10.0)
    assert timeline.prefill_stages() == []  # not started
    timeline.start(10.25)
    timeline.start(11.0)  # a later chunk: the first one's start counts
    assert timeline.prefill_stages() == []  # not computed yet
    timeline.computed = 11.75
    assert timeline.prefill_stages() == [StageTime("prefill_wait", 0.25),
                                         StageTime("prefill_compute", 1.5)]


def test_kv_from_a_prefill_worker_reports_its_transfer_and_the_first_decode_step() -> None:
    timeline = Timeline(first_kv=5.0, kv_ready=5.125)
    assert timeline.decode_stages() == []  # no decode token yet
    timeline.first_decoded = 5.625
    assert timeline.decode_stages() == [StageTime("kv_transfer", 0.125),
                                        StageTime("first_decode", 0.5)]
    assert timeline.prefill_stages() == []  # its prompt was computed elsewhere


def test_kv_computed_here_has_no_transfer_stage() -> None:
    timeline = Timeline(arrived=1.0, started=1.0, computed=2.0, kv_ready=2.0, first_decoded=2.5)
    assert [s.stage for s in timeline.prefill_stages()] == ["prefill_wait", "prefill_compute"]
    assert timeline.decode_stages() == [StageTime("first_decode", 0.5)]


def test_stamps_never_make_a_negative_stage() -> None:
    """A stamp taken out of order (one stage folded into the next) makes 0, not a value the
    messages would refuse."""
    timeline = Timeline(arrived=2.0, started=1.0, computed=1.5, first_kv=3.0, kv_ready=2.5,
                        first_decoded=2.0)
    assert all(s.seconds == 0.0 for s in timeline.decode_stages())
    assert timeline.prefill_stages()[0] == StageTime("prefill_wait", 0.0)
