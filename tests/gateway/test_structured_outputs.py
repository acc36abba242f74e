"""Structured outputs (gateway.structured_outputs): the grammar a request asks for, and the 400
for two ways of asking or for one the workers cannot compile."""

from __future__ import annotations

from typing import Any

import pytest

from core.messages import JSON_OBJECT, Grammar
from gateway.chat_request import parse_chat_request
from gateway.params import GenerationParams, generation_params
from tests.gateway.test_params import NEUTRAL
from tests.gateway.test_protocol import chat, raises_400

BAD_STRUCTURED: list[tuple[bytes, str]] = [
    (chat(response_format={"type": "yaml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(response_format={"type": "text", "json_schema": {"name": "s"}}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "pattern": "[a"}}}), "response_format"),
    (chat(response_format="text"), "response_format"),
    # one way of asking, and one the workers can compile
    (chat(guided_regex="(", guided_choice=["a"]), "guided_choice"),
    (chat(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice"),
    (chat(structured_outputs={"regex": "[a-z"}), "structured_outputs.regex"),
    (chat(structured_outputs={"grammar": "root ::= missing"}), "structured_outputs.grammar"),
    (chat(guided_json={"type": "bogus"}), "guided_json"),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (chat(structured_outputs={"structural_tag": {"x": 1}}), "structured_outputs.structural_tag"),
    (chat(guided_choice="yes"), "guided_choice"),
]


@pytest.mark.parametrize(("body", "param"), BAD_STRUCTURED)
def test_bad_structured_outputs_are_400(body: bytes, param: str) -> None:
    err = raises_400(lambda b: generation_params(parse_chat_request(b)), body)
    assert err.param == param
    assert param in err.message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, {}),
        ({"response_format": {"type": "json_object"}}, {"grammar": JSON_OBJECT}),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "description": "d", "strict": True,
            "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}},
         {"grammar": Grammar("json_schema",
                             '{"type": "object", "properties": {"b": {}, "a": {}}}')}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
         {"grammar": JSON_OBJECT}),
        ({"structured_outputs": {"json": {"type": "integer"}}},
         {"grammar": Grammar("json_schema", '{"type": "integer"}')}),
        ({"structured_outputs": {"json_object": True}}, {"grammar": JSON_OBJECT}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"grammar": Grammar("regex", "[a-z]+")}),
        ({"structured_outputs": {"choice": ["yes", 'a "b"']}},
         {"grammar": Grammar("ebnf", 'root ::= "yes" | "a \\"b\\""')}),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}},
         {"grammar": Grammar("ebnf", 'root ::= "x"')}),
        ({"guided_json": '{"type": "integer"}', "guided_decoding_backend": "xgrammar"},
         {"grammar": Grammar("json_schema", '{"type": "integer"}')}),
        ({"guided_regex": "[0-9]+"}, {"grammar": Grammar("regex", "[0-9]+")}),
        ({"guided_choice": ["a", "b"]}, {"grammar": Grammar("ebnf", 'root ::= "a" | "b"')}),
        ({"guided_grammar": 'root ::= "x"'}, {"grammar": Grammar("ebnf", 'root ::= "x"')}),
        ({"structured_outputs": {"grammar": 'start: "x" | "y"'}},  # Lark's, as vLLM takes it
         {"grammar": Grammar("lark", 'start: "x" | "y"')}),
    ],
)
def test_structured_outputs_become_the_grammar(fields: dict[str, Any],
                                               expected: dict[str, Any]) -> None:
    params = generation_params(parse_chat_request(chat(**fields)), NEUTRAL)
    assert params == GenerationParams(**{"default_max_tokens": NEUTRAL.max_tokens, **expected})
