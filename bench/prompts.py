"""Synthetic prompts of a requested length: exact token ids with a tokenizer, else approximate text.

Every prompt starts with its own request number, so no two share a prefix (a prefix cache on the
server would otherwise turn repeated prompts into free prefills), and continues with plain
English filler.
"""

from __future__ import annotations

from itertools import cycle, islice
from pathlib import Path
from typing import Protocol

FILLER = (
    "The history of computing is a story of people who wanted machines to do arithmetic faster "
    "than any clerk could, and then found that the same machines could do much more. Rivers carve "
    "valleys over thousands of years, carrying silt from the mountains to the sea, where it "
    "settles into deltas that farmers have worked since the first harvests. A good recipe lists "
    "what to buy, how long each step takes, and what the dish should look like when it is done. "
    "Trains leave the station on time when the signals, the crews and the timetable agree, and "
    "a single late connection can ripple through a whole network before noon. "
)
# Measured on the SmolLM2 tokenizer for FILLER: about 1.1 tokens per word.
TOKENS_PER_WORD = 1.1


class PromptMaker(Protocol):
    """Makes the prompts of a workload and counts the tokens of given text."""

    def prompt(self, index: int, length: int) -> str | tuple[int, ...]:
        """A prompt of `length` tokens (exact or approximate), distinct for each `index`."""
        ...

    def count(self, text: str) -> int | None:
        """Tokens in `text`, or None when no tokenizer is at hand."""
        ...


class TokenPrompts:
    """Exact-length prompts as token ids, from a Hugging Face tokenizer folder."""

    def __init__(self, tokenizer_dir: Path | str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self._filler = self._encode(FILLER)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, index: int, length: int) -> tuple[int, ...]:
        """Exactly `length` token ids: the request header, then filler as long as needed."""
        header = self._encode(f"Request {index}. ")
        return tuple(islice(header + list(islice(cycle(self._filler), length)), length))

    def count(self, text: str) -> int:
        """Tokens in `text` as the tokenizer splits it."""
        return len(self._encode(text))


class TextPrompts:
    """Text prompts of roughly the requested length, for a server whose tokenizer is unknown."""

    def prompt(self, index: int, length: int) -> str:
        """About `length` tokens of text (the server's usage reports the exact count)."""
        words = max(1, round(length / TOKENS_PER_WORD) - 2)
        return " ".join([f"Request {index}.", *islice(cycle(FILLER.split()), words)])

    def count(self, text: str) -> int | None:
        """Unknown without a tokenizer."""
        return None
