"""CPU lists from config, pinning a real process, and reading its pinning back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.cpus import parse_cpus, pin_to, pinned_cpus, running_on


@pytest.mark.parametrize(("spec", "cpus"), [
    ("", set()), ("0", {0}), ("1-3", {1, 2, 3}), ("0,2-3", {0, 2, 3}), (" 4 , 1 ", {1, 4}),
])
def test_parse(spec: str, cpus: set[int]) -> None:
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-2", "1;2", "0-x"])
def test_parse_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpus(spec)


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
