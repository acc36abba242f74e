"""A /v1/chat/completions request, parsed and checked whole: its fields (gateway/protocol.py),
then its tools (gateway/tools.py), whose forced calls must compile into a grammar. Another
API's request becomes one through `chat_request_of`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.messages import Grammar
from gateway.errors import bad_request
from gateway.protocol import ChatCompletionRequest
from gateway.structured_outputs import grammar_problem
from gateway.tools import tool_plan
from gateway.validation import parse_body, request_of


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse a /v1/chat/completions body; any invalid body raises a 400 `APIError`."""
    request = parse_body(ChatCompletionRequest, body)
    check_tool_request(request)
    return request


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
    return request_of(ChatCompletionRequest, fields, params, check_tool_request)
