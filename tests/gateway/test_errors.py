"""The error every route answers: its shape in each API's dialect, Retry-After, capped
messages."""

from __future__ import annotations

import json

import pytest

from gateway.errors import (
    Dialect,
    bad_request,
    dialect_of,
    error_response,
    rate_limited,
    service_unavailable,
)


def test_error_response_shape_and_retry_after() -> None:
    response = error_response(bad_request("bad thing", param="temperature", code="x"))
    assert response.status_code == 400
    assert json.loads(bytes(response.body)) == {
        "error": {
            "message": "bad thing",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "x",
        }
    }
    assert "retry-after" not in response.headers
    assert error_response(rate_limited("busy", retry_after=1.2)).headers["retry-after"] == "2"
    unavailable = error_response(service_unavailable("draining", retry_after=5))
    assert (unavailable.status_code, unavailable.headers["retry-after"]) == (503, "5")


def test_error_messages_are_capped() -> None:
    err = bad_request("x" * 10_000, param="p" * 10_000)
    assert len(err.message) <= 1000
    assert err.param is not None and len(err.param) <= 200
    assert str(err) == err.message


@pytest.mark.parametrize(("path", "dialect"), [
    ("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
    ("/v1/messages/count_tokens", "anthropic"), ("/v1/messagesx", "openai"),
    ("/api/chat", "ollama"), ("/api/pull", "ollama"), ("/apply-template", "openai"),
])
def test_each_route_s_errors_take_its_api_s_shape(path: str, dialect: Dialect) -> None:
    assert dialect_of(path) == dialect
    body = json.loads(bytes(error_response(bad_request("bad", param="x"), dialect).body))
    assert set(body) == {"openai": {"error"}, "anthropic": {"type", "error"},
                         "ollama": {"error"}}[dialect]
    assert body["error"] == "bad" if dialect == "ollama" else body["error"]["message"] == "bad"
