"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`).

Qwen3, QwQ and DeepSeek-R1 write their thinking between `<think>` and `</think>`, then the
answer. With `gateway.reasoning_parser` set, each chat choice's output goes through a
`ThoughtSplitter`: what comes before `</think>` is reasoning (chat's `reasoning` and
`reasoning_content`, Anthropic's thinking blocks, the Responses API's reasoning items), what
follows is the content (and tool calls). An output opens in thought (`opens_in_thought`) when
the prompt left `<think>` open (Qwen3's thinking models and DeepSeek-R1's templates end with
it) or, with `deepseek_r1`, always; any output also does that starts with `<think>`. A thought
never closed (cut by max_tokens) is all reasoning.

A grammar (structured output, a forced tool call) waits out the thought (`thinking`: the
workers apply it from `</think>` on, engine/sampling/thought.py), unless
`gateway.grammar_in_reasoning` has it constrain the whole output: then only an output that
writes `<think>` itself thinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.config import ReasoningParser
from core.messages import Thinking

THINK_START, THINK_END = "<think>", "</think>"
State = Literal["opening", "thinking", "answering"]


@dataclass
class Split:
    """Some output, as reasoning and content."""

    reasoning: str = ""
    content: str = ""

    def extend(self, other: Split) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ThoughtSplitter:
    """One choice's output as reasoning and content, as it streams: text that may be the start
    of a marker is held back until the next text says what it is."""

    def __init__(self, in_thought: bool) -> None:
        """`in_thought`: the output opens in thought without a `<think>` of its own."""
        self.unmarked: State = "thinking" if in_thought else "answering"
        self.state: State = "opening"
        self.buffer = ""
        self.after_thought = False  # the white space right after `</think>` is dropped
        self.fed = 0  # characters of output fed so far
        self.thought_chars = 0  # of those, how many the closed thought took, markers and all

    @property
    def reasoning_chars(self) -> int:
        """How many characters of the output so far are its thought's."""
        thinking = self.state == "thinking" or (self.state == "opening"
                                                and self.unmarked == "thinking")
        return self.fed if thinking else self.thought_chars

    def feed(self, text: str) -> Split:
        self.buffer += text
        self.fed += len(text)
        split = Split()
        while self.buffer and self._step(split):
            pass
        return split

    def finish(self) -> Split:
        """The rest: held-back text is what the state makes it."""
        text, self.buffer = self.buffer, ""
        if self.state == "opening":
            self.state = self.unmarked
        return Split(reasoning=text) if self.state == "thinking" else Split(content=text)

    def _step(self, split: Split) -> bool:
        """Move what the buffer says for sure into `split`; whether to look again."""
        if self.state == "opening":
            return self._open()
        if self.state == "thinking":
            return self._think(split)
        if self.after_thought:
            self.buffer = self.buffer.lstrip()  # as the workers' grammar sees the answer
            self.after_thought = not self.buffer
        split.content += self.buffer
        self.buffer = ""
        return False

    def _open(self) -> bool:
        start = self.buffer.lstrip()
        if start.startswith(THINK_START):
            self.state, self.buffer = "thinking", start[len(THINK_START):]
            return True
        if THINK_START.startswith(start):  # may yet be the marker
            return False
        self.state = self.unmarked
        return True

    def _think(self, split: Split) -> bool:
        end = self.buffer.find(THINK_END)
        if end >= 0:
            split.reasoning += self.buffer[:end]
            self.buffer = self.buffer[end + len(THINK_END):]
            self.thought_chars = self.fed - len(self.buffer)
            self.state, self.after_thought = "answering", True
            return True
        kept = _marker_prefix(self.buffer, THINK_END)
        split.reasoning += self.buffer[:len(self.buffer) - kept]
        self.buffer = self.buffer[len(self.buffer) - kept:]
        return False


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def opens_in_thought(parser: ReasoningParser, prompt_end: str) -> bool:
    """Whether an output opens in thought, where `parser` is set: the prompt (whose text
    ends in `prompt_end`) left `<think>` open, or the parser says every output does."""
    assert parser, "only a reasoning parser splits thought from answer"
    return parser == "deepseek_r1" or prompt_end.rstrip().endswith(THINK_START)


def thinking(in_thought: bool) -> Thinking:
    """The thought a grammar waits out, for the workers."""
    return Thinking(THINK_START, THINK_END, opened=in_thought)
