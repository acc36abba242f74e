"""N-gram guesses: the tokens that followed the latest earlier occurrence of the longest
suffix."""

from __future__ import annotations

import pytest

from decode.drafts import propose


@pytest.mark.parametrize(("tokens", "k", "guess"), [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # the suffix [1, 2] came before, at 0
    ([1, 2, 3, 4, 1, 2], 1, [3]),
    ([9, 2, 5, 8, 2, 6, 8, 2], 2, [6, 8]),  # [8, 2] at 3 (latest), not [2] at 1
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, [9, 2]),  # [1, 2, 3] beats the later [2, 3]
    ([5, 6, 7], 3, []),  # nothing came before
    ([7, 7], 3, [7]),  # overlapping: [7] at 0, one token after it
    ([1, 2, 1, 2], 0, []),
    ([1], 3, []),
    ([], 3, []),
])
def test_propose(tokens: list[int], k: int, guess: list[int]) -> None:
    assert propose(tokens, k, min_n=1) == guess


def test_the_suffix_length_is_bounded() -> None:
    tokens = [1, 2, 3, 9, 4, 3, 8, 1, 2, 3]
    assert propose(tokens, 1, max_n=3) == [9]  # [1, 2, 3]
    assert propose(tokens, 1, min_n=1, max_n=1) == [8]  # [3], latest at 5
    assert propose([1, 2, 8, 2], 1) == []  # by default 2 at least: [8, 2] never came before
    assert propose([1, 2, 8, 2], 1, min_n=1) == [8]


def test_a_long_sequence_is_searched_in_one_pass() -> None:
    tokens = [*range(50_000), 7, 8]
    assert propose(tokens, 3) == [9, 10, 11]
    assert propose([*range(50_000), 7], 3) == []
