"""The tool-call parsers, fed whole and split at every character boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tool_parsers import (
    CallPiece,
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    Piece,
    RequiredParser,
    ToolCallParser,
    auto_parser,
    parse_call,
)

Call = tuple[str, dict[str, Any]]  # a call's name and arguments
Calls = list[Call]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
WEATHER_CALL: Call = ("get_weather", {"city": "Paris", "unit": "c"})
TIME_CALL: Call = ("get_time", {})


def settle(pieces: list[Piece]) -> tuple[str, Calls]:
    """The text and the calls (arguments pieces joined and parsed) of a run's pieces."""
    text = ""
    calls: list[tuple[str, str]] = []
    for piece in pieces:
        if isinstance(piece, str):
            text += piece
        elif piece.name is not None:
            calls.append((piece.name, piece.arguments))
        else:
            calls[-1] = (calls[-1][0], calls[-1][1] + piece.arguments)
    return text, [(name, json.loads(arguments)) for name, arguments in calls]


def run(parser: ToolCallParser, chunks: list[str]) -> tuple[str, Calls]:
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    return settle(pieces + parser.finish())


def splits(text: str) -> list[list[str]]:
    """`text` whole, in two parts at every boundary, and one character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


HERMES_CASES: list[tuple[str, str, Calls]] = [
    ("The weather is fine.", "The weather is fine.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [WEATHER_CALL]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.\n", [WEATHER_CALL]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "get_time", "arguments": {}}</tool_call>', "\n", [WEATHER_CALL, TIME_CALL]),
    (f"<tool_call>\n{WEATHER}\n", "", [WEATHER_CALL]),  # stopped before the closing tag
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("<tool_call>{\"name\": 3}", "<tool_call>{\"name\": 3}", []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", [TIME_CALL]),
    ("<tool_call>{\"name\": \"get_time\"}</tool_call>", "", [TIME_CALL]),
    # a function the request did not offer: the call stays text, the offered one is a call
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call> then '
     f"<tool_call>{WEATHER}</tool_call>",
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call> then ', [WEATHER_CALL]),
]
OFFERED = frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize(("output", "text", "calls"), HERMES_CASES)
def test_hermes_finds_the_same_calls_however_the_output_is_split(
        output: str, text: str, calls: Calls) -> None:
    for chunks in splits(output):
        assert run(HermesParser(OFFERED), chunks) == (text, calls), chunks


def test_hermes_streams_text_at_once_and_holds_back_only_a_possible_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" world <tool") == [" world "]
    assert parser.feed("box>") == ["<toolbox>"]
    assert parser.feed("<tool_call>{\"name\"") == []
    assert parser.feed(': "get_time", "arguments": {}}</tool_call>') == [
        CallPiece("{}", "get_time")]


LLAMA_CASES: list[tuple[str, str, Calls]] = [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
     [WEATHER_CALL]),
    ('  <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "get_time", "parameters": {}}', "", [WEATHER_CALL, TIME_CALL]),
    (WEATHER, "", [WEATHER_CALL]),  # "arguments" where "parameters" is expected
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_time", "parameters": {}} and more', '{"name": "get_time", '
     '"parameters": {}} and more', []),
    ("<|python_ta", "<|python_ta", []),
    ("<|pytho and text", "<|pytho and text", []),
    ("{cut sho", "{cut sho", []),
    ('{"name": "get_time", "parameters": {}}; {"name": "launch", "parameters": {}}',
     '{"name": "get_time", "parameters": {}}; {"name": "launch", "parameters": {}}', []),
]


@pytest.mark.parametrize(("output", "text", "calls"), LLAMA_CASES)
def test_llama3_json_finds_the_same_calls_however_the_output_is_split(
        output: str, text: str, calls: Calls) -> None:
    for chunks in splits(output):
        assert run(Llama3JsonParser(OFFERED), chunks) == (text, calls), chunks


def test_llama3_json_streams_text_once_a_call_is_ruled_out() -> None:
    parser = Llama3JsonParser()
    assert parser.feed("  ") == []
    assert parser.feed("<|py") == []
    assert parser.feed("x") == ["  <|pyx"]
    assert parser.feed(" more") == [" more"]


REQUIRED_CASES: list[tuple[str, str, Calls]] = [
    (f"[{WEATHER}]", "", [WEATHER_CALL]),
    (f'[{WEATHER}, {{"name": "get_time", "arguments": {{}}}}]', "", [WEATHER_CALL, TIME_CALL]),
    (f"[{WEATHER[:20]}", f"[{WEATHER[:20]}", []),  # cut short by max_tokens
    # cut short in a repeated call: the whole calls before it are kept
    (f"[{WEATHER}, {WEATHER}, {WEATHER[:20]}", "", [WEATHER_CALL, WEATHER_CALL]),
    (f"[ {WEATHER} ,", "", [WEATHER_CALL]),
    (f'[{WEATHER}, {{"city": "Paris"}}, {WEATHER[:9]}', f'[{WEATHER}, {{"city": "Paris"}}, '
     f"{WEATHER[:9]}", []),  # an element that is no call: all text
    ("[]", "[]", []),
]


@pytest.mark.parametrize(("output", "text", "calls"), REQUIRED_CASES)
def test_required_parses_the_forced_array(output: str, text: str, calls: Calls) -> None:
    for chunks in splits(output):
        assert run(RequiredParser(), chunks) == (text, calls)


def test_named_streams_the_arguments_of_one_call() -> None:
    arguments = '{"city": "Paris", "unit": "c"}'
    for chunks in splits(arguments):
        assert run(NamedParser("get_weather"), chunks) == ("", [WEATHER_CALL])
    parser = NamedParser("get_weather")
    assert parser.feed('{"ci') == [CallPiece('{"ci', "get_weather")]
    assert parser.feed('ty": 1}') == [CallPiece('ty": 1}')]


def test_named_with_no_output_is_a_call_without_arguments() -> None:
    assert run(NamedParser("get_time"), []) == ("", [TIME_CALL])


@pytest.mark.parametrize(("data", "key", "expected"), [
    ({"name": "f", "arguments": {"a": 1}}, "arguments", CallPiece('{"a": 1}', "f")),
    ({"name": "f", "parameters": {"é": "ü"}}, "parameters", CallPiece('{"é": "ü"}', "f")),
    ({"name": "f", "arguments": '{"a": 1}'}, "arguments", CallPiece('{"a": 1}', "f")),
    ({"name": "f", "arguments": "not json"}, "arguments", None),
    ({"name": "f", "arguments": [1]}, "arguments", None),
    ({"arguments": {}}, "arguments", None),
    (["f"], "arguments", None),
])
def test_parse_call(data: object, key: str, expected: CallPiece | None) -> None:
    assert parse_call(data, key) == expected


@pytest.mark.parametrize(("name", "kind"), [("hermes", HermesParser),
                                            ("llama3_json", Llama3JsonParser)])
def test_auto_parser_by_name(name: str, kind: type) -> None:
    made = auto_parser(name, OFFERED)  # type: ignore[arg-type]  # a name from config
    assert isinstance(made, kind)
    assert auto_parser("", OFFERED) is None
