"""Structured outputs: what a request's `response_format`, vLLM's `structured_outputs` or its
older `guided_*` fields ask the output to match, as the `Grammar` the workers constrain it by;
a 400 for two ways of asking at once, or for a grammar the workers could not compile
(`grammar_problem`: xgrammar's own verdict).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from core.messages import JSON_OBJECT, Grammar, GrammarKind
from gateway.errors import bad_request
from gateway.validation import RequestModel, invalid_value, none_only

_MAX_SCHEMA_ERROR_CHARS = 300
_GRAMMAR_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object",
                  "regex": "regular expression", "ebnf": "EBNF grammar", "lark": "Lark grammar"}
# "[17:40:21] /path/file.cc:94: " and "Check failed: (error.empty()) is false: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+: (Check failed: .*? is false: )?")


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the JSON schema the output must match."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any object
    strict: bool | None = None  # ignored: the output always matches the schema here


class ResponseFormat(RequestModel):
    """`response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid_value("json_schema is required with type 'json_schema', and only then")
        grammar = self.grammar
        problem = grammar_problem(grammar) if grammar is not None else None
        if problem is not None:
            raise PydanticCustomError("invalid_value", "invalid JSON schema: {problem}",
                                      {"problem": problem})
        return self

    @property
    def grammar(self) -> Grammar | None:
        """What the output must match for this format (None: anything)."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            return JSON_OBJECT
        return Grammar("json_schema", json.dumps(self.json_schema.schema_))


def schema_or_text(value: object) -> object:
    """A JSON schema as vLLM takes it: an object, or its text. Not a union type: pydantic would
    name the union's members in the error location."""
    if value is None or isinstance(value, dict | str):
        return value
    raise invalid_value("must be a JSON schema: an object, or its text")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a regular
    expression, a choice of strings, or an EBNF grammar (its start rule `root`)."""

    json_: Any = Field(default=None, alias="json")  # a schema, or its text (see schema_or_text)
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    structural_tag: Any = None
    # Ignored: how vLLM's own backends read the grammar.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    _not_here = field_validator("structural_tag")(none_only)
    _a_schema = field_validator("json_")(schema_or_text)

    def grammars(self) -> dict[str, Grammar | None]:
        """What each of its fields asks for, by the field's name in the request."""
        return {"structured_outputs.json": json_grammar(self.json_),
                "structured_outputs.json_object": JSON_OBJECT if self.json_object else None,
                "structured_outputs.regex": text_grammar("regex", self.regex),
                "structured_outputs.choice": choice_grammar(self.choice),
                "structured_outputs.grammar": rules_grammar(self.grammar)}


def json_grammar(schema: dict[str, Any] | str | None) -> Grammar | None:
    """The grammar of a JSON schema, or of its text (None: nothing asked)."""
    if schema is None:
        return None
    return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def text_grammar(kind: GrammarKind, text: str | None) -> Grammar | None:
    """A grammar of `kind` written as `text` (None: nothing asked)."""
    return None if text is None else Grammar(kind, text)


def rules_grammar(text: str | None) -> Grammar | None:
    """A grammar's rules: EBNF (`root ::= ...`), or Lark's (`start: ...`), as vLLM tells them
    apart."""
    if text is None:
        return None
    return Grammar("ebnf" if "::=" in text else "lark", text)


def choice_grammar(choices: list[str] | None) -> Grammar | None:
    """An EBNF grammar of exactly one of `choices`."""
    if choices is None:
        return None
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return Grammar("ebnf", f"root ::= {alternatives}")


def one_grammar(given: dict[str, Grammar | None]) -> Grammar | None:
    """The one grammar of those `given` (by the field asking for it); a 400 naming the field
    for two, or for one the workers cannot compile."""
    asked = [name for name, grammar in given.items() if grammar is not None]
    if len(asked) > 1:
        raise bad_request(f"Ask for one structured output, not {' and '.join(asked)}.",
                          param=asked[1])
    if not asked:
        return None
    grammar = given[asked[0]]
    assert grammar is not None
    problem = grammar_problem(grammar)
    if problem is not None:
        raise bad_request(f"Invalid '{asked[0]}': invalid {_GRAMMAR_NAMES[grammar.kind]}: "
                          f"{problem}", param=asked[0])
    return grammar


@functools.lru_cache(maxsize=256)
def grammar_problem(grammar: Grammar) -> str | None:
    """Why the workers could not compile `grammar`; None when they can."""
    # Imported here: xgrammar loads torch, which the gateway otherwise never needs.
    from engine.sampling.grammar import parsed

    if grammar.kind == "json_object":
        return None
    try:
        parsed(grammar)
    except RuntimeError as exc:  # xgrammar's error for a bad or unsupported grammar
        return _XGRAMMAR_PREFIX.sub("", str(exc).strip())[:_MAX_SCHEMA_ERROR_CHARS]
    return None

