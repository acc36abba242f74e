"""A decode worker's pulls, as bookkeeping: what a pull that came or fell back counts, and the
measured pace of its prompt computation that values the time a pull saved."""

from __future__ import annotations

import pytest

from core.messages import DecodeRequest, GenerationTask, Sampling
from decode.pulls import Pace, Pulls
from decode.scheduler import DecodeSequence


def sequence(request_id: str) -> DecodeSequence:
    task = GenerationTask(list(range(100)), Sampling(), 8, [], True)
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"), list(range(100)), 0)


def test_the_pace_ignores_steps_with_few_prompt_tokens_and_leans_to_the_newest() -> None:
    pace = Pace()
    pace.observe(8, 1.0)  # a decode step with a short prompt chunk: says little
    assert pace.s_per_token == 0.0
    pace.observe(100, 0.1)
    assert pace.s_per_token == pytest.approx(1e-3)
    pace.observe(100, 0.2)
    assert pace.s_per_token == pytest.approx(0.8e-3 + 0.2 * 2e-3)


def test_a_pull_that_came_counts_its_tokens_bytes_time_and_saving() -> None:
    pulls = Pulls()
    pulls.pace.observe(1000, 1.0)  # 1 ms a token here
    first = sequence("r")
    pulls.start([first], now=10.0)
    pull = pulls.take(first.key)
    assert pull is not None and pull.choices == [first] and pulls.take(first.key) is None
    pulls.received(pull, tokens=400, nbytes=18_432_000, now=10.05)
    totals = pulls.totals
    assert (totals.pulls, totals.fallbacks, totals.tokens, totals.bytes) == (1, 0, 400, 18_432_000)
    assert totals.seconds == pytest.approx(0.05) and totals.saved_s == pytest.approx(0.35)
    pulls.fell_back()
    assert pulls.totals.fallbacks == 1 and pulls.totals.pulls == 1
