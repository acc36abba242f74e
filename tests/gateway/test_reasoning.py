"""Thinking told apart from the answer, whole and streamed in any pieces."""

from __future__ import annotations

import pytest

from gateway.reasoning import ReasoningParser, Split, ThoughtSplitter, split_whole

CASES: list[tuple[ReasoningParser, str, Split]] = [
    ("qwen3", "<think>\nTwo and two.\n</think>\n\nFour.", Split("\nTwo and two.\n", "Four.")),
    ("qwen3", "Four.", Split("", "Four.")),  # thinking off: no marker
    ("qwen3", "  <think>a</think>b", Split("a", "b")),
    ("qwen3", "<thinking is fun", Split("", "<thinking is fun")),
    ("qwen3", "<think>cut off by max_tokens", Split("cut off by max_tokens", "")),
    ("deepseek_r1", "Two and two.\n</think>\n\nFour.", Split("Two and two.\n", "Four.")),
    ("deepseek_r1", "<think>x</think>y", Split("x", "y")),
    ("deepseek_r1", "no end", Split("no end", "")),
    ("deepseek_r1", "a</thi", Split("a</thi", "")),
    ("qwen3", "<think>a</think>b</think>c", Split("a", "b</think>c")),
    ("qwen3", "", Split("", "")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_a_whole_output_splits_at_the_end_of_thought(parser: ReasoningParser, text: str,
                                                     expected: Split) -> None:
    assert split_whole(parser, text) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_streamed_pieces_add_up_to_the_whole(parser: ReasoningParser, text: str,
                                             expected: Split, size: int) -> None:
    splitter, total = ThoughtSplitter(parser), Split()
    for start in range(0, len(text), size):
        piece = splitter.feed(text[start:start + size])
        assert "<think>" not in piece.reasoning + piece.content or "</think>c" in text
        total.extend(piece)
    total.extend(splitter.finish())
    assert total == expected


def test_reasoning_streams_as_it_comes_holding_back_only_a_maybe_marker() -> None:
    splitter = ThoughtSplitter("qwen3")
    assert splitter.feed("<thi") == Split()
    assert splitter.feed("nk>Let") == Split("Let")
    assert splitter.feed(" me</th") == Split(" me")
    assert splitter.feed("ink>\n") == Split()
    assert splitter.feed("\nYes") == Split("", "Yes")
