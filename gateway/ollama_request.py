"""The bodies of Ollama's `POST /api/chat` and `POST /api/generate`, read as chat or completion
requests.

Ollama's names map onto the fields the gateway already serves: `options` holds the sampling
settings (`num_predict` caps the length, and stops at the context, as Ollama does; -1 and -2
mean up to the cap), `format` is `"json"` or a JSON schema, `think` turns a thinking model's
thought on or off (and shows it apart), `tools` are OpenAI's function tools, and an earlier
call's `arguments` are an object. Ollama names no call: a tool message answers the earlier
call of its `tool_name`, or the first one not yet answered. `/api/generate` renders its
`prompt` (and `system`) with the chat template, unless `raw`; its `context` (the token ids an
earlier reply returned) goes before the new prompt. Load-time options (`num_ctx`, `num_gpu`,
...) and `keep_alive` mean nothing here and are accepted; samplers that are not served
(mirostat, ...) are ignored as unknown fields are (gateway/ignored_fields.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gateway.chat_request import chat_request_of
from gateway.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    Penalty,
    TokenId,
    completion_request_of,
)
from gateway.validation import RequestModel, invalid_value, parse_body

ChatMessageFields = dict[str, Any]  # one chat message, as ChatMessage validates it
Think = bool | Literal["low", "medium", "high", "max"]
_UINT64_MAX = 2**64 - 1
# The chat or completion request's fields named otherwise here, for its errors.
_OLLAMA_NAMES = {"messages": "messages", "tools": "tools", "response_format": "format",
                 "guided_json": "format", "max_tokens": "options.num_predict",
                 "temperature": "options.temperature", "top_p": "options.top_p",
                 "top_k": "options.top_k", "min_p": "options.min_p", "stop": "options.stop",
                 "seed": "options.seed", "repeat_penalty": "options.repeat_penalty",
                 "presence_penalty": "options.presence_penalty",
                 "frequency_penalty": "options.frequency_penalty",
                 "top_logprobs": "top_logprobs", "logprobs": "top_logprobs",
                 "prompt": "prompt"}
_SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop",
                     "repeat_penalty", "presence_penalty", "frequency_penalty")


class Options(RequestModel):
    """`options`: the sampling settings served; the model's load settings, accepted and
    ignored (the workers load the model once, for every request)."""

    # Not strict: as Ollama reads options, a whole number may come as 128.0.
    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False, frozen=True)

    num_predict: int | None = Field(default=None, ge=-2, le=2**63 - 1)  # -1, -2: the cap
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # <= 0: off
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=_UINT64_MAX)
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Ignored: how Ollama loads a model. The context is the server's (GET /api/show says it).
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None

    @field_validator("num_predict")
    @classmethod
    def _something_to_predict(cls, value: int | None) -> int | None:
        if value == 0:
            raise invalid_value("must be -1 or -2 (up to the cap) or at least 1")
        return value

    @property
    def predict(self) -> int | None:
        """The most tokens to make; None: up to the cap."""
        most = self.num_predict
        return None if most is None or most < 0 else most

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling settings given, as chat names them; a top_p of 0 is greedy, as a
        temperature of 0 is."""
        fields = {name: getattr(self, name) for name in _SAMPLING_OPTIONS
                  if getattr(self, name) is not None}
        if fields.get("seed", 0) < 0:
            del fields["seed"]  # Ollama's -1: a fresh seed each time
        if fields.get("top_p") == 0.0:
            fields.update(top_p=None, temperature=0.0)
        return {name: value for name, value in fields.items() if value is not None}


class ToolCallFunction(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # an object; JSON text too
    index: int | None = None  # ignored: calls are in order


class ToolCall(RequestModel):
    """An earlier call, as Ollama's reply gave it."""

    function: ToolCallFunction
    id: str | None = Field(default=None, min_length=1, max_length=256)
    type: Literal["function"] | None = None

    def chat_call(self, call_id: str) -> dict[str, Any]:
        arguments = self.function.arguments
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return {"id": self.id or call_id, "type": "function",
                "function": {"name": self.function.name, "arguments": text}}


def _no_images(value: list[str] | None) -> list[str] | None:
    if value:
        raise invalid_value("image input is not supported: this model reads text only")
    return value


class Message(RequestModel):
    """One turn of `messages`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""

    @field_validator("role", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("content", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return "" if value is None else value
    thinking: str | None = None  # an earlier reply's thought
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = Field(default=None, max_length=64)  # a tool message's tool
    tool_call_id: str | None = Field(default=None, max_length=256)

    _text_only = field_validator("images")(_no_images)

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(cls, value: list[ToolCall] | None,
                                info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise invalid_value("only the assistant's messages may carry tool_calls")
        return value


class _Generating(RequestModel):
    """What both routes take beside their prompt."""

    model: str | None = Field(default=None, max_length=256)
    stream: bool | None = True  # Ollama streams unless told not to (null: as unset)
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    think: Think | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    keep_alive: str | float | None = None  # ignored: the model stays loaded

    @property
    def unloads(self) -> bool:
        """keep_alive 0: Ollama's request to unload the model (answered, not done here)."""
        return self.keep_alive in (0, "0", "0s", "0m")

    @property
    def settings(self) -> Options:
        """The options given (none: every default)."""
        return self.options or Options()

    def _generation_fields(self) -> dict[str, Any]:
        """The fields chat and completions share: sampling, format, length, streaming."""
        fields: dict[str, Any] = {**self.settings.sampling_fields(),
                                  "stream": self.stream is not False, "max_tokens": None}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif self.format:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "format", "schema": self.format}}
        return fields

    def _chat_fields(self) -> dict[str, Any]:
        fields = self._generation_fields()
        if self.logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.think is not None:  # as Qwen3's template reads it; others ignore it
            fields["chat_template_kwargs"] = {"enable_thinking": self.think is not False}
        return fields


class OllamaChatRequest(_Generating):
    """The body of `POST /api/chat`."""

    messages: list[Message] = Field(default_factory=list)  # none: load the model
    tools: list[dict[str, Any]] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; a 400 for what chat would refuse. A last message
        of the assistant's text is continued, as Ollama continues it."""
        last = self.messages[-1]
        continued = last.role == "assistant" and bool(last.content) and not last.tool_calls
        fields = {**self._chat_fields(), "messages": chat_messages(self.messages),
                  "tools": self.tools or None, "continue_final_message": continued,
                  "add_generation_prompt": not continued}
        return chat_request_of(fields, _OLLAMA_NAMES)


class OllamaGenerateRequest(_Generating):
    """The body of `POST /api/generate`."""

    prompt: str = ""  # empty: load the model
    system: str | None = None
    raw: bool = False
    context: list[TokenId] | None = None  # an earlier reply's tokens, before this prompt
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None

    _text_only = field_validator("images")(_no_images)

    @field_validator("template")
    @classmethod
    def _no_template(cls, value: str | None) -> str | None:
        if value:
            raise invalid_value("a request's own template is not served: the model's chat "
                                "template renders the prompt, or send raw true")
        return value

    @model_validator(mode="after")
    def _raw_alone(self) -> OllamaGenerateRequest:
        if self.raw and (self.system or self.context):
            raise invalid_value("raw mode does not support template, system, or context")
        if self.suffix and self.raw:  # Ollama's raw would drop it: a request can't mean both
            raise invalid_value("raw mode does not support suffix: the prompt would be sent "
                                "as it is, and the suffix lost")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The prompt as a user's message (after the system's) under the chat template."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        fields = {**self._chat_fields(),
                  "messages": [*system, {"role": "user", "content": self.prompt}]}
        return chat_request_of(fields, _OLLAMA_NAMES)

    def completion_request(self) -> CompletionRequest:
        """A raw prompt, as /v1/completions takes it."""
        fields = {**self._generation_fields(), "prompt": self.prompt}
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return completion_request_of(fields, _OLLAMA_NAMES)


def chat_messages(messages: list[Message]) -> list[ChatMessageFields]:
    """The turns as chat messages: calls named (`call_<turn>_<n>` where Ollama gave no id), and
    each tool message naming the call it answers."""
    unanswered: list[tuple[str, str]] = []  # (call id, tool name), in order
    chat: list[ChatMessageFields] = []
    for turn, message in enumerate(messages):
        fields: ChatMessageFields = {"role": message.role, "content": message.content}
        if message.thinking:
            fields["reasoning_content"] = message.thinking
        if message.tool_calls:
            calls = [call.chat_call(f"call_{turn}_{n}")
                     for n, call in enumerate(message.tool_calls)]
            unanswered = [(call["id"], call["function"]["name"]) for call in calls]
            fields.update(tool_calls=calls, content=message.content or None)
        if message.role == "tool":
            fields["tool_call_id"] = message.tool_call_id or _answered(
                unanswered, message.tool_name, f"call_{turn}")
        chat.append(fields)
    return chat


def _answered(unanswered: list[tuple[str, str]], name: str | None, fallback: str) -> str:
    """The id of the call a tool message answers (taken off `unanswered`): the first of its
    tool's, or the first of all; `fallback` where none is left."""
    for index, (call_id, tool) in enumerate(unanswered):
        if name is None or tool == name:
            del unanswered[index]
            return call_id
    return fallback


def parse_ollama_chat(body: bytes) -> OllamaChatRequest:
    """Parse an /api/chat body; any invalid body raises a 400 `APIError`."""
    return parse_body(OllamaChatRequest, body)


def parse_ollama_generate(body: bytes) -> OllamaGenerateRequest:
    """Parse an /api/generate body; any invalid body raises a 400 `APIError`."""
    return parse_body(OllamaGenerateRequest, body)
