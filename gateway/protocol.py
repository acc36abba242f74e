"""The OpenAI request schema for /v1/chat/completions and /v1/completions.

Request bodies are parsed into pydantic models (`parse_chat_request`, `parse_completion_request`),
any malformed body becoming a 400 `APIError`, then reduced to the internal, frozen
`GenerationParams`, the fields a request leaves out taken from the `GenerationDefaults`.
Duplicate keys are refused; fields outside the schema are kept aside for gateway/ignored_fields.py
(ignored, or refused in strict mode); every field the official OpenAI client sends is known:
used, accepted and ignored (hints with no effect here), or refused as "not supported yet" unless
it asks for nothing (null, empty, the default). vLLM's cheap extensions (min_p, bad_words,
allowed_token_ids, skip_special_tokens, chat template options, ...) are implemented. Prompts
become token ids in gateway/prompts.py.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.config import GenerationDefaults
from core.messages import JSON_OBJECT, MAX_LOGPROBS, Grammar, GrammarKind
from gateway.errors import APIError, bad_request
from gateway.tools import tool_plan

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary here; the body limit bounds it too
MAX_LOGIT_BIAS = 1024  # biased tokens per request: each travels with every message of it
MAX_CHOICES = 16  # n: the most choices one request may ask for
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # chat's top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI allows
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
_INT32_MAX = 2**31 - 1
_MAX_NAME_CHARS = 64  # of a client-chosen field name quoted back in an error
_MAX_SCHEMA_ERROR_CHARS = 300
_GRAMMAR_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object",
                  "regex": "regular expression", "ebnf": "EBNF grammar", "lark": "Lark grammar"}
# "[17:40:21] /path/file.cc:94: " and "Check failed: (error.empty()) is false: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+: (Check failed: .*? is false: )?")
TEXT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})
# Content parts this text-only model cannot read, by type: what the 400 calls them.
UNREADABLE_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
                    "video_url": "video", "video": "video", "file": "file", "input_file": "file"}
# apply_chat_template's own arguments: set by the request's fields, never by chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

Role = Literal["system", "user", "assistant", "tool", "developer", "function"]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]


def invalid_value(message: str) -> PydanticCustomError:
    # PydanticCustomError formats its template with str.format-style fields: no braces in messages.
    return PydanticCustomError("invalid_value", message)


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{what} is not supported yet")


def none_only(value: object, info: ValidationInfo) -> object:
    """For a feature that is missing: only null (asking for nothing) is accepted."""
    if value is not None:
        raise _unsupported(str(info.field_name))
    return value


def one_choice(value: int | None) -> int | None:
    """For an API whose reply has one output: `n` may only be 1."""
    if value not in (None, 1):
        raise invalid_value("n must be 1: this API's reply has one output")
    return value


def _unreserved(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: template variables, none of apply_chat_template's own arguments."""
    reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise PydanticCustomError(
            "invalid_value", "'{name}' is set by the request's own fields, not here",
            {"name": reserved[0]})
    return value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RequestModel(BaseModel):
    # strict: no "1" -> 1 or true -> 1 coercions. allow: a field outside the schema is kept in
    # model_extra, for gateway/ignored_fields.py to ignore (logged, counted) or refuse (strict
    # mode); OpenAI client fields that do not apply are declared and ignored.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(RequestModel):
    """`stream_options`: whether the last streamed chunk carries token usage."""

    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # ignored: chunks are never padded
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too


class RagingOptions(RequestModel):
    """`raging`: this server's own options (docs/api.md)."""

    timing: bool | None = False  # the response carries the request's latency breakdown


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


def _schema(value: object) -> object:
    """A JSON schema as vLLM takes it: an object, or its text. Not a union type: pydantic would
    name the union's members in the error location."""
    if value is None or isinstance(value, dict | str):
        return value
    raise invalid_value("must be a JSON schema: an object, or its text")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a regular
    expression, a choice of strings, or an EBNF grammar (its start rule `root`)."""

    json_: Any = Field(default=None, alias="json")  # a schema, or its text (see _schema)
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
    _a_schema = field_validator("json_")(_schema)

    def grammars(self) -> dict[str, Grammar | None]:
        """What each of its fields asks for, by the field's name in the request."""
        return {"structured_outputs.json": _json_grammar(self.json_),
                "structured_outputs.json_object": JSON_OBJECT if self.json_object else None,
                "structured_outputs.regex": _text_grammar("regex", self.regex),
                "structured_outputs.choice": _choice_grammar(self.choice),
                "structured_outputs.grammar": _rules(self.grammar)}


def _json_grammar(schema: dict[str, Any] | str | None) -> Grammar | None:
    if schema is None:
        return None
    return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _text_grammar(kind: GrammarKind, text: str | None) -> Grammar | None:
    return None if text is None else Grammar(kind, text)


def _rules(text: str | None) -> Grammar | None:
    """A grammar's rules: EBNF (`root ::= ...`), or Lark's (`start: ...`), as vLLM tells them
    apart."""
    if text is None:
        return None
    return Grammar("ebnf" if "::=" in text else "lark", text)


def _choice_grammar(choices: list[str] | None) -> Grammar | None:
    """An EBNF grammar of exactly one of `choices`."""
    if choices is None:
        return None
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return Grammar("ebnf", f"root ::= {alternatives}")


def _one_grammar(given: dict[str, Grammar | None]) -> Grammar | None:
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


class FunctionDefinition(RequestModel):
    """A function the model may call: `tools[i].function`, or a legacy `functions[i]`."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # ignored: a forced call always matches the schema here


class Tool(RequestModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(RequestModel):
    """`tool_choice` forcing a call of one function."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestModel):
    """An earlier call: `tool_calls[i].function`, or a legacy assistant `function_call`."""

    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestModel):
    """One entry of an earlier assistant message's `tool_calls`."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    """One chat message; list-of-parts content is normalized to a string (parts joined by \\n).
    An assistant message that calls tools may have null or no content; a legacy "function"
    message is a tool result."""

    role: Role
    name: str | None = None
    refusal: str | None = None  # ignored: an earlier assistant refusal, already in `content`
    # An earlier assistant turn's thinking (gateway/reasoning.py), for a template that shows it
    # again; `reasoning` is vLLM's name for it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: Any = None
    content: str | None = Field(default=None, validate_default=True)

    _no_audio = field_validator("audio")(none_only)
    _unknown_parts: tuple[str, ...] = PrivateAttr(default=())  # as `content[1].cache_control`

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown_part_fields(cls, data: object,
                                  handler: ValidatorFunctionWrapHandler) -> ChatMessage:
        message = handler(data)
        assert isinstance(message, ChatMessage)
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):  # valid, else the handler raised: each a text part
            message._unknown_parts = tuple(
                f"content[{i}].{name[:_MAX_NAME_CHARS]}"
                for i, part in enumerate(parts) for name in part if name not in TEXT_PART_FIELDS)
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: object, info: ValidationInfo) -> object:
        if value is None:
            calls = info.data.get("tool_calls") or info.data.get("function_call")
            if info.data.get("role") == "assistant" and calls:
                return None
            raise invalid_value("content must be a string or a list of text parts")
        return joined_text(value)

    @model_validator(mode="after")
    def _tool_fields_with_their_role(self) -> ChatMessage:
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise invalid_value("only assistant messages may carry tool_calls or function_call")
        if self.role == "tool" and self.tool_call_id is None:
            raise invalid_value("a tool message needs the tool_call_id it answers")
        if self.role == "function" and self.name is None:
            raise invalid_value("a function message needs the name of the function")
        return self

    @property
    def text(self) -> str:
        return self.content or ""


CHAT_TEXT_PARTS = {"text": "text"}  # a content part's type -> the field holding its text


def joined_text(value: object, kinds: Mapping[str, str] = CHAT_TEXT_PARTS) -> object:
    """Content parts (`part_text`) as one string, joined by \\n; anything else as it is, for
    pydantic to judge."""
    if isinstance(value, list):
        return "\n".join(part_text(index, part, kinds) for index, part in enumerate(value))
    return value


def only_tools_of_type(allowed: str, what: str) -> Callable[[object], object]:
    """A `tools` entry's before-validator refusing other types of tool (hosted ones), `what`
    naming the ones served."""
    def check(value: object) -> object:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != allowed:
            raise PydanticCustomError("unsupported", "tools of type '{kind}' are not supported "
                                      "here: only {what}", {"kind": kind[:64], "what": what})
        return value

    return check


def part_text(index: int, part: object, kinds: Mapping[str, str] = CHAT_TEXT_PARTS) -> str:
    """A text part's text, `kinds` naming the part types read and the field each keeps its
    text in; image, audio, video and file parts are refused as unreadable."""
    if not isinstance(part, dict):
        raise invalid_value("each content part must be an object")
    kind = part.get("type")
    if isinstance(kind, str) and kind in UNREADABLE_PARTS:
        raise PydanticCustomError(
            "unreadable_part", "{what} input is not supported: this model reads text only",
            {"what": UNREADABLE_PARTS[kind], "part": index})
    if not isinstance(kind, str) or kind not in kinds:
        names = ", ".join(f"'{name}'" for name in kinds)
        raise invalid_value(f"only content parts of type {names} are supported")
    text = part.get(kinds[kind])
    if not isinstance(text, str):
        raise invalid_value(f"a {kind} content part needs a string '{kinds[kind]}' field")
    return text


class SamplingRequest(RequestModel):
    """Fields shared by chat and text completion requests."""

    model: str | None = Field(default=None, min_length=1, max_length=256)  # None: the served one
    # Bounded: a 4300-digit int parses, then cannot even be formatted into an error message.
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    n: int | None = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_UINT64_MAX)
    ignore_eos: bool | None = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # OpenAI's: token id (as a string) -> added to its logit, in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions.
    min_tokens: int | None = Field(default=None, ge=0, le=_INT64_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)  # llama.cpp's name for it
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1,
                                                    max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    priority: int | None = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    response_format: ResponseFormat | None = None  # vLLM takes it on /v1/completions too
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's older names for structured_outputs' fields.
    guided_json: Any = None  # a JSON schema, or its text (see _schema)
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    guided_decoding_backend: str | None = None  # ignored: xgrammar reads every grammar here
    guided_whitespace_pattern: str | None = None  # ignored
    raging: RagingOptions | None = None

    def sampling_fields(self, *left_out: str) -> dict[str, Any]:
        """The sampling fields the request set, but those `left_out`, as chat takes them."""
        return {name: getattr(self, name) for name in SamplingRequest.model_fields
                if name in self.model_fields_set and name not in left_out}

    _grammar: Grammar | None = PrivateAttr(default=None)
    _a_schema = field_validator("guided_json")(_schema)

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingRequest:
        """At most one of `response_format`, `structured_outputs` and the `guided_*` fields
        asks for structured output, and the workers can compile what it asks for."""
        outputs = self.structured_outputs
        self._grammar = _one_grammar({
            "response_format": self.response_format.grammar if self.response_format else None,
            **(outputs.grammars() if outputs is not None else {}),
            "guided_json": _json_grammar(self.guided_json),
            "guided_regex": _text_grammar("regex", self.guided_regex),
            "guided_choice": _choice_grammar(self.guided_choice),
            "guided_grammar": _rules(self.guided_grammar)})
        return self

    @property
    def grammar(self) -> Grammar | None:
        """What the output must match (None: anything)."""
        return self._grammar

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise invalid_value(f"logit_bias keys must be token ids, not {key[:20]!r}")
        return value

    @model_validator(mode="after")
    def _one_repetition_penalty(self) -> SamplingRequest:
        if None not in (self.repeat_penalty, self.repetition_penalty) and (
                self.repeat_penalty != self.repetition_penalty):
            raise invalid_value("repeat_penalty is another name for repetition_penalty: "
                           "send one, or the same value in both")
        return self

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not word.strip() or len(word) > MAX_STOP_CHARS for word in value):
            raise invalid_value(f"each bad word must have text, at most {MAX_STOP_CHARS} "
                                "characters")
        return value

    @field_validator("n")
    @classmethod
    def _at_most_max_choices(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_CHOICES:
            raise invalid_value(f"n must be at most {MAX_CHOICES}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid_value("stop must be a string or a list of strings")
        _check_stops(stops)
        return stops

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise invalid_value("stream_options is only allowed when stream is true")
        return value


def _check_stops(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_value(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if any(not s for s in stops):
        raise invalid_value("stop strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid_value(f"each stop string must be at most {MAX_STOP_CHARS} characters")


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    # "none", "auto", "required", or a NamedToolChoice (typed Any: see _choice).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call per reply
    functions: list[FunctionDefinition] | None = None  # legacy: tools of type "function"
    function_call: Any = None  # legacy tool_choice: "none", "auto", or a FunctionName
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # Accepted and ignored: bookkeeping for OpenAI's platform, or hints with no effect here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic (and salted per tenant)
    prompt_cache_options: dict[str, str] | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # vLLM's chat template options.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    _no_reserved_kwargs = field_validator("chat_template_kwargs")(_unreserved)

    @model_validator(mode="after")
    def _continue_or_cue(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid_value("continue_final_message and add_generation_prompt cannot both be "
                           "true: set add_generation_prompt to false to continue the last "
                           "message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise invalid_value("continue_final_message needs the last message to be the "
                           "assistant's")
        return self

    _missing_features = field_validator("audio", "prediction", "web_search_options",
                                        "moderation")(none_only)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise invalid_value("top_logprobs needs logprobs set to true")
        return value

    @field_validator("tool_choice", "function_call", mode="before")
    @classmethod
    def _choice(cls, value: object, info: ValidationInfo) -> object:
        # Not a union type: pydantic would name the union's members in the error location.
        if value is None or value in ("none", "auto") or (
                value == "required" and info.field_name == "tool_choice"):
            return value
        if not isinstance(value, dict):
            raise invalid_value(f"{info.field_name} must be one of the allowed strings or an "
                                "object")
        named = NamedToolChoice if info.field_name == "tool_choice" else FunctionName
        try:
            return named.model_validate(value)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
            raise PydanticCustomError("invalid_value", "{where}: {message}", {
                "where": _format_loc(first["loc"]) or "value", "message": first["msg"]}) from None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value not in (None, ["text"]):
            raise _unsupported("output other than text")
        return value


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions; `prompt` is normalized to a list of prompts, each a
    string or token ids (a batch: each gets `n` choices)."""

    prompt: list[str | list[int]]
    # 0 with echo: the prompt (and its tokens' logprobs) only, as vLLM's
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=0, le=_INT64_MAX)
    echo: bool | None = False  # each choice's text starts with its prompt's
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: object) -> object:
        return normalize_prompts(value)

    @model_validator(mode="after")
    def _at_most_max_choices_in_all(self) -> CompletionRequest:
        if len(self.prompt) * (self.n or 1) > MAX_CHOICES:
            raise invalid_value(f"prompts times n must be at most {MAX_CHOICES}")
        return self

    @model_validator(mode="after")
    def _no_empty_completion_without_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise invalid_value("max_tokens 0 asks for the prompt alone: it needs echo")
        return self

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise invalid_value("only best_of=1 is supported for now")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix")
        return value


class TokenizeRequest(RequestModel):
    """The body of POST /tokenize: vLLM's (a prompt, or messages under the chat template) or
    llama.cpp's (`content`, `add_special`, `with_pieces`)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)
    prompt: str | None = None
    content: str | None = None  # llama.cpp's prompt
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # Default: true for a prompt, false for messages (the template writes its own) and for
    # llama.cpp's content; `add_special` is llama.cpp's name.
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    with_pieces: bool | None = False  # llama.cpp's: each token as its id and its text

    _no_reserved_kwargs = field_validator("chat_template_kwargs")(_unreserved)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if sum(given is not None for given in (self.prompt, self.content, self.messages)) != 1:
            raise invalid_value("give one of prompt, content or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid_value("continue_final_message and add_generation_prompt cannot both be "
                           "true")
        return self

    @property
    def template(self) -> TemplateOptions:
        return TemplateOptions(self.add_generation_prompt is not False,
                               bool(self.continue_final_message), self.chat_template_kwargs)

    @property
    def text(self) -> str | None:
        """The text to tokenize, unless messages are."""
        return self.prompt if self.prompt is not None else self.content

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS) to the text."""
        asked = self.add_special_tokens if self.add_special_tokens is not None else self.add_special
        return asked if asked is not None else self.prompt is not None


class DetokenizeRequest(RequestModel):
    """The body of POST /detokenize (vLLM's and llama.cpp's)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)
    tokens: list[TokenId]


_PROMPT_FORMS = "prompt must be a string, a list of token ids, or a list of either"


def normalize_prompts(value: object) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either: the prompts, in order."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid_value(_PROMPT_FORMS)
    if not value:
        raise invalid_value("prompt must not be an empty list")
    if all(_is_token_id(item) for item in value):
        return [value]
    if not all(isinstance(item, str) or _is_token_list(item) for item in value):
        raise invalid_value(_PROMPT_FORMS)
    return value


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_token_id(t) for t in value)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What to generate, independent of the API the request came through.

    `max_tokens` None means "the request set none": `default_max_tokens` or the context
    limit, whichever is less; `top_k` 0 disables top-k; `include_usage` asks for a final usage
    chunk when streaming; `logprobs` None asks for no logprobs, k for each token's and the k
    most likely tokens'.
    """

    max_tokens: int | None = None
    default_max_tokens: int | None = None  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far on every chunk (with include_usage)
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: Grammar | None = None  # structured output, as GenerationTask.grammar
    n: int = 1  # choices: the prompt is prefilled once, each choice samples on its own
    timing: bool = False  # the response carries the latency breakdown (gateway.timing)
    min_p: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    priority: int = 0  # vLLM's: lower is prefilled sooner
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    echo: bool = False  # completions: the text (and logprobs) start with the prompt's


def generation_params(req: ChatCompletionRequest | CompletionRequest,
                      defaults: GenerationDefaults | None = None) -> GenerationParams:
    """The internal generation parameters of a validated request; what it leaves out comes
    from `defaults` (sampling values, the max_tokens cap)."""
    defaults = defaults or GenerationDefaults()
    stream = bool(req.stream)
    temperature = _given(req.temperature, defaults.temperature)
    return GenerationParams(
        max_tokens=_max_tokens(req, defaults.max_tokens),
        default_max_tokens=_default_max_tokens(req, defaults.max_tokens),
        temperature=temperature,
        top_p=_given(req.top_p, defaults.top_p),
        top_k=max(_given(req.top_k, defaults.top_k), 0),
        min_p=_given(req.min_p, defaults.min_p),
        seed=req.seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        include_usage=stream and bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=stream and bool(req.stream_options and req.stream_options.include_usage
                                         and req.stream_options.continuous_usage_stats),
        stream=stream,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_given(_given(req.repetition_penalty, req.repeat_penalty),
                                  _default_penalty(temperature, defaults)),
        min_tokens=req.min_tokens or 0,
        logprobs=_logprobs(req),
        grammar=req.grammar,
        n=req.n or 1,
        timing=bool(req.raging and req.raging.timing),
        skip_special_tokens=req.skip_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words or ()),
        priority=req.priority or 0,
        logit_bias=tuple((int(token), bias) for token, bias in (req.logit_bias or {}).items()
                         if bias),
        echo=isinstance(req, CompletionRequest) and bool(req.echo),
    )


_T = TypeVar("_T")


def _default_penalty(temperature: float, defaults: GenerationDefaults) -> float:
    """A greedy request gets no default repetition penalty: its output stays the model's own
    greedy output (what transformers' generate gives); a sampled one gets the default's."""
    return defaults.repetition_penalty if temperature > 0 else 1.0


def _given(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _default_max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int) -> int:
    """The cap for a request that sets no max_tokens; never below its min_tokens."""
    return max(cap, req.min_tokens or 0)


def _max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int) -> int | None:
    """The completion's length limit, if the request sets one (chat's max_completion_tokens
    wins; /v1/completions' absent max_tokens is OpenAI's 16, or the cap when it is less);
    a 400 when min_tokens exceeds it."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if isinstance(req, CompletionRequest) and "max_tokens" not in req.model_fields_set:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, cap)
    if max_tokens is not None and (req.min_tokens or 0) > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens ({max_tokens})",
                          param="min_tokens")
    return max_tokens


def _logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many most likely tokens to show per token; None: no logprobs at all."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


_Model = TypeVar("_Model", bound=BaseModel)


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse a /v1/chat/completions body; any invalid body raises a 400 `APIError`."""
    request = parse_body(ChatCompletionRequest, body)
    check_tool_request(request)
    return request


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse a /v1/completions body; any invalid body raises a 400 `APIError`."""
    return parse_body(CompletionRequest, body)


def check_tool_request(request: ChatCompletionRequest) -> None:
    """400 for tool fields that disagree, or (when a call is forced) a function whose
    parameters the workers could not compile into a grammar."""
    plan = tool_plan(request)
    if plan is None or not plan.grammar:
        return
    if request.grammar is not None:
        raise bad_request("Invalid 'tool_choice': a forced call cannot be combined with "
                          "structured outputs", param="tool_choice")
    problem = grammar_problem(Grammar("json_schema", plan.grammar))
    if problem is not None:
        param = "functions" if plan.legacy else "tools"
        raise bad_request(f"Invalid '{param}': a function's parameters are not a usable JSON "
                          f"schema: {problem}", param=param)


def chat_request_of(fields: dict[str, Any], params: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request became, from its `fields`; a 400 as chat would
    give it, naming that request's own field (`params`: chat's top-level field -> its own)."""
    return _request_of(ChatCompletionRequest, fields, params, check_tool_request)


def completion_request_of(fields: dict[str, Any], params: Mapping[str, str]
                          ) -> CompletionRequest:
    """The completion request another API's request became, as `chat_request_of`."""
    return _request_of(CompletionRequest, fields, params)


def _request_of(model: type[_Model], fields: dict[str, Any], params: Mapping[str, str],
                check: Callable[[_Model], None] | None = None) -> _Model:
    try:
        request = model.model_validate(fields)
        if check is not None:
            check(request)
    except ValidationError as exc:
        raise _with_param_renamed(validation_error(exc), params) from None
    except APIError as exc:
        raise _with_param_renamed(exc, params) from None
    return request


def _with_param_renamed(error: APIError, params: Mapping[str, str]) -> APIError:
    """An error of the chat or completion request another API's request became, naming the
    field of that request it came from (`params`: the top-level field -> its own). Indices
    are dropped: a message's index in chat is not one in the request (system text, merged
    turns shift it)."""
    chat_field = re.split(r"[.\[]", error.param or "")[0]
    param = params.get(chat_field)
    if param is None or error.param is None:
        return error
    return bad_request(error.message.replace(f"'{error.param}'", f"'{param}'"), param=param)


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """Parse a /tokenize body; any invalid body raises a 400 `APIError`."""
    return parse_body(TokenizeRequest, body)


def parse_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Parse a /detokenize body; any invalid body raises a 400 `APIError`."""
    return parse_body(DetokenizeRequest, body)


def parse_body(model: type[_Model], body: bytes) -> _Model:
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _reject_duplicate_keys(body)
    return request


def _reject_duplicate_keys(body: bytes) -> None:
    """400 when an object repeats a key: pydantic keeps the last one, a proxy in front may have
    checked the first. Only run on a body pydantic accepted, so its nesting depth is small."""
    try:
        json.loads(body, object_pairs_hook=_unique_keys)
    except ValueError:  # what pydantic's parser accepts and Python's does not
        raise bad_request("The request body is not valid JSON.") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            name = key[:_MAX_NAME_CHARS]
            raise bad_request(f"Duplicate key '{name}' in the request body", param=name)
        seen.add(key)
    raise AssertionError("a shorter dict means a repeated key")


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field; the offending input value is never included."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = first["loc"]
    if first["type"] == "unreadable_part":  # name the part, not only its message's content
        loc = (*loc, first.get("ctx", {})["part"])
    param = _format_loc(loc)
    message = first["msg"]
    if param is not None:
        return bad_request(f"Invalid '{param}': {message}", param=param)
    if first["type"] == "json_invalid":
        return bad_request(message)
    return bad_request(f"Invalid request body: {message}")


def _format_loc(loc: tuple[int | str, ...]) -> str | None:
    """Pydantic's error location as `messages[0].content`; None for the body itself."""
    text = ""
    for item in loc:
        if isinstance(item, int):
            text += f"[{item}]"
        else:
            name = item[:_MAX_NAME_CHARS]  # a map key or unknown field: chosen by the client
            text += f".{name}" if text else name
    return text or None


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat request's messages go through the template (vLLM's fields)."""

    add_generation_prompt: bool = True  # end with the assistant's cue
    continue_final_message: bool = False  # leave the last (assistant) message open
    kwargs: Mapping[str, Any] | None = None  # more variables for the template

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> TemplateOptions:
        return cls(req.add_generation_prompt is not False, bool(req.continue_final_message),
                   req.chat_template_kwargs)
