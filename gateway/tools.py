"""Tool calling: what a request's `tools` / `tool_choice` (or legacy `functions` /
`function_call`) ask for, how the tools and earlier calls reach the prompt, and how the output
becomes `tool_calls`.

- `tool_plan` reads a validated request into a `ToolPlan` (a 400 for an inconsistent one).
- `with_tools` completes the chat template's conversation: a template that uses `tools` gets them
  (and earlier calls and results) natively; any other gets the Hermes-style fallback: a system
  block listing the tools in `<tools></tools>` and asking for `<tool_call>` JSON, earlier calls
  as `<tool_call>` text and tool results as user turns in `<tool_response>`.
- `tool_choice` "required" or a named function constrains generation with `ToolPlan.grammar`
  (a JSON schema for GenerationTask.grammar); "auto" parses the output with the configured
  parser (gateway/tool_parsers.py), and "none" shows the tools but never parses, as vLLM does.
- `ToolStream` turns one choice's text into content and OpenAI tool-call deltas (reply.py).
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import jinja2.meta

from gateway.errors import APIError, bad_request
from gateway.handle import Ending
from gateway.tool_parsers import (
    CallPiece,
    NamedParser,
    ParserName,
    Piece,
    RequiredParser,
    ToolCallParser,
    auto_parser,
)

if TYPE_CHECKING:
    from gateway.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition

ToolMode = Literal["none", "auto", "required", "named"]
Reason = Ending | Literal["tool_calls", "function_call"]  # a choice's finish_reason, shown
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request offers and what it asks of them; `forced` names the function of a
    named `tool_choice`; `legacy`: asked through `functions`, answered as `function_call`."""

    functions: tuple[FunctionDefinition, ...]
    mode: ToolMode
    forced: str | None = None
    parallel: bool = True
    legacy: bool = False
    parser: ParserName = ""
    max_calls: int = 0  # of a forced "required" array, when parallel; 0: no bound

    @property
    def grammar(self) -> str:
        """GenerationTask.grammar: a schema forcing a valid call; "" when nothing is forced."""
        if self.mode == "named":
            function = next(f for f in self.functions if f.name == self.forced)
            return json.dumps(function.parameters or NO_ARGUMENTS)
        if self.mode != "required":
            return ""
        calls: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": {"anyOf": [_call_schema(f) for f in self.functions]}}
        if not self.parallel or self.max_calls:
            calls["maxItems"] = self.max_calls if self.parallel else 1
        return json.dumps(calls)

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as OpenAI (and chat templates) spell them."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)}
                for f in self.functions]

    def stream(self) -> ToolStream | None:
        """A fresh stream for one choice; None when the output is plain text."""
        parser: ToolCallParser | None = None
        if self.mode == "required":
            parser = RequiredParser()
        elif self.mode == "named":
            assert self.forced is not None
            parser = NamedParser(self.forced)
        elif self.mode == "auto":
            parser = auto_parser(self.parser, frozenset(f.name for f in self.functions))
        return None if parser is None else ToolStream(parser, self.parallel, self.legacy)


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": function.name},
                           "arguments": function.parameters or NO_ARGUMENTS},
            "required": ["name", "arguments"]}


def tool_plan(request: ChatCompletionRequest, parser: ParserName = "",
              max_calls: int = 0) -> ToolPlan | None:
    """The request's tool plan (None: no tools offered); a 400 when its fields disagree.
    `parser` and `max_calls`: the config's tool_call_parser and max_parallel_tool_calls."""
    if request.tools and request.functions:
        raise _bad("functions", "use tools or the legacy functions, not both")
    legacy = bool(request.functions) or not isinstance(request.function_call, str | None)
    if legacy and request.tool_choice is not None:
        raise _bad("function_call", "use tool_choice or the legacy function_call, not both")
    choice_param = "function_call" if legacy else "tool_choice"
    functions = tuple(request.functions or [t.function for t in request.tools or []])
    choice = request.function_call if legacy else request.tool_choice
    mode, forced = _choice(choice, bool(functions))
    forcing = mode in ("required", "named")
    if forcing and not functions:
        raise _bad(choice_param, "it asks for a call, but no tools are given")
    if not functions:
        return None
    _check_names(functions, forced, choice_param, "functions" if legacy else "tools")
    if forcing and request.response_format and request.response_format.type != "text":
        raise _bad("response_format", f"it cannot be combined with a forced {choice_param}")
    parallel = request.parallel_tool_calls is not False and not legacy
    return ToolPlan(functions, mode, forced, parallel, legacy, parser, max_calls)


def _bad(param: str, message: str) -> APIError:
    return bad_request(f"Invalid '{param}': {message}", param=param)


def _choice(choice: Any, offered: bool) -> tuple[ToolMode, str | None]:
    """The mode and forced function of a validated tool_choice / function_call."""
    if choice is None:
        return ("auto" if offered else "none"), None
    if isinstance(choice, str):
        assert choice in ("none", "auto", "required")
        return choice, None  # type: ignore[return-value]  # checked just above
    name = choice.function.name if hasattr(choice, "function") else choice.name
    return "named", name


def _check_names(functions: Sequence[FunctionDefinition], forced: str | None,
                 choice_param: str, tools_param: str) -> None:
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        repeated = next(n for n in names if names.count(n) > 1)
        raise _bad(tools_param, f"function '{repeated}' is given twice")
    if forced is not None and forced not in names:
        raise _bad(choice_param, f"it names function '{forced}', which is not in {tools_param}")


# The prompt.

@functools.lru_cache(maxsize=16)
def template_uses_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (else the fallback shows them)."""
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def with_tools(conversation: list[dict[str, Any]], messages: Sequence[ChatMessage],
               plan: ToolPlan | None, native: bool
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The template's conversation and `tools` argument, earlier calls and results included;
    `native`: the template renders tools itself (see `template_uses_tools`)."""
    if native:
        entries = [_native_entry(e, m) for e, m in zip(conversation, messages, strict=True)]
        return entries, None if plan is None else plan.tool_dicts()
    entries = _fallback_entries(conversation, messages)
    if plan is not None:
        entries = _with_tools_block(entries, plan)
    return entries, None


def _native_entry(entry: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    calls = _earlier_calls(message)
    if calls:
        entry = {**entry, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": _arguments_object(arguments)}}
            for call_id, name, arguments in calls]}
    if message.role == "function":  # legacy: a tool result
        entry = {**entry, "role": "tool"}
    if message.tool_call_id is not None:
        entry = {**entry, "tool_call_id": message.tool_call_id}
    return entry


def _earlier_calls(message: ChatMessage) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call an assistant message made."""
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    if message.function_call is not None:
        calls.append(("call_0", message.function_call.name, message.function_call.arguments))
    return calls


def _arguments_object(arguments: str) -> Any:
    """Templates expect the arguments as an object; text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _fallback_entries(conversation: list[dict[str, Any]], messages: Sequence[ChatMessage]
                      ) -> list[dict[str, Any]]:
    """Calls as `<tool_call>` text; results as user turns (consecutive ones merged), which
    every template renders."""
    entries: list[dict[str, Any]] = []
    after_result = False  # the last entry is a user turn of tool results
    for entry, message in zip(conversation, messages, strict=True):
        if message.role in ("tool", "function"):
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if after_result:
                entries[-1]["content"] += "\n" + response
            else:
                entries.append({"role": "user", "content": response})
            after_result = True
            continue
        calls = _earlier_calls(message)
        if calls:
            text = "\n".join(_call_text(name, arguments) for _, name, arguments in calls)
            entry = {**entry, "content": f"{message.text}\n{text}" if message.text else text}
        entries.append(entry)
        after_result = False
    return entries


def _call_text(name: str, arguments: str) -> str:
    call = json.dumps({"name": name, "arguments": _arguments_object(arguments)},
                      ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _with_tools_block(entries: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The fallback's tool list, after the system message's own text or as one."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in plan.tool_dicts())
    block = FALLBACK_PROMPT.format(tools=listing)
    if entries and entries[0]["role"] == "system":
        return [{**entries[0], "content": f"{entries[0]['content']}\n\n{block}"}, *entries[1:]]
    return [{"role": "system", "content": block}, *entries]


# The output.

@dataclass
class ToolOutput:
    """What a choice says next: text, and OpenAI `tool_calls` delta entries."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ToolOutput) -> None:
        self.content += other.content
        self.calls += other.calls


class ToolStream:
    """One choice's output as content and tool-call deltas: each call gets an `index` and an
    id (`call_<random>`), its first delta carrying id, type and name; a reply that called a
    tool ends with finish_reason "tool_calls" (legacy: "function_call")."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True,
                 legacy: bool = False) -> None:
        self.parser = parser
        self.parallel = parallel
        self.legacy = legacy
        self.count = 0  # calls started
        self.dropping = False  # inside a call beyond the first when parallel calls are off
        self.after_call = False  # no text but whitespace since the last call

    def feed(self, text: str) -> ToolOutput:
        return self._output(self.parser.feed(text))

    def finish(self, reason: Ending) -> tuple[ToolOutput, Reason]:
        """The rest of the output, and the finish reason to report."""
        output = self._output(self.parser.finish())
        if self.count and reason == "stop":
            return output, "function_call" if self.legacy else "tool_calls"
        return output, reason

    def _output(self, pieces: list[Piece]) -> ToolOutput:
        output = ToolOutput()
        for piece in pieces:
            if isinstance(piece, CallPiece):
                self._add_call(output, piece)
                self.after_call = True
            else:  # no whitespace after a call, however the text came in pieces
                text = piece.lstrip() if self.after_call else piece
                self.after_call = self.after_call and not text
                output.content += text
        return output

    def _add_call(self, output: ToolOutput, piece: CallPiece) -> None:
        if piece.name is not None:
            self.dropping = self.count > 0 and not self.parallel
            if self.dropping:
                return
            self.count += 1
            output.calls.append({"index": self.count - 1, "id": f"call_{secrets.token_hex(12)}",
                                 "type": "function",
                                 "function": {"name": piece.name, "arguments": piece.arguments}})
        elif not self.dropping:
            output.calls.append({"index": self.count - 1,
                                 "function": {"arguments": piece.arguments}})

    def message_fields(self, output: ToolOutput) -> dict[str, Any]:
        """A delta's call fields: `tool_calls`, or a legacy `function_call`."""
        if not output.calls:
            return {}
        if self.legacy:
            return {"function_call": dict(output.calls[0]["function"])}
        return {"tool_calls": output.calls}

    def whole(self, text: str, reason: Ending
              ) -> tuple[str | None, dict[str, Any], Reason]:
        """A whole choice: its content (None when it only called tools), its message's call
        fields, and its finish reason."""
        output = self.feed(text)
        rest, reason_shown = self.finish(reason)
        output.extend(rest)
        calls = merge_call_deltas(output.calls)
        fields = self.message_fields(ToolOutput(calls=calls))
        if fields.get("tool_calls"):
            fields["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        content = output.content if output.content or not calls else None
        return content, fields, reason_shown


def merge_call_deltas(deltas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole calls from their deltas: arguments pieces joined, by `index`."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        index = delta["index"]
        if index not in calls:
            calls[index] = {**delta, "function": dict(delta["function"])}
        else:
            calls[index]["function"]["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object, for the APIs that give them so; {} for arguments cut
    off by the token limit (a forced call's grammar and the parsers otherwise give one)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
