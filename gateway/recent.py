"""Recent latency: TTFT and time per output token over the last minutes, in fixed time buckets.

Prometheus histograms (gateway/metrics.py) count since the start; the web page's cluster view
wants "how is it doing now", so the gateway also keeps per-bucket counts, sums and maxima over
a short rolling window (by default 10 s buckets over 5 minutes). Old buckets fall off as time
moves on; a bucket with no sample is simply absent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Bucket:
    """The samples of one series that fell into one time bucket."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def merge(self, other: Bucket) -> None:
        self.count += other.count
        self.total_s += other.total_s
        self.max_s = max(self.max_s, other.max_s)

    def summary(self) -> dict[str, Any]:
        """Count, mean and max in milliseconds (mean and max None without samples)."""
        mean = self.total_s / self.count * 1000 if self.count else None
        peak = self.max_s * 1000 if self.count else None
        return {"count": self.count, "mean_ms": _rounded(mean), "max_ms": _rounded(peak)}


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 2)


class RecentLatency:
    """TTFT and TPOT (time per output token after the first) over the last `window_s`."""

    SERIES = ("ttft", "tpot")

    def __init__(self, bucket_s: float = 10.0, window_s: float = 300.0,
                 clock: Callable[[], float] = time.time) -> None:
        assert 0 < bucket_s <= window_s
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.clock = clock
        self.buckets: dict[int, dict[str, Bucket]] = {}  # bucket number -> series -> samples

    def ttft(self, seconds: float) -> None:
        self._add("ttft", seconds)

    def tpot(self, seconds: float) -> None:
        self._add("tpot", seconds)

    def _add(self, series: str, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        number = self._number(self.clock())
        self.buckets.setdefault(number, {}).setdefault(series, Bucket()).add(seconds)
        self._forget(number)

    def _number(self, at: float) -> int:
        return math.floor(at / self.bucket_s)

    def _forget(self, newest: int) -> None:
        oldest = newest - self._kept() + 1
        for number in [n for n in self.buckets if n < oldest]:
            del self.buckets[number]

    def _kept(self) -> int:
        return max(1, round(self.window_s / self.bucket_s))

    def mean_s(self, series: str, last_s: float) -> float | None:
        """The mean of `series` over the buckets of the last `last_s` (None without samples)."""
        newest = self._number(self.clock())
        oldest = newest - max(1, round(last_s / self.bucket_s)) + 1
        total = Bucket()
        for number, buckets in self.buckets.items():
            if oldest <= number <= newest and series in buckets:
                total.merge(buckets[series])
        return total.total_s / total.count if total.count else None

    def snapshot(self) -> dict[str, Any]:
        """The window as JSON: its buckets, oldest first (each with its start time), and each
        series summed over the whole window."""
        self._forget(self._number(self.clock()))
        whole = {name: Bucket() for name in self.SERIES}
        rows = []
        for number in sorted(self.buckets):
            series = self.buckets[number]
            for name, bucket in series.items():
                whole[name].merge(bucket)
            rows.append({"start": number * self.bucket_s,
                         **{name: series.get(name, Bucket()).summary() for name in self.SERIES}})
        return {"bucket_s": self.bucket_s, "window_s": self.window_s, "buckets": rows,
                **{name: bucket.summary() for name, bucket in whole.items()}}
