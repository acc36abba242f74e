"""A reasoning model's thought, which a grammar waits out: the grammar (structured output, a
forced tool call) constrains the answer, not the thinking before it, as vLLM does with a
reasoning parser.

Where the prompt left the thought open, the output is free until it writes the end marker
(`</think>`), over as many tokens as it likes. Elsewhere the output may open one with its
first token, where a token holds the whole start marker (Qwen3's `<think>`); a model whose
vocabulary has no such token does not think, and is held to its grammar from its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from core.messages import Thinking

Stage = Literal["opening", "thinking", "answering"]


def opening(token_bytes: Sequence[bytes], marker: bytes, vocab_size: int) -> torch.Tensor:
    """A bool mask `[vocab]` of the tokens that begin with the whole `marker`."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[[token_id for token_id, token in enumerate(token_bytes[:vocab_size])
          if token.startswith(marker)]] = True
    return mask


class ThoughtGate:
    """Where one output stands against its thought: OPENING (it may yet open one), THINKING
    (free until the end marker) or ANSWERING (held to the grammar)."""

    def __init__(self, thinking: Thinking, token_bytes: Sequence[bytes],
                 openers: Callable[[bytes], torch.Tensor]) -> None:
        """`openers`: the tokens that begin with a start marker (`opening`)."""
        self.start, self.end = thinking.start.encode(), thinking.end.encode()
        self.stage: Stage = "thinking" if thinking.opened else "opening"
        self.token_bytes = token_bytes
        self.openers = openers
        self.tail = b""  # the thought's last bytes, which may begin the end marker
        self.answer_begun = b""  # what the token that ended the thought wrote after the marker

    @property
    def answering(self) -> bool:
        return self.stage == "answering"

    def allowed(self, grammar_allows: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The tokens allowed next (None: any), given what the grammar allows."""
        if self.stage == "thinking":
            return None
        if self.stage == "opening":
            return grammar_allows() | self.openers(self.start)
        return grammar_allows()

    def take(self, token_id: int) -> bool:
        """Whether the token is the thought's (the grammar does not see it, though it sees
        `answer_begun`)."""
        token = bytes(self.token_bytes[token_id]) if token_id < len(self.token_bytes) else b""
        if self.stage == "opening":
            if not token.startswith(self.start):
                self.stage = "answering"
                return False
            self.stage = "thinking"
            token = token[len(self.start):]
        if self.stage == "thinking":
            self._think(token)
            return True
        return False

    def _think(self, token: bytes) -> None:
        seen = self.tail + token
        if self.end in seen:
            self.stage, self.tail = "answering", b""
            self.answer_begun = seen[seen.index(self.end) + len(self.end):].lstrip()
        else:
            self.tail = seen[max(0, len(seen) - len(self.end) + 1):]
