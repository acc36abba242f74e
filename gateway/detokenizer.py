"""Streaming text out of generated tokens: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas without ever splitting a multi-byte
character, decoding only a short sliding window per token. `StopStringMatcher` sits after it and
holds back text that may turn out to be the start of a stop string, so that nothing at or past a
stop string is ever streamed. `LineLimiter` ends code completion where llama.cpp's editors ask:
at a line indented less than the cursor, or a while after the first new line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.weights.tokenizer import decode_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so the first tokens keep their leading-space
# handling (SentencePiece-style decoders strip a leading space from a standalone decode).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one generated sequence, one token at a time.

    Keeps vLLM's prefix/read offsets: `_ids[:_read]` is text already emitted, of which
    `_ids[_prefix:_read]` is decoded again as context; each `add` decodes only that window plus
    the tokens not yet emitted, so its cost does not grow with the output length.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = [int(token) for token in prompt_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)
        if self._decode(self._prefix, self._read).endswith(REPLACEMENT_CHAR):
            # A prompt cut mid-character would absorb the output's first bytes into the context.
            self._ids, self._read = [], 0

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is partial)."""
        self._ids.append(int(token_id))
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return text[len(emitted) :]

    def flush(self) -> str:
        """Return whatever text is still held back; an unfinished character becomes U+FFFD."""
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._advance()
        return text[len(emitted) :]

    def _advance(self) -> None:
        # The tokens just emitted become the next context window; older ones are dropped.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return decode_text(self._tokenizer, self._ids[start:end], self._skip_special_tokens)


def text_offsets(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> list[int]:
    """Where each token's text starts in the text the tokens decode to, in characters: the
    tokens of one character split across them (an emoji's bytes) all start where it does."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    offsets, chars = [], 0
    for token_id in token_ids:
        offsets.append(chars)
        chars += len(detokenizer.add(token_id))
    return offsets


class StopStringMatcher:
    """Cuts a text stream before the first stop string, holding back possible stop prefixes.

    When several stop strings occur, the one that is complete first in the stream wins (on a
    tie, the longer one), which makes the result independent of how the text is chunked.
    `include_stop` keeps that stop string in the text (vLLM's include_stop_str_in_output);
    `hit` names it.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = stops
        self._include_stop = include_stop
        self._pending = ""
        self._stopped = False
        self.hit: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return the text now safe to emit and whether a stop string was hit."""
        if self._stopped:
            return "", True
        pending = self._pending + text
        found = _first_stop(pending, self._stops)
        if found is not None:
            start, self.hit = found
            self._stopped, self._pending = True, ""
            end = start + len(self.hit) if self._include_stop else start
            return pending[:end], True
        safe = len(pending) - _held_length(pending, self._stops)
        self._pending = pending[safe:]
        return pending[:safe], False

    def flush(self) -> str:
        """At the end of generation, release the held text (nothing after a stop hit)."""
        text, self._pending = self._pending, ""
        return "" if self._stopped else text


@dataclass(frozen=True, slots=True)
class LineLimits:
    """llama.cpp's limits on a code completion: `min_indent` (its `n_indent`) ends the text
    before the first line, after a new line, that starts less indented (a blank one too);
    `after_s` (its `t_max_predict_ms`) ends it once it holds a new line and that many seconds
    have passed since its first text."""

    min_indent: int = 0
    after_s: float | None = None

    def __bool__(self) -> bool:
        return self.min_indent > 0 or self.after_s is not None


NO_LINE_LIMITS = LineLimits()


class LineLimiter:
    """Applies `LineLimits` to a text stream, fed in order."""

    def __init__(self, limits: LineLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.started: float | None = None
        self.new_line = False  # the text has one
        self.indenting = False  # after a new line, before its first other character
        self.indent = 0

    def feed(self, text: str) -> int | None:
        """How much of `text` to keep where a limit ends the output here; None: all, and go
        on."""
        self.started = self.clock() if self.started is None else self.started
        for index, char in enumerate(text):
            if self.indenting and char in " \t":
                self.indent += 1
            elif self.indenting and self.indent < self.limits.min_indent:
                return index
            else:
                self.indenting = False
            if char == "\n":
                self.new_line = self.indenting = True
                self.indent = 0
        after = self.limits.after_s
        if after is not None and self.new_line and self.clock() - self.started > after:
            return len(text)
        return None


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Start of the stop-string occurrence in `text` that ends first, and that stop; or None."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _held_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a prefix of some stop string."""
    return max((_prefix_overlap(text, stop) for stop in stops), default=0)


def _prefix_overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    pos = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while pos != -1:
        if stop.startswith(text[pos:]):
            return len(text) - pos
        pos = text.find(stop[0], pos + 1)
    return 0
