"""CPU lists from config, pinning a real process, and reading its pinning back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.cpus import format_cpus, parse_cpus, pin_to, pinned_cpus, running_on, share_out


@pytest.mark.parametrize(("spec", "cpus"), [
    ("", set()), ("0", {0}), ("1-3", {1, 2, 3}), ("0,2-3", {0, 2, 3}), (" 4 , 1 ", {1, 4}),
])
def test_parse(spec: str, cpus: set[int]) -> None:
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-2", "1;2", "0-x"])
def test_parse_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpus(spec)


@pytest.mark.parametrize(("cpus", "spec"), [
    ([0], "0"), ([0, 1, 2, 5], "0-2,5"), ([7, 3, 4], "3-4,7"), ([1, 3, 5], "1,3,5"),
])
def test_format_names_runs_as_ranges(cpus: list[int], spec: str) -> None:
    assert format_cpus(cpus) == spec
    assert parse_cpus(spec) == set(cpus)


@pytest.mark.parametrize(("pool", "count", "shares"), [
    ([0, 1], 1, [[0, 1]]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([4, 5, 6, 7, 8, 9, 10, 11], 3, [[4, 5], [6, 7, 8], [9, 10, 11]]),
    ([0, 1], 2, [[0], [1]]),
    ([2, 3], 5, [[2], [3], [2], [3], [2]]),
])
def test_share_out_leaves_no_cpu_idle(pool: list[int], count: int,
                                      shares: list[list[int]]) -> None:
    assert share_out(pool, count) == shares
    assert sorted({cpu for share in shares for cpu in share}) == pool


def test_share_out_from_the_command_line() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "core.cpus", *args],
                              capture_output=True, text=True, check=False)
    assert run("share-out", "0-3,8-9", "4").stdout.split() == ["0", "1-2", "3", "8-9"]
    assert run("share-out", "0-1", "0").returncode == 2
    refused = run("share-out", "0-x", "2")
    assert refused.returncode == 2 and "CPU" in refused.stderr


def test_pin_to_sets_the_affinity_of_this_process() -> None:
    first = min(os.sched_getaffinity(0))
    code = (f"from core.cpus import pin_to; import os; pin_to('{first}'); "
            "print(os.sched_getaffinity(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str({first})


def test_pin_to_refuses_cpus_that_do_not_exist() -> None:
    with pytest.raises(ValueError, match="not available"):
        pin_to("100000")


def test_pinned_cpus_are_those_this_process_may_run_on() -> None:
    assert pinned_cpus() == sorted(os.sched_getaffinity(0))
    first = min(os.sched_getaffinity(0))
    code = (f"from core.cpus import pin_to, pinned_cpus; pin_to('{first}'); "
            "print(pinned_cpus())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([first])


def test_running_on_gives_the_cpus_back() -> None:
    before = os.sched_getaffinity(0)
    first = min(before)
    with running_on(str(first)):
        assert os.sched_getaffinity(0) == {first}
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), running_on(str(first)):
        raise RuntimeError("the block fails")
    assert os.sched_getaffinity(0) == before
