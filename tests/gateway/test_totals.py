"""Worker counts kept monotonic across restarts and departures (gateway.totals)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.totals import WorkerTotals


def test_a_restarted_worker_adds_its_new_count_to_the_old_total() -> None:
    totals = WorkerTotals()
    totals.report("decode-0", "a", 3)
    totals.report("decode-0", "a", 7)
    totals.report("decode-0", "b", 0)  # restarted: its own count is 0 again
    assert totals.by_worker() == {"decode-0": 7}
    totals.report("decode-0", "b", 2)
    assert totals.by_worker() == {"decode-0": 9}
    assert totals.total() == 9


def test_a_count_that_goes_down_under_the_same_instance_counts_as_a_restart() -> None:
    totals = WorkerTotals()
    totals.report("decode-0", "a", 5)
    totals.report("decode-0", "a", 1)
    assert totals.by_worker() == {"decode-0": 6}


def test_workers_are_counted_apart_and_a_repeated_report_adds_nothing() -> None:
    totals = WorkerTotals()
    for _ in range(3):
        totals.report("decode-0", "a", 4)
        totals.report("decode-1", "c", 1)
    assert totals.by_worker() == {"decode-0": 4, "decode-1": 1}
    assert totals.total() == 5


@given(st.lists(st.tuples(st.sampled_from(["w0", "w1"]), st.booleans(),
                          st.integers(0, 5)), max_size=40))
def test_totals_never_decrease_and_end_at_the_sum_of_every_run(
        steps: list[tuple[str, bool, int]]) -> None:
    """Each step: a worker either restarts (a new instance, count from 0) or counts more."""
    totals = WorkerTotals()
    runs: dict[str, list[int]] = {}  # per worker, each instance's own count
    before: dict[str, float] = {}
    for worker, restart, more in steps:
        if restart or worker not in runs:
            runs.setdefault(worker, []).append(0)
        runs[worker][-1] += more
        totals.report(worker, f"{worker}-{len(runs[worker])}", runs[worker][-1])
        now = totals.by_worker()
        assert all(now[w] >= count for w, count in before.items())
        before = now
    assert totals.by_worker() == {w: sum(counts) for w, counts in runs.items()}
