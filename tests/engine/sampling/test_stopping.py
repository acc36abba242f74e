"""When a sequence stops, and what min_tokens keeps it from drawing."""

from __future__ import annotations

import pytest

from core.messages import GenerationTask, Sampling
from engine.sampling.stopping import banned_tokens, finish_reason

EOS = (2, 3)


def task(min_tokens: int = 0, ignore_eos: bool = False, max_tokens: int = 10,
         prompt: list[int] | None = None, output_start: int | None = None) -> GenerationTask:
    return GenerationTask(prompt or [1, 1, 1], Sampling(), max_tokens, [7, 8], ignore_eos,
                          min_tokens=min_tokens, output_start=output_start)


def test_without_min_tokens_stop_tokens_and_eos_stop_at_once() -> None:
    assert banned_tokens(task(), 0, EOS) == ()
    assert [finish_reason(task(), t, 1, EOS) for t in (7, 8, 2, 3, 9)] == [
        "stop", "stop", "stop", "stop", None]


def test_ignore_eos_leaves_only_the_stop_tokens() -> None:
    assert finish_reason(task(ignore_eos=True), 2, 1, EOS) is None
    assert finish_reason(task(ignore_eos=True), 7, 1, EOS) == "stop"
    assert banned_tokens(task(min_tokens=2, ignore_eos=True), 0, EOS) == (7, 8)


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_bans_every_stop_token_until_reached(min_tokens: int) -> None:
    held = task(min_tokens=min_tokens)
    for generated in range(min_tokens):
        assert banned_tokens(held, generated, EOS) == (7, 8, 2, 3)
        assert finish_reason(held, 2, generated + 1, EOS) is None  # were it drawn anyway
    assert banned_tokens(held, min_tokens, EOS) == ()
    assert finish_reason(held, 2, min_tokens + 1, EOS) == "stop"


def test_length_still_ends_a_sequence_under_min_tokens() -> None:
    assert finish_reason(task(min_tokens=10, max_tokens=3), 7, 3, EOS) == "length"


def test_a_resumed_request_counts_the_output_its_client_has() -> None:
    """Resumed with 2 output tokens in its prompt: its first new token is the third."""
    resumed = task(min_tokens=3, prompt=[1, 1, 1, 5, 6], output_start=3)
    assert (resumed.prompt_len, resumed.output_before) == (3, 2)
    assert banned_tokens(resumed, 0, EOS) == (7, 8, 2, 3)
    assert banned_tokens(resumed, 1, EOS) == ()
    assert finish_reason(resumed, 7, 1, EOS) is None
    assert finish_reason(resumed, 7, 2, EOS) == "stop"


@pytest.mark.parametrize(("min_tokens", "output_start"), [(-1, None), (0, -1), (0, 4)])
def test_bad_tasks_are_value_errors(min_tokens: int, output_start: int | None) -> None:
    with pytest.raises(ValueError):
        task(min_tokens=min_tokens, output_start=output_start)
