"""The body of POST /v1/messages (Anthropic's Messages API), and what it means as a chat request.

A Messages request is a chat request spelled another way: `system` is the system message, each
message's content a string or a list of blocks (text, earlier `tool_use` calls, `tool_result`
answers, thinking, which goes back to the template as the turn's reasoning), `tools` custom
tools with an `input_schema`,
`tool_choice` one of auto / any / tool / none, `stop_sequences` the stop strings and
`output_config.format` a JSON schema for the output. `MessagesRequest.chat_request` turns it
into a `ChatCompletionRequest`, so that everything downstream (template, tool calling,
structured output, sampling) is the chat route's. A last message of the assistant's is
continued, as Anthropic continues a prefilled reply. Images, documents, server tools and MCP
servers are refused with a 400 that says so; vLLM's sampling extensions (seed, min_p, ...)
apply as on chat.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gateway.chat_request import chat_request_of
from gateway.protocol import ChatCompletionRequest, SamplingRequest
from gateway.validation import (
    RequestModel,
    invalid_value,
    joined_text,
    none_only,
    one_choice,
    only_tools_of_type,
    parse_body,
)

ChatMessageFields = dict[str, Any]  # one chat message, as ChatMessage validates it
# Chat's fields: this request's, for a 400 that chat's validation raised.
_FIELDS_OF_CHAT = {"messages": "messages", "stop": "stop_sequences",
                   "response_format": "output_config.format", "tool_choice": "tool_choice",
                   "tools": "tools"}
# Blocks this text-only model cannot read, by type: what the 400 calls them.
_UNREADABLE_BLOCKS = {"image": "image", "document": "document", "search_result": "search result",
                      "container_upload": "file"}
_MAX_ID_CHARS = 256


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # ignored: prefix caching is automatic (and salted per tenant)
    citations: Any = None  # ignored


class ToolUseBlock(RequestModel):
    """An earlier call of one of the tools, as a reply's content gave it."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None  # ignored: who made the call (programmatic tool calling)


class ToolResultBlock(RequestModel):
    """What an earlier call returned: text, or text blocks (joined by \\n)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    content: str = ""
    is_error: bool | None = None
    cache_control: Any = None

    _join_text_blocks = field_validator("content", mode="before")(joined_text)

    def chat_message(self) -> ChatMessageFields:
        """The answer as chat's tool message; a failed call's marked so."""
        content = f"Error: {self.content}" if self.is_error else self.content
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": content}


class ThinkingBlock(RequestModel):
    """An earlier reply's thinking: the turn's reasoning, for a template that shows it again
(Qwen3's, within a chain of tool calls); a redacted one is skipped."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(value: object) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind == "redacted_thinking":
        return "thinking"
    return kind if isinstance(kind, str) else None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_kind, custom_error_type="invalid_value",
                  custom_error_message="content blocks must be text, tool_use, tool_result or "
                                       "thinking blocks")]


class Message(RequestModel):
    """One turn: the user's (text and tool results), the assistant's (text and tool calls), or
    a system message."""

    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]  # a string is one text block

    @field_validator("content", mode="before")
    @classmethod
    def _readable_blocks(cls, value: object) -> object:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise invalid_value("content must be a string or a list of content blocks")
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind in _UNREADABLE_BLOCKS:
                raise PydanticCustomError(
                    "unreadable_part", "{what} input is not supported: this model reads text "
                    "only", {"what": _UNREADABLE_BLOCKS[kind], "part": index})
        return value

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> Message:
        kinds = {block.type for block in self.content}
        if "tool_use" in kinds and self.role != "assistant":
            raise invalid_value("only the assistant's messages may hold tool_use blocks")
        if "tool_result" in kinds and self.role != "user":
            raise invalid_value("only the user's messages may hold tool_result blocks")
        return self

    def chat_messages(self) -> list[ChatMessageFields]:
        """This turn as chat messages: a user turn's tool results become tool messages (before
        its text, as Anthropic orders them), an assistant turn's calls its tool_calls."""
        if self.role == "assistant":
            return [_assistant_message(self.text, self.content)]
        results = [block.chat_message() for block in self.content
                   if isinstance(block, ToolResultBlock)]
        if self.text or not results:
            results.append({"role": self.role, "content": self.text})
        return results

    @property
    def text(self) -> str:
        return "\n".join(block.text for block in self.content if isinstance(block, TextBlock))

    def ids(self, kind: type[ToolUseBlock] | type[ToolResultBlock]) -> list[str]:
        """The ids of its calls (ToolUseBlock) or of the calls it answers (ToolResultBlock)."""
        return [block.id if isinstance(block, ToolUseBlock) else block.tool_use_id
                for block in self.content if isinstance(block, kind)]


def _assistant_message(text: str, blocks: list[Any]) -> ChatMessageFields:
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    message: ChatMessageFields = {"role": "assistant", "content": text}
    if calls:
        message.update(content=text or None, tool_calls=calls)
    thought = "".join(block.thinking or "" for block in blocks
                      if isinstance(block, ThinkingBlock))
    if thought:
        message["reasoning_content"] = thought
    return message


class CustomTool(RequestModel):
    """One entry of `tools`: a function the model may call, its input a JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    # Ignored: hints for Anthropic's own tool running.
    cache_control: Any = None
    strict: bool | None = None  # a forced call always matches the schema here
    input_examples: Any = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: Any = None

    _custom_only = model_validator(mode="before")(only_tools_of_type(
        "custom", "custom tools (with an input_schema)"))


class ToolChoice(RequestModel):
    """`tool_choice`: the model decides (auto), must call a tool (any), must call the one
    named (tool), or calls none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise invalid_value("a tool_choice of type 'tool' names the tool, and only it")
        return self

    def chat_choice(self) -> Any:
        """Chat's `tool_choice` for it."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """`output_config`: a JSON schema the output follows (and an effort hint, ignored)."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class MessagesRequest(SamplingRequest):
    """The body of POST /v1/messages (and of /v1/messages/count_tokens, which needs no
    max_tokens)."""

    messages: list[Message] = Field(min_length=1)
    system: str | None = None
    stop_sequences: list[str] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-output beta's name for it
    # Accepted and ignored: bookkeeping for Anthropic's platform, or hints with no effect here.
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "adaptive" | "disabled"}
    cache_control: Any = None  # prefix caching is automatic
    context_management: Any = None  # nothing is cleared: the prompt stays whole
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    # Not supported: refused unless they ask for nothing.
    mcp_servers: Any = None
    container: Any = None

    _not_here = field_validator("mcp_servers", "container")(none_only)
    _join_system_blocks = field_validator("system", mode="before")(joined_text)

    _one_output = field_validator("n")(one_choice)

    @field_validator("response_format")
    @classmethod
    def _format_in_output_config(cls, value: object) -> object:
        if value is not None:
            raise invalid_value("a message's format is output_config.format, not "
                                "response_format")
        return value

    @field_validator("mcp_servers", mode="before")
    @classmethod
    def _no_servers(cls, value: object) -> object:
        return None if value == [] else value

    @model_validator(mode="after")
    def _one_format(self) -> MessagesRequest:
        if self.output_format is not None and self.output_config is not None and (
                self.output_config.format is not None):
            raise invalid_value("give output_config.format or output_format, not both")
        return self

    @model_validator(mode="after")
    def _every_call_answered(self) -> MessagesRequest:
        """As Anthropic checks: each tool_use is answered by a tool_result in the next
        message, and each tool_result answers a tool_use of the message before it."""
        messages = self.messages
        for index, message in enumerate(messages):
            asked = set(messages[index - 1].ids(ToolUseBlock)) if index else set()
            answered = set(message.ids(ToolResultBlock))
            if answered - asked:
                raise invalid_value(f"messages[{index}]: tool_result blocks answer no tool_use "
                                    f"of the message before: {', '.join(sorted(answered - asked))}")
            if asked - answered:
                raise invalid_value(f"messages[{index - 1}]: tool_use blocks are not answered "
                                    "by tool_result blocks in the next message: "
                                    f"{', '.join(sorted(asked - answered))}")
        if messages[-1].ids(ToolUseBlock):
            raise invalid_value("the last message calls tools: answer them with tool_result "
                                "blocks first")
        return self

    @model_validator(mode="after")
    def _prefill_ends_in_text(self) -> MessagesRequest:
        last = self.messages[-1]
        if last.role == "assistant" and last.text != last.text.rstrip():
            raise invalid_value("a final assistant message cannot end with whitespace")
        return self

    @property
    def thinks(self) -> bool:
        """Whether the request turned thinking on (its blocks are shown only then)."""
        return self.thinking is not None and self.thinking.get("type") in ("enabled",
                                                                            "adaptive")

    @property
    def turns(self) -> list[Message]:
        """The messages, less a final assistant message with no text (no reply begun)."""
        last = self.messages[-1]
        return self.messages[:-1] if last.role == "assistant" and not last.text else self.messages

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; a 400 for what chat would refuse. A final
        assistant message is continued."""
        fields = self.sampling_fields("stop")
        continued = self.turns[-1].role == "assistant"
        fields.update(self._tool_fields(), messages=self.chat_messages(),
                      stop=[*(self.stop or ()), *(self.stop_sequences or ())] or None,
                      response_format=self._response_format(),
                      continue_final_message=continued, add_generation_prompt=not continued)
        if self.thinking is not None:  # as Qwen3's template reads it; others ignore it
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinks}
        return chat_request_of(fields, _FIELDS_OF_CHAT)

    def chat_messages(self) -> list[ChatMessageFields]:
        """The turns as chat messages, consecutive plain ones of a role merged (as Anthropic
        merges them: templates may insist that roles alternate)."""
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages: list[ChatMessageFields] = []
        for message in system + [chat for turn in self.turns for chat in turn.chat_messages()]:
            if messages and _plain(messages[-1]) and _plain(message) and (
                    messages[-1]["role"] == message["role"]):
                messages[-1] = {**message, "content": f"{messages[-1]['content']}\n"
                                                      f"{message['content']}"}
            else:
                messages.append(message)
        return messages

    def _tool_fields(self) -> dict[str, Any]:
        choice = self.tool_choice
        return {"tools": [_chat_tool(tool) for tool in self.tools or ()] or None,
                "tool_choice": None if choice is None else choice.chat_choice(),
                "parallel_tool_calls": False if choice and choice.disable_parallel_tool_use
                else None}

    def _response_format(self) -> dict[str, Any] | None:
        config = self.output_config
        output = config.format if config is not None and config.format else self.output_format
        if output is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": output.schema_}}


def _plain(message: ChatMessageFields) -> bool:
    """A message of text alone: no calls, not a tool's answer."""
    return message["role"] in ("user", "system") or (
        message["role"] == "assistant" and "tool_calls" not in message)


def _chat_tool(tool: CustomTool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Parse a /v1/messages body; any invalid body raises a 400 `APIError`."""
    return parse_body(MessagesRequest, body)
