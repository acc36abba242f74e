"""The guessing policy: step costs learned from steps, each sequence's allowance from its rate
of kept guesses and the step's size."""

from __future__ import annotations

import pytest

from decode.guessing import FIXED_IN_ROWS, Guessing, StepCosts, Tally


def costs_of(steps: dict[int, float], each: int = 5) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in steps.items():
        for _ in range(each):
            costs.observe(rows, seconds)
    return costs


def test_no_step_seen_no_line() -> None:
    assert StepCosts().line() is None
    assert Guessing(6).allowance(Tally(), 1) == 0


def test_the_line_through_steps_of_several_row_counts() -> None:
    fixed, per_row = costs_of({1: 0.0055, 3: 0.0069, 5: 0.0079, 7: 0.0095}).line() or (0, 0)
    assert per_row == pytest.approx(0.00065, rel=0.05)
    assert fixed == pytest.approx(0.0048, rel=0.05)


def test_one_row_count_seen_puts_the_fixed_part_at_some_rows() -> None:
    fixed, per_row = costs_of({2: 0.008}).line() or (0, 0)
    assert per_row == pytest.approx(0.008 / (2 + FIXED_IN_ROWS))
    assert fixed == pytest.approx(per_row * FIXED_IN_ROWS)


def test_a_row_count_follows_its_recent_steps() -> None:
    costs = costs_of({1: 0.010, 4: 0.013})
    for _ in range(60):
        costs.observe(4, 0.016)
    assert costs.seconds[4] == pytest.approx(0.016, rel=0.01)
    assert costs.steps[4] == 20  # a row count's weight is capped


def test_free_rows_guess_everything_and_costly_ones_nothing() -> None:
    policy = Guessing(6)
    policy.costs = costs_of({1: 0.005, 9: 0.005})  # a row costs nothing
    assert policy.allowance(Tally(), 1) == policy.allowance(Tally(), 64) == 6
    policy.costs = costs_of({1: 0.001, 9: 0.009})  # no fixed part: a row is all a step is
    assert policy.allowance(Tally(tries=10, kept=9), 1) == 0


@pytest.mark.parametrize(("running", "allowed"), [(1, 4), (2, 3), (8, 1), (64, 0)])
def test_more_sequences_running_fewer_guesses_pay(running: int, allowed: int) -> None:
    """fixed = 6 rows: the j-th guess pays while p**j >= running / (6 + running); with p
    0.65, 1 sequence: 0.65**4 = 0.18 >= 1/7 > 0.65**5; 8: 0.65 >= 8/14 > 0.65**2."""
    policy = Guessing(6)
    policy.costs = costs_of({1: 7.0, 2: 8.0})
    own = Tally(tries=1000, kept=650)
    assert policy.rate(own) == pytest.approx(0.65, abs=0.001)
    assert policy.allowance(own, running) == allowed


def test_a_rate_starts_hopeful_and_learns_from_the_sequence_and_the_worker() -> None:
    policy = Guessing(6)
    assert policy.rate(Tally()) == pytest.approx(0.75)
    own = Tally()
    policy.record(own, tries=4, kept=3)
    assert (own.tries, own.kept) == (4, 3)
    assert policy.rate(own) == pytest.approx((3 + 2 * 6 / 8) / (4 + 2))
    other = Tally()
    assert policy.rate(other) == pytest.approx(6 / 8)  # the worker's, with its own start


def test_a_sequence_that_stopped_guessing_drifts_back_to_the_workers_rate() -> None:
    policy = Guessing(6)
    policy.worker = Tally(tries=40, kept=36)
    own = Tally(tries=5, kept=0)
    before = policy.rate(own)
    for _ in range(20):
        policy.skip(own)
    assert before < 0.5 < policy.rate(own) == pytest.approx(39 / 44, abs=0.03)


def test_the_line_is_fitted_again_after_each_step() -> None:
    costs = costs_of({1: 0.005, 3: 0.007})
    before = costs.line()
    assert costs.line() is before  # asked again within the step: the same fit
    costs.observe(5, 0.020)
    after = costs.line()
    assert after is not None and before is not None and after[1] > before[1]
