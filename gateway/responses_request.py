"""The body of POST /v1/responses (OpenAI's Responses API), and what it means as a chat request.

A Responses request is a chat request spelled another way: `instructions` is the system
message, `input` a string (one user message) or a list of items (messages, earlier function
calls and their outputs), `tools` flat function definitions, `text.format` the response format.
`ResponsesRequest.chat_request` turns it into a `ChatCompletionRequest`, after the conversation
of the response it continues (`previous_response_id`), so that everything downstream (template,
tool calling, structured output, sampling) is the chat route's. Hosted tools (web search, file
search, ...), images and files and the Conversations API are refused with a 400 that says so.
`input_items` shows the input as the Responses API lists it back (GET .../input_items).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.chat_request import chat_request_of
from gateway.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    FunctionDefinition,
    SamplingRequest,
)
from gateway.validation import (
    RequestModel,
    invalid_value,
    joined_text,
    none_only,
    one_choice,
    only_tools_of_type,
    parse_body,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for logprobs
_FIELDS_OF_CHAT = {"messages": "input", "response_format": "text.format"}  # chat's: ours
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_MAX_ID_CHARS = 256

ChatMessageFields = dict[str, Any]  # one chat message, as ChatMessage validates it
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


def _joined(value: object) -> object:
    return joined_text(value, _TEXT_PARTS)


class MessageItem(RequestModel):
    """A message: the user's, the system's (or developer's), or an earlier assistant reply;
    content parts are joined by \\n, as chat's are."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str
    id: str | None = Field(default=None, max_length=_MAX_ID_CHARS)
    status: str | None = None
    phase: str | None = None  # ignored: OpenAI's commentary / final-answer mark

    _join_text_parts = field_validator("content", mode="before")(_joined)


class FunctionCallItem(RequestModel):
    """An earlier call of one of the tools, as a response's output gave it."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as the model wrote it
    id: str | None = Field(default=None, max_length=_MAX_ID_CHARS)
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """What an earlier call returned; list output is joined as message content is."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    output: str
    id: str | None = Field(default=None, max_length=_MAX_ID_CHARS)
    status: str | None = None

    _join_text_parts = field_validator("output", mode="before")(_joined)


class ReasoningItem(RequestModel):
    """An earlier response's reasoning: skipped (the conversation goes on from its messages
    and calls)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: object) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_value",
                  custom_error_message="input items must be messages, function_call, "
                                       "function_call_output or reasoning items")]


class FunctionTool(RequestModel):
    """One entry of `tools`: a function, flat (not under `function` as chat has it)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # ignored: a forced call always matches the schema here

    _functions_only = model_validator(mode="before")(only_tools_of_type("function",
                                                                        "'function'"))


class FunctionChoice(RequestModel):
    """`tool_choice` forcing a call of one function."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise invalid_value("a json_schema format needs its name and schema")
        return self

    def chat_format(self) -> dict[str, Any]:
        """Chat's `response_format` for it."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description,
                  "strict": self.strict}
        return {"type": "json_schema", "json_schema": schema}


class TextOptions(RequestModel):
    """`text`: the output's format (and a verbosity hint, ignored)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingRequest):
    """The body of POST /v1/responses. vLLM's sampling extensions (top_k, min_p, seed, stop,
    ...) apply as on chat; `n` stays 1 and the format is `text.format`."""

    input: list[InputItem]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**63 - 1)
    tools: list[FunctionTool] | None = None
    # "none", "auto", "required", or a FunctionChoice (typed Any: see _choice).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1,
                                             max_length=_MAX_ID_CHARS)
    store: bool | None = True
    include: list[str] | None = None  # "message.output_text.logprobs" asks for logprobs
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    text: TextOptions | None = None
    # Accepted and ignored: bookkeeping for OpenAI's platform, or hints with no effect here;
    # metadata and user are kept with the response, so bounded as OpenAI bounds them.
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    background: bool | None = None  # run on after the reply, polled by id (gateway/background.py)
    # Not supported: refused unless they ask for nothing.
    conversation: Any = None
    prompt: Any = None

    _not_here = field_validator("conversation", "prompt")(none_only)

    @field_validator("response_format")
    @classmethod
    def _format_under_text(cls, value: object) -> object:
        if value is not None:
            raise invalid_value("a response's format is text.format, not response_format")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: object) -> object:
        if value == "" or value == []:
            raise invalid_value("input must not be empty")
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("background")
    @classmethod
    def _kept(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("store") is False:
            raise invalid_value("a background response is kept: background needs store true")
        return value

    _one_output = field_validator("n")(one_choice)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: object) -> object:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            try:
                return FunctionChoice.model_validate(value)
            except ValidationError:
                raise invalid_value("a function tool_choice needs the function's name") from None
        raise invalid_value("tool_choice must be 'none', 'auto', 'required' or a function "
                            "(type 'function' and its name)")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def chat_request(self, earlier: list[ChatMessageFields]) -> ChatCompletionRequest:
        """The chat request this one means, after the `earlier` conversation (the messages of
        the response it continues); a 400 for messages chat would refuse."""
        fields = self.sampling_fields("max_tokens", "response_format")
        fields.update(
            messages=[*self._system(), *earlier, *self.input_messages()],
            max_completion_tokens=self.max_output_tokens or self.max_tokens,
            logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs if (
                self.wants_logprobs) else None,
            tools=[{"type": "function", "function": FunctionDefinition.model_validate(
                tool.model_dump(exclude={"type"}, exclude_unset=True))}
                   for tool in self.tools or ()] or None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls)
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.chat_format()
        return chat_request_of(fields, _FIELDS_OF_CHAT)

    def _system(self) -> list[ChatMessageFields]:
        return [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as the Responses API lists it back: each item with an id (its own, or one
        made here) and a status, a message's text as one content part."""
        return [_listed(item) for item in self.input]

    def input_messages(self) -> list[ChatMessageFields]:
        """`input` as chat messages: calls join the assistant turn before them (or make one),
        outputs become tool messages; reasoning items are skipped."""
        messages: list[ChatMessageFields] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.content})
            elif isinstance(item, FunctionCallItem):
                _add_call(messages, item)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.output})
        return messages


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def _listed(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
            ) -> dict[str, Any]:
    fields = item.model_dump(exclude_none=True, exclude={"phase"})
    fields["id"] = item.id or f"{_ID_PREFIXES[item.type]}_{secrets.token_hex(12)}"
    if item.type != "reasoning":
        fields.setdefault("status", "completed")
    if isinstance(item, MessageItem):
        fields["content"] = [{"type": "output_text", "text": item.content, "annotations": []}
                             if item.role == "assistant" else
                             {"type": "input_text", "text": item.content}]
    return fields


def _add_call(messages: list[ChatMessageFields], item: FunctionCallItem) -> None:
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Parse a /v1/responses body; any invalid body raises a 400 `APIError`."""
    return parse_body(ResponsesRequest, body)
