"""The OpenAI request schema for /v1/chat/completions and /v1/completions (and /tokenize,
/detokenize).

Request bodies are parsed into pydantic models (`parse_completion_request`; a chat body in
gateway/chat_request.py, which checks its tools too), any malformed body becoming a 400
`APIError` (gateway/validation.py), then reduced to the internal `GenerationParams`
(gateway/params.py). Every field the official OpenAI client sends is known: used, accepted and
ignored (hints with no effect here), or refused as "not supported yet" unless it asks for
nothing (null, empty, the default). vLLM's cheap extensions (min_p, bad_words,
allowed_token_ids, skip_special_tokens, chat template options, ...) are implemented;
structured outputs are read in gateway/structured_outputs.py. Another API's request becomes
one of these (`completion_request_of`, gateway/chat_request.py's `chat_request_of`). Prompts
become token ids in gateway/prompts.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.codec import is_int
from core.messages import MAX_LOGPROBS, Grammar
from gateway.structured_outputs import (
    ResponseFormat,
    StructuredOutputs,
    choice_grammar,
    json_grammar,
    one_grammar,
    rules_grammar,
    schema_or_text,
    text_grammar,
)
from gateway.validation import (
    MAX_NAME_CHARS,
    RequestModel,
    format_loc,
    invalid_value,
    joined_text,
    none_only,
    parse_body,
    request_of,
    unsupported,
)

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
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
_INT32_MAX = 2**31 - 1
TEXT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})
# apply_chat_template's own arguments: set by the request's fields, never by chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

Role = Literal["system", "user", "assistant", "tool", "developer", "function"]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]


def unreserved(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: template variables, none of apply_chat_template's own arguments."""
    reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise PydanticCustomError(
            "invalid_value", "'{name}' is set by the request's own fields, not here",
            {"name": reserved[0]})
    return value


def check_template_flags(add_generation_prompt: bool | None,
                         continue_final_message: bool | None) -> None:
    """A request's chat template may end in the assistant's cue or leave the last message
    open, not both."""
    if continue_final_message and add_generation_prompt:
        raise invalid_value("continue_final_message and add_generation_prompt cannot both be "
                            "true: set add_generation_prompt to false to continue the last "
                            "message")


class StreamOptions(RequestModel):
    """`stream_options`: whether the last streamed chunk carries token usage."""

    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # ignored: chunks are never padded
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too


class RagingOptions(RequestModel):
    """`raging`: this server's own options (docs/api.md)."""

    timing: bool | None = False  # the response carries the request's latency breakdown


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
                f"content[{i}].{name[:MAX_NAME_CHARS]}"
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



class SamplingRequest(RequestModel):
    """Fields shared by chat and text completion requests."""

    model: str | None = Field(default=None, max_length=256)  # None: the served one
    # Bounded: a 4300-digit int parses, then cannot even be formatted into an error message.
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    n: int | None = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=_UINT64_MAX)
    ignore_eos: bool | None = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # OpenAI's: token id (as a string) -> added to its logit, in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions.
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)  # llama.cpp's name for it
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1,
                                                    max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    priority: int | None = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    response_format: ResponseFormat | None = None  # vLLM takes it on /v1/completions too
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's older names for structured_outputs' fields.
    guided_json: Any = None  # a JSON schema, or its text (see schema_or_text)
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
    _a_schema = field_validator("guided_json")(schema_or_text)

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingRequest:
        """At most one of `response_format`, `structured_outputs` and the `guided_*` fields
        asks for structured output, and the workers can compile what it asks for."""
        outputs = self.structured_outputs
        self._grammar = one_grammar({
            "response_format": self.response_format.grammar if self.response_format else None,
            **(outputs.grammars() if outputs is not None else {}),
            "guided_json": json_grammar(self.guided_json),
            "guided_regex": text_grammar("regex", self.guided_regex),
            "guided_choice": choice_grammar(self.guided_choice),
            "guided_grammar": rules_grammar(self.guided_grammar)})
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
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
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

    _no_reserved_kwargs = field_validator("chat_template_kwargs")(unreserved)

    @model_validator(mode="after")
    def _continue_or_cue(self) -> ChatCompletionRequest:
        check_template_flags(self.add_generation_prompt, self.continue_final_message)
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
                "where": format_loc(first["loc"]) or "value", "message": first["msg"]}) from None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value not in (None, ["text"]):
            raise unsupported("output other than text")
        return value


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions; `prompt` is normalized to a list of prompts, each a
    string or token ids (a batch: each gets `n` choices)."""

    prompt: list[str | list[int]]
    # 0 with echo: the prompt (and its tokens' logprobs) only, as vLLM's
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=0, le=INT64_MAX)
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
    def _suffix_after_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value and not all(isinstance(prompt, str) for prompt in info.data.get("prompt", [])):
            raise invalid_value("a suffix follows a text prompt, not token ids")
        if value and info.data.get("echo"):
            raise invalid_value("echo shows the prompt, and a suffix is not one: send one of them")
        return value


class TokenizeRequest(RequestModel):
    """The body of POST /tokenize: vLLM's (a prompt, or messages under the chat template) or
    llama.cpp's (`content`, `add_special`, `with_pieces`)."""

    model: str | None = Field(default=None, max_length=256)
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

    _no_reserved_kwargs = field_validator("chat_template_kwargs")(unreserved)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if sum(given is not None for given in (self.prompt, self.content, self.messages)) != 1:
            raise invalid_value("give one of prompt, content or messages")
        check_template_flags(self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def template(self) -> TemplateOptions:
        return TemplateOptions.of(self)

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

    model: str | None = Field(default=None, max_length=256)
    tokens: list[TokenId]


def normalize_prompts(value: object, field: str = "prompt") -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either: the prompts, in order. `field`:
    the request's name for them, for its errors."""
    forms = f"{field} must be a string, a list of token ids, or a list of either"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid_value(forms)
    if not value:
        raise invalid_value(f"{field} must not be an empty list")
    if all(is_int(item) for item in value):
        return [value]
    if not all(isinstance(item, str) or _is_token_list(item) for item in value):
        raise invalid_value(forms)
    return value


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse a /v1/completions body; any invalid body raises a 400 `APIError`."""
    return parse_body(CompletionRequest, body)


def completion_request_of(fields: dict[str, Any], params: Mapping[str, str]
                          ) -> CompletionRequest:
    """The completion request another API's request became, from its `fields`; a 400 as
    /v1/completions would give it, naming that request's own field."""
    return request_of(CompletionRequest, fields, params)


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """Parse a /tokenize body; any invalid body raises a 400 `APIError`."""
    return parse_body(TokenizeRequest, body)


def parse_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Parse a /detokenize body; any invalid body raises a 400 `APIError`."""
    return parse_body(DetokenizeRequest, body)


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat request's messages go through the template (vLLM's fields)."""

    add_generation_prompt: bool = True  # end with the assistant's cue
    continue_final_message: bool = False  # leave the last (assistant) message open
    kwargs: Mapping[str, Any] | None = None  # more variables for the template

    @classmethod
    def of(cls, req: ChatCompletionRequest | TokenizeRequest) -> TemplateOptions:
        return cls(req.add_generation_prompt is not False, bool(req.continue_final_message),
                   req.chat_template_kwargs)
