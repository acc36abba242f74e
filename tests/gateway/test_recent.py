"""Recent latency: per-bucket counts, means and maxima that fall off after the window."""

from __future__ import annotations

from gateway.recent import RecentLatency


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_samples_land_in_their_bucket_and_sum_over_the_window() -> None:
    clock = Clock(1000.0)
    recent = RecentLatency(10, 60, clock)
    recent.ttft(0.1)
    recent.ttft(0.3)
    clock.now = 1015.0
    recent.tpot(0.02)
    recent.ttft(0.2)
    view = recent.snapshot()
    assert [b["start"] for b in view["buckets"]] == [1000.0, 1010.0]
    assert view["buckets"][0]["ttft"] == {"count": 2, "mean_ms": 200.0, "max_ms": 300.0}
    assert view["buckets"][0]["tpot"] == {"count": 0, "mean_ms": None, "max_ms": None}
    assert view["buckets"][1]["tpot"] == {"count": 1, "mean_ms": 20.0, "max_ms": 20.0}
    assert view["ttft"] == {"count": 3, "mean_ms": 200.0, "max_ms": 300.0}


def test_old_buckets_fall_off_even_without_new_samples() -> None:
    clock = Clock(1000.0)
    recent = RecentLatency(10, 60, clock)
    recent.ttft(1.0)
    clock.now = 1055.0
    assert recent.snapshot()["ttft"]["count"] == 1  # bucket 1000 is the oldest of six kept
    clock.now = 1060.0
    view = recent.snapshot()
    assert view["buckets"] == [] and view["ttft"]["count"] == 0
    assert recent.buckets == {}


def test_nonsense_samples_are_ignored() -> None:
    recent = RecentLatency()
    for bad in (float("nan"), float("inf"), -1.0):
        recent.tpot(bad)
    assert recent.snapshot()["tpot"]["count"] == 0
