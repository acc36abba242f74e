"""Request bodies: a prompt to /v1/completions, or one user message to /v1/chat/completions."""

from __future__ import annotations

from bench.client import content_of, has_content, request_body, request_path
from bench.workloads import RequestSpec


def test_prompt_and_chat_bodies() -> None:
    prompt = RequestSpec(0, "fixed", (1, 2, 3), 3, 16)
    assert request_path(prompt) == "/v1/completions"
    body = request_body("M", prompt)
    assert body["prompt"] == [1, 2, 3] and "messages" not in body
    chat = RequestSpec(1, "message", "Request 1. Hello", 4, 16, chat=True)
    assert request_path(chat) == "/v1/chat/completions"
    body = request_body("M", chat)
    assert body["messages"] == [{"role": "user", "content": "Request 1. Hello"}]
    assert "prompt" not in body
    for sent in (request_body("M", prompt), body):
        assert sent["max_tokens"] == 16 and sent["temperature"] == 0 and sent["ignore_eos"]
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
    assert has_content({"choices": [{"delta": {"content": "a"}}]})


def test_the_text_of_a_chunk_whichever_api() -> None:
    assert content_of({"choices": [{"text": "a"}]}) == "a"
    assert content_of({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert content_of({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert content_of({"choices": []}) == ""
