"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix.

Code models (Qwen2.5-Coder, CodeGemma, StarCoder, DeepSeek-Coder, CodeLlama) learned a layout
in which special tokens mark the text before a gap, the text after it, and where the middle
starts; the model writes the middle and ends it. `fill_tokens` finds a model's markers in its
vocabulary (None: the model never learned to fill); `fill_prompt` lays out the prompt for
OpenAI's and Ollama's `suffix` and llama.cpp's `/infill`, with other files of the project
before it: as a repository, where the model learned one (its file separator token), else as
plain text. Markers written in the code itself stay text: only the layout's are special.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Each family's markers: (before the prefix, before the suffix, before the middle).
_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),  # Refact
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # noqa: RUF001 (DeepSeek-Coder's bars)
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
)
_REPOSITORY = ("<|repo_name|>", "<repo_name>")
_FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>", "<|file_separator|>", "<fim-sep>")
# Tokens that end a middle besides the model's end of text: padding, CodeLlama's end of
# infill; and the separators above, which would start another file.
_ENDINGS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "▁<EOT>")
REPOSITORY_NAME = "project"  # the repository a project's files are shown in
CURRENT_FILE = "filename"  # the path of the file with the gap, which no API names
MAX_FILES = 256


@dataclass(frozen=True, slots=True)
class FillTokens:
    """A model's fill-in-the-middle markers (token ids)."""

    prefix: int
    suffix: int
    middle: int
    file_separator: int | None  # starts each file of a repository: its path, a newline, text
    repository: int | None  # starts the repository's name, before its files
    endings: tuple[int, ...]  # stop a middle (the model's end of text stops it anyway)
    start: tuple[int, ...]  # what the tokenizer puts before any text (BOS), or nothing
    names: tuple[str, ...]  # of every token above: in the code, they are text


@dataclass(frozen=True, slots=True)
class Gap:
    """What to fill: the text before and after the gap, and other files of the project as
    (path, text)."""

    prefix: str
    suffix: str
    files: tuple[tuple[str, str], ...] = ()


def fill_tokens(tokenizer: PreTrainedTokenizerBase) -> FillTokens | None:
    """The model's markers, or None when its vocabulary has no complete set."""
    vocabulary = tokenizer.get_vocab()
    found = [markers for markers in _MARKERS if all(name in vocabulary for name in markers)]
    if not found:
        return None
    prefix, suffix, middle = (vocabulary[name] for name in found[0])
    separator = _first_of(_FILE_SEPARATORS, vocabulary)
    others = [name for name in (*_ENDINGS, *_FILE_SEPARATORS, *_REPOSITORY)
              if name in vocabulary]
    return FillTokens(prefix, suffix, middle, separator,
                      _first_of(_REPOSITORY, vocabulary) if separator is not None else None,
                      tuple(vocabulary[name] for name in others), _start_tokens(tokenizer),
                      (*found[0], *others))


def fill_prompt(tokenizer: PreTrainedTokenizerBase, fill: FillTokens, gap: Gap,
                room: int | None = None) -> list[int]:
    """The prompt's token ids. `room`: the most it may take, met by leaving out the other
    files (the first given first), then the prefix's start and the suffix's end (the prefix
    keeps at least three quarters of what is left); None: all of it, however long."""
    encode = _encoder(tokenizer, fill.names)
    prefix, suffix = encode(gap.prefix), encode(gap.suffix)
    files = [_file(encode, fill, path, text) for path, text in gap.files]
    opening, closing = _repository_frame(encode, fill)
    if room is not None:
        room -= len(fill.start) + 3
        while files and len(opening) + len(closing) + sum(map(len, files)) + len(prefix) \
                + len(suffix) > room:
            files.pop(0)
        if files:
            room -= len(opening) + len(closing) + sum(map(len, files))
        prefix, suffix = _cut(prefix, suffix, room)
    if not files:
        opening, closing = [], []
    context = [token for file in files for token in file]
    return [*fill.start, *opening, *context, *closing, fill.prefix, *prefix, fill.suffix,
            *suffix, fill.middle]


def _first_of(names: Sequence[str], vocabulary: dict[str, int]) -> int | None:
    return next((vocabulary[name] for name in names if name in vocabulary), None)


def _start_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The special tokens the tokenizer puts before a text (a Llama's BOS), as llama.cpp
    starts an infill prompt with them."""
    marked = list(tokenizer.encode("a"))
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    lead = len(marked) - len(plain)
    return tuple(marked[:lead]) if lead > 0 and marked[lead:] == plain else ()


def _encoder(tokenizer: PreTrainedTokenizerBase, names: Sequence[str]
             ) -> Callable[[str], list[int]]:
    """Token ids of a text in which special tokens, and the layout's tokens (which a model may
    ship as plain added tokens: Qwen2.5-Coder's are), are text: each of the latter is cut in
    two, and its halves encoded apart, so that it never becomes its token."""
    layout = re.compile("|".join(map(re.escape, names)))

    def encode(text: str) -> list[int]:
        cuts = [0, *(found.start() + len(found.group()) // 2 for found in layout.finditer(text)),
                len(text)]
        return [token for start, end in pairwise(cuts) if end > start
                for token in tokenizer.encode(text[start:end], add_special_tokens=False,
                                              split_special_tokens=True)]
    return encode


def _file(encode: Callable[[str], list[int]], fill: FillTokens, path: str,
          text: str) -> list[int]:
    """One other file: under the model's file separator, else under a plain-text header."""
    text = text if text.endswith("\n") else text + "\n"
    if fill.file_separator is None:
        return encode(f"--- {path} ---\n{text}\n")
    return [fill.file_separator, *encode(f"{path}\n{text}")]


def _repository_frame(encode: Callable[[str], list[int]], fill: FillTokens
                      ) -> tuple[list[int], list[int]]:
    """What goes around other files where the model learned repositories: before them, the
    repository's name (if it learned one); after them, the current file's separator and path,
    which its prefix follows."""
    if fill.file_separator is None:
        return [], []
    name = [fill.repository, *encode(f"{REPOSITORY_NAME}\n")] if fill.repository else []
    return name, [fill.file_separator, *encode(f"{CURRENT_FILE}\n")]


def _cut(prefix: list[int], suffix: list[int], room: int) -> tuple[list[int], list[int]]:
    """The prefix's end and the suffix's start within `room` tokens in all."""
    if len(prefix) + len(suffix) <= room:
        return prefix, suffix
    room = max(room, 0)
    prefix_room = min(len(prefix), room - min(len(suffix), room // 4))
    suffix_room = room - prefix_room
    return prefix[len(prefix) - prefix_room:], suffix[:suffix_room]
