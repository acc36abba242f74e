"""Tool-call parsers: a model's output text, fed as it streams, split into plain text and calls.

Each parser is fed text deltas and returns `Piece`s as soon as they are certain: plain text
(a `str`) or a `CallPiece`, the first piece of a call carrying its name. Text that might be the
start of a call is held back until it is clearly not; `finish` settles what is left (a call
that does not parse, or names a function the request did not offer, is returned as the text
it was). Formats:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text
  (Hermes, Qwen, and the fallback prompt of gateway/tools.py ask for it);
- `llama3_json`: the whole output one or more `{"name": ..., "parameters": {...}}` objects
  (`;`-separated), optionally after `<|python_tag|>`, as Llama 3.1+ writes them;
- `RequiredParser` / `NamedParser`: what the grammar of `tool_choice` "required" / a named
  function forces (a JSON array of calls / the arguments object itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from core.config import ToolCallParser as ParserName  # "": none, `auto` answers in text


@dataclass(frozen=True)
class CallPiece:
    """Part of a call's arguments (JSON text); `name` is set on a call's first piece only."""

    arguments: str
    name: str | None = None


Piece = str | CallPiece


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def parse_call(data: object, arguments_key: str = "arguments") -> CallPiece | None:
    """`{"name": str, arguments_key: object}` as a whole call; None when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return CallPiece(json.dumps(arguments, ensure_ascii=False), data["name"])


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    """Calls inside `<tool_call>...</tool_call>`; the text around them stays text."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, offered: frozenset[str] | None = None) -> None:
        self.buffer = ""
        self.inside = False
        self.offered = offered  # the functions a call may name (None: any)

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Settle what the buffer allows; True while more may follow at once."""
        if self.inside:
            end = self.buffer.find(self.CLOSE)
            if end < 0:
                return False
            pieces.append(self._call(self.buffer[:end], closed=True))
            self.buffer, self.inside = self.buffer[end + len(self.CLOSE):], False
            return True
        start = self.buffer.find(self.OPEN)
        if start < 0:
            keep = _held_back(self.buffer, self.OPEN)
            _append_text(pieces, self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        _append_text(pieces, self.buffer[:start])
        self.buffer, self.inside = self.buffer[start + len(self.OPEN):], True
        return True

    def _call(self, body: str, closed: bool) -> Piece:
        try:
            call = parse_call(json.loads(body))
        except ValueError:
            call = None
        if call is not None and _offered(call, self.offered):
            return call
        return self.OPEN + body + (self.CLOSE if closed else "")

    def finish(self) -> list[Piece]:
        """A call left open at the end (the model stopped before its closing tag) still counts
        when its body parses."""
        pieces: list[Piece] = []
        if self.inside:
            pieces.append(self._call(self.buffer, closed=False))
        else:
            _append_text(pieces, self.buffer)
        self.buffer, self.inside = "", False
        return pieces


class Llama3JsonParser:
    """An output that is JSON call objects (after an optional `<|python_tag|>`) is calls; any
    other output is text, streamed as soon as its first characters rule a call out."""

    TAG = "<|python_tag|>"

    def __init__(self, offered: frozenset[str] | None = None) -> None:
        self.buffer = ""
        self.verdict: Literal["undecided", "text", "calls"] = "undecided"
        self.offered = offered  # the functions a call may name (None: any)

    def feed(self, text: str) -> list[Piece]:
        if self.verdict == "text":
            return [text] if text else []
        self.buffer += text
        if self.verdict == "undecided":
            self.verdict = self._judge(self.buffer.lstrip())
        if self.verdict == "text":
            text, self.buffer = self.buffer, ""
            return [text]
        return []

    def _judge(self, start: str) -> Literal["undecided", "text", "calls"]:
        if start.startswith(("{", self.TAG)):
            return "calls"
        if not start or self.TAG.startswith(start):
            return "undecided"
        return "text"

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        calls = self._calls(text) if self.verdict != "text" else None
        if calls is not None:
            return list(calls)
        return [text] if text else []

    def _calls(self, text: str) -> list[CallPiece] | None:
        """Every call in `text`, or None unless all of it is calls."""
        rest = text.strip().removeprefix(self.TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[CallPiece] = []
        while rest:
            try:
                data, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            call = parse_call(data, "parameters")
            if call is None or not _offered(call, self.offered):
                return None
            calls.append(call)
            rest = rest[end:].strip().removeprefix(";").strip()
        return calls or None


class RequiredParser:
    """`tool_choice: required`: the grammar forces a JSON array of `{"name", "arguments"}`
    objects, parsed once whole. An output cut short by max_tokens keeps the calls it completed
    (a model may repeat its call until the limit); one with none stays text."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        return []

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        calls = _leading_calls(text)
        if calls:
            return list(calls)
        return [text] if text else []


def _leading_calls(text: str) -> list[CallPiece]:
    """The whole calls a JSON array of calls begins with, as far as it goes; none when an
    element is not a call."""
    decoder = json.JSONDecoder()
    rest = text.lstrip()
    if not rest.startswith("["):
        return []
    calls: list[CallPiece] = []
    rest = rest[1:].lstrip()
    while rest and not rest.startswith("]"):
        try:
            data: Any
            data, end = decoder.raw_decode(rest)
        except ValueError:
            return calls  # cut in the middle of an element
        call = parse_call(data)
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(",").lstrip()
    return calls


class NamedParser:
    """A named `tool_choice`: the grammar forces the arguments object itself, streamed as the
    arguments of one call of that function."""

    def __init__(self, name: str) -> None:
        self.name: str | None = name  # until the call's first piece is out

    def feed(self, text: str) -> list[Piece]:
        if not text:
            return []
        piece = CallPiece(text, self.name)
        self.name = None
        return [piece]

    def finish(self) -> list[Piece]:
        return [CallPiece("{}", self.name)] if self.name is not None else []


def _offered(call: CallPiece, offered: frozenset[str] | None) -> bool:
    return offered is None or call.name in offered


def _append_text(pieces: list[Piece], text: str) -> None:
    if text:
        pieces.append(text)


def auto_parser(name: ParserName, offered: frozenset[str]) -> ToolCallParser | None:
    """The configured parser for `tool_choice: auto`, finding calls of the `offered`
    functions only (a call of any other, which a small model may make up, stays text); None
    when none is configured."""
    if name == "hermes":
        return HermesParser(offered)
    if name == "llama3_json":
        return Llama3JsonParser(offered)
    return None
