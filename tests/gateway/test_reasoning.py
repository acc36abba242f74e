"""Thinking told apart from the answer, whole and streamed in any pieces."""

from __future__ import annotations

import pytest

from gateway.reasoning import Split, ThoughtSplitter, opens_in_thought

# (whether the output opens in thought, the output, how it splits)
CASES: list[tuple[bool, str, Split]] = [
    (False, "<think>\nTwo and two.\n</think>\n\nFour.", Split("\nTwo and two.\n", "Four.")),
    (False, "Four.", Split("", "Four.")),  # thinking off: no marker
    (False, "  <think>a</think>b", Split("a", "b")),
    (False, "<thinking is fun", Split("", "<thinking is fun")),
    (False, "<think>cut off by max_tokens", Split("cut off by max_tokens", "")),
    (True, "Two and two.\n</think>\n\nFour.", Split("Two and two.\n", "Four.")),
    (True, "<think>x</think>y", Split("x", "y")),
    (True, "no end", Split("no end", "")),
    (True, "a</thi", Split("a</thi", "")),
    (False, "<think>a</think>b</think>c", Split("a", "b</think>c")),
    (False, "", Split("", "")),
]


def split_whole(in_thought: bool, text: str) -> Split:
    splitter = ThoughtSplitter(in_thought)
    split = splitter.feed(text)
    split.extend(splitter.finish())
    return split


@pytest.mark.parametrize(("in_thought", "text", "expected"), CASES)
def test_a_whole_output_splits_at_the_end_of_thought(in_thought: bool, text: str,
                                                     expected: Split) -> None:
    assert split_whole(in_thought, text) == expected


@pytest.mark.parametrize(("in_thought", "text", "expected"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_streamed_pieces_add_up_to_the_whole(in_thought: bool, text: str,
                                             expected: Split, size: int) -> None:
    splitter, total = ThoughtSplitter(in_thought), Split()
    for start in range(0, len(text), size):
        piece = splitter.feed(text[start:start + size])
        assert "<think>" not in piece.reasoning + piece.content or "</think>c" in text
        total.extend(piece)
    total.extend(splitter.finish())
    assert total == expected


def test_reasoning_streams_as_it_comes_holding_back_only_a_maybe_marker() -> None:
    splitter = ThoughtSplitter(in_thought=False)
    assert splitter.feed("<thi") == Split()
    assert splitter.feed("nk>Let") == Split("Let")
    assert splitter.feed(" me</th") == Split(" me")
    assert splitter.feed("ink>\n") == Split()
    assert splitter.feed("\nYes") == Split("", "Yes")


def test_an_output_opens_in_thought_where_the_prompt_left_think_open() -> None:
    assert opens_in_thought("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not opens_in_thought("qwen3", "<|im_start|>assistant\n")
    assert opens_in_thought("deepseek_r1", "<|Assistant|>")
    assert split_whole(False, '{"a": 1}') == Split("", '{"a": 1}')


@pytest.mark.parametrize(("in_thought", "text", "chars"), [
    (False, "<think>ab</think>\n\nc", 17),  # through the end marker
    (True, "ab</think>c", 10),
    (True, "no end", 6),  # a thought never closed is all of it
    (False, "<think>cut", 10),
    (False, "c", 0),
])
def test_the_thought_s_characters_are_counted(in_thought: bool, text: str, chars: int) -> None:
    """What the reasoning tokens in a reply's usage are counted from."""
    splitter = ThoughtSplitter(in_thought)
    for char in text:
        splitter.feed(char)
    splitter.finish()
    assert splitter.reasoning_chars == chars
