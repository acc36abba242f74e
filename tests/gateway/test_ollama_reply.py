"""The pieces of an Ollama reply that need no workers: tool calls gathered from chat's shapes
and given whole, and the answer to a request with nothing to generate (the whole reply is
exercised end to end in tests/e2e/test_ollama_api.py)."""

from __future__ import annotations

from ollama import ChatResponse, GenerateResponse

from gateway.ollama_reply import CallCollector, loaded


def call_start(call_id: str, name: str, arguments: str) -> dict[str, object]:
    return {"index": 0, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def test_streamed_calls_are_given_whole_with_object_arguments() -> None:
    calls = CallCollector()
    calls.feed({"content": "Looking."})
    assert calls.whole() is None
    calls.feed({"tool_calls": [call_start("call_1", "weather", '{"city"')]})
    calls.feed({"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]})
    calls.feed({"tool_calls": [call_start("call_2", "time", "")]})
    whole = calls.whole()
    assert whole == [
        {"id": "call_1", "function": {"index": 0, "name": "weather",
                                      "arguments": {"city": "Paris"}}},
        {"id": "call_2", "function": {"index": 1, "name": "time", "arguments": {}}}]
    message = ChatResponse.model_validate({"message": {"role": "assistant", "content": "",
                                                       "tool_calls": whole}})
    assert message.message.tool_calls is not None
    assert message.message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_a_call_cut_off_mid_arguments_has_empty_arguments() -> None:
    calls = CallCollector()
    calls.feed({"tool_calls": [call_start("call_1", "weather", '{"city": "Par')]})
    assert calls.whole() == [{"id": "call_1", "function": {"index": 0, "name": "weather",
                                                            "arguments": {}}}]


def test_nothing_to_generate_loads_or_unloads() -> None:
    chat = ChatResponse(**loaded("m", "chat", unloaded=False))
    assert chat.done and chat.done_reason == "load" and chat.message.content == ""
    generated = GenerateResponse(**loaded("m", "generate", unloaded=True))
    assert generated.done_reason == "unload" and generated.response == ""
