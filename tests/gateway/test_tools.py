"""Tool plans, the grammar of forced calls, the prompt (native and fallback), and ToolStream."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from xgrammar.testing import _is_grammar_accept_string

from engine.weights.tokenizer import decode_text
from gateway.chat_request import parse_chat_request
from gateway.errors import APIError
from gateway.prompts import render_chat_prompt
from gateway.tool_parsers import HermesParser, NamedParser, RequiredParser
from gateway.tools import (
    FALLBACK_PROMPT,
    ToolPlan,
    ToolStream,
    merge_call_deltas,
    template_uses_tools,
    tool_plan,
)

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
ASKED = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
ANSWERED = [{"role": "tool", "tool_call_id": "call_a", "content": "22 C, sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": "noon"}]
NATIVE_TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city or '-' }}{% endfor %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def request(**fields: Any) -> Any:
    body = {"model": "m", "messages": [ASKED], **fields}
    return parse_chat_request(json.dumps(body).encode())


def plan(parser: str = "", **fields: Any) -> ToolPlan:
    made = tool_plan(request(**fields), parser)  # type: ignore[arg-type]  # a config name
    assert made is not None
    return made


@pytest.fixture(scope="module")
def native_tokenizer(real_model_dir: Path) -> PreTrainedTokenizerBase:
    made = AutoTokenizer.from_pretrained(real_model_dir)
    made.chat_template = NATIVE_TEMPLATE
    return made


def test_the_modes_of_tool_choice() -> None:
    assert plan(tools=[WEATHER]).mode == "auto"  # OpenAI's default when tools are given
    assert plan(tools=[WEATHER], tool_choice="none").mode == "none"
    assert plan(tools=[WEATHER], tool_choice="required").mode == "required"
    named = plan(tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.forced, named.parallel) == ("named", "get_time", True)
    assert not plan(tools=[WEATHER], parallel_tool_calls=False).parallel
    assert tool_plan(request()) is None
    assert tool_plan(request(tools=[], tool_choice="none")) is None


def test_legacy_functions_are_tools_answered_as_function_call() -> None:
    legacy = plan(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert (legacy.mode, legacy.forced, legacy.legacy, legacy.parallel) == (
        "named", "get_weather", True, False)
    assert plan(functions=[WEATHER["function"]]).mode == "auto"
    assert plan(functions=[WEATHER["function"]], function_call="none").mode == "none"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"functions": [TIME["function"]], "function_call": {"name": "x"}}, "function_call"),
    ({"tools": [TIME, TIME]}, "tools"),
    ({"tools": [WEATHER], "functions": [TIME["function"]]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_inconsistent_tool_fields_are_400_naming_the_field(
        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        request(**fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert f"'{param}'" in caught.value.message


def accepts(grammar: str, output: Any) -> bool:
    compiled = xgrammar.Grammar.from_json_schema(grammar, any_whitespace=False,
                                                 strict_mode=True)
    return bool(_is_grammar_accept_string(compiled, json.dumps(output)))


def test_required_grammar_takes_calls_of_offered_functions_only() -> None:
    forced = plan(tools=[WEATHER, TIME], tool_choice="required")
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            {"name": "get_time", "arguments": {}}]
    bad = [[], [{"name": "get_weather", "arguments": {}}],
           [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}],
           [{"name": "get_news", "arguments": {}}], [{"name": "get_time"}],
           {"name": "get_time", "arguments": {}}]
    schema = json.loads(forced.grammar)
    jsonschema.validate(good, schema)
    assert accepts(forced.grammar, good) and accepts(forced.grammar, good[:1])
    for output in bad:
        assert not accepts(forced.grammar, output), output
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(output, schema)


def test_without_parallel_calls_the_grammar_takes_one_call() -> None:
    single = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    one = [{"name": "get_time", "arguments": {}}]
    assert accepts(single.grammar, one) and not accepts(single.grammar, one * 2)


def test_max_calls_bounds_the_required_array() -> None:
    made = tool_plan(request(tools=[TIME], tool_choice="required"), max_calls=2)
    assert made is not None
    call = {"name": "get_time", "arguments": {}}
    assert accepts(made.grammar, [call, call]) and not accepts(made.grammar, [call] * 3)
    assert accepts(plan(tools=[TIME], tool_choice="required").grammar, [call] * 9)  # 0: free


def test_named_grammar_is_the_functions_arguments() -> None:
    named = plan(tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.grammar) == WEATHER["function"]["parameters"]
    assert accepts(named.grammar, {"city": "Paris"})
    assert not accepts(named.grammar, {"unit": "c"})
    no_arguments = plan(tools=[TIME], tool_choice={"type": "function",
                                                   "function": {"name": "get_time"}})
    assert accepts(no_arguments.grammar, {}) and not accepts(no_arguments.grammar, {"a": 1})


def test_auto_and_none_constrain_nothing() -> None:
    assert plan(tools=[WEATHER]).grammar == ""
    assert plan(tools=[WEATHER], tool_choice="none").grammar == ""


def test_a_forced_call_of_an_uncompilable_schema_is_400() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "pattern": "[a"}}}
    with pytest.raises(APIError) as caught:
        request(tools=[bad], tool_choice="required")
    assert caught.value.param == "tools" and "JSON schema" in caught.value.message
    assert plan(tools=[bad]).mode == "auto"  # shown to the model only: no grammar to build


def rendered(tokenizer: PreTrainedTokenizerBase, **fields: Any) -> str:
    parsed = request(**fields)
    made = tool_plan(parsed)
    return decode_text(tokenizer, render_chat_prompt(tokenizer, parsed.messages, tools=made))


def test_the_fallback_lists_the_tools_in_a_system_block(
        tokenizer: PreTrainedTokenizerBase) -> None:
    assert not template_uses_tools(tokenizer.chat_template)
    text = rendered(tokenizer, tools=[WEATHER, TIME])
    listing = "\n".join(json.dumps(tool) for tool in [WEATHER, TIME])
    assert text.startswith(f"<|im_start|>system\n{FALLBACK_PROMPT.format(tools=listing)}"
                           "<|im_end|>\n<|im_start|>user\nWeather in Paris?")
    with_system = rendered(tokenizer, tools=[TIME], messages=[
        {"role": "system", "content": "Be brief."}, ASKED])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert with_system.count("<|im_start|>system") == 1


def test_the_fallback_renders_calls_and_results_in_text(
        tokenizer: PreTrainedTokenizerBase) -> None:
    text = rendered(tokenizer, tools=[WEATHER, TIME], messages=[ASKED, CALLED, *ANSWERED])
    turns = text.split("<|im_start|>")
    assert turns[-3] == (
        'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n")
    assert turns[-2] == ("user\n<tool_response>\n22 C, sunny\n</tool_response>\n"
                         "<tool_response>\nnoon\n</tool_response><|im_end|>\n")
    assert turns[-1] == "assistant\n"


def test_calls_and_results_render_without_tools_offered(
        tokenizer: PreTrainedTokenizerBase) -> None:
    text = rendered(tokenizer, messages=[ASKED, {**CALLED, "content": "Checking."},
                                         ANSWERED[0]])
    assert "# Tools" not in text
    assert "assistant\nChecking.\n<tool_call>\n" in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text


def test_legacy_function_messages_render_as_calls_and_results(
        tokenizer: PreTrainedTokenizerBase) -> None:
    text = rendered(tokenizer, functions=[WEATHER["function"]], messages=[
        ASKED, {"role": "assistant", "function_call": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "rain"}])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nrain\n</tool_response>" in text


def test_a_template_that_uses_tools_gets_them_natively(
        native_tokenizer: PreTrainedTokenizerBase) -> None:
    assert template_uses_tools(NATIVE_TEMPLATE)
    text = rendered(native_tokenizer, tools=[WEATHER, TIME],
                    messages=[ASKED, CALLED, *ANSWERED])
    assert text == ("TOOL get_weather\nTOOL get_time\n[user] Weather in Paris?\n"
                    "[assistant]  CALL call_a get_weather Paris CALL call_b get_time -\n"
                    "[tool] 22 C, sunny FOR call_a\n[tool] noon FOR call_b\n[assistant]")


def stream_all(stream: ToolStream, chunks: list[str], reason: Any = "stop"
               ) -> tuple[list[dict[str, Any]], str, Any]:
    deltas: list[dict[str, Any]] = []
    content = ""
    for chunk in chunks:
        out = stream.feed(chunk)
        deltas += out.calls
        content += out.content
    out, shown = stream.finish(reason)
    return deltas + out.calls, content + out.content, shown


def test_stream_numbers_calls_and_names_them_on_their_first_delta() -> None:
    output = ('Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    deltas, content, reason = stream_all(ToolStream(HermesParser()), list(output))
    assert content == "Sure. " and reason == "tool_calls"
    assert [d["index"] for d in deltas] == [0, 1]
    for delta in deltas:
        assert re.fullmatch(r"call_[0-9a-f]{24}", delta["id"]) and delta["type"] == "function"
    assert [d["function"] for d in deltas] == [
        {"name": "get_time", "arguments": "{}"},
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]


def test_stream_of_named_call_streams_arguments() -> None:
    deltas, content, reason = stream_all(ToolStream(NamedParser("get_weather")),
                                         ['{"city"', ': "Oslo"}'])
    assert content == "" and reason == "tool_calls"
    assert set(deltas[0]) == {"index", "id", "type", "function"}
    assert deltas[1] == {"index": 0, "function": {"arguments": ': "Oslo"}'}}
    merged = merge_call_deltas(deltas)
    assert merged[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    output = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    deltas, _, _ = stream_all(ToolStream(RequiredParser(), parallel=False), [output])
    assert len(deltas) == 1


def test_a_reply_cut_short_keeps_its_finish_reason_and_text() -> None:
    deltas, content, reason = stream_all(ToolStream(RequiredParser()), ['[{"name": "get_'],
                                         "length")
    assert (deltas, content, reason) == ([], '[{"name": "get_', "length")
    no_call = ToolStream(HermesParser())
    assert no_call.whole("Just text.", "stop") == ("Just text.", {}, "stop")


def test_a_reply_cut_in_a_repeated_call_keeps_the_calls_it_completed() -> None:
    call = '{"name": "get_time", "arguments": {}}'
    deltas, content, reason = stream_all(ToolStream(RequiredParser()),
                                         [f"[{call}, {call}, {call[:12]}"], "length")
    assert (len(deltas), content, reason) == (2, "", "length")


def test_text_after_a_call_is_the_same_streamed_or_whole() -> None:
    output = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n Done.\n'
    whole, _, _ = ToolStream(HermesParser()).whole(output, "stop")
    assert whole == "Done.\n"
    for chunks in ([output], list(output), [output[:-7], output[-7:-5], output[-5:]]):
        _, content, _ = stream_all(ToolStream(HermesParser()), chunks)
        assert content == whole, chunks


def test_whole_reply_has_null_content_and_whole_calls() -> None:
    content, fields, reason = ToolStream(HermesParser()).whole(
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop")
    assert content is None and reason == "tool_calls"
    [call] = fields["tool_calls"]
    assert set(call) == {"id", "type", "function"}
    assert call["function"] == {"name": "get_time", "arguments": "{}"}


def test_legacy_reply_is_a_function_call() -> None:
    content, fields, reason = ToolStream(NamedParser("get_time"), legacy=True).whole(
        "{}", "stop")
    assert (content, fields, reason) == (
        None, {"function_call": {"name": "get_time", "arguments": "{}"}}, "function_call")
