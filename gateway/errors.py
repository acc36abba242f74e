"""API errors: one exception type and its HTTP response.

Every error the gateway reports to a client is an `APIError`; `error_response` turns it into
OpenAI's `{"error": {"message", "type", "param", "code"}}` with the right status code, or, on
another API's routes (`dialect_of`), into its shape: Anthropic's `{"type": "error", "error":
{"type", "message"}}`, Ollama's `{"error": message}`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from starlette.responses import JSONResponse

MAX_MESSAGE_CHARS = 1000
_MAX_PARAM_CHARS = 200


def _cap(text: str, limit: int) -> str:
    # Messages may quote user-derived text; capping keeps a huge input from being echoed back.
    return text if len(text) <= limit else text[: limit - 3] + "..."


class APIError(Exception):
    """An error reported to the client with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.message = _cap(message, MAX_MESSAGE_CHARS)
        self.type = type
        self.param = None if param is None else _cap(param, _MAX_PARAM_CHARS)
        self.code = code
        self.retry_after = retry_after
        super().__init__(self.message)

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body, its type named after the status as Anthropic names it."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def to_ollama_body(self) -> dict[str, Any]:
        """Ollama's error body: `{"error": message}`."""
        return {"error": self.message}

    def __repr__(self) -> str:
        return f"APIError(status={self.status}, type={self.type!r}, message={self.message!r})"


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_ROUTES = "/v1/messages"  # the path of Anthropic's routes, and the prefix of the rest
OLLAMA_ROUTES = "/api/"  # the prefix of Ollama's routes
Dialect = Literal["openai", "anthropic", "ollama"]


def dialect_of(path: str) -> Dialect:
    """Whose error shape errors on `path` take."""
    if path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/"):
        return "anthropic"
    return "ollama" if path.startswith(OLLAMA_ROUTES) else "openai"


def error_response(err: APIError, dialect: Dialect = "openai") -> JSONResponse:
    """The JSON response for `err` in the shape of `dialect`'s API, with `Retry-After`
    (whole seconds) when it is set."""
    headers: dict[str, str] = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(0, math.ceil(err.retry_after)))
    body = {"openai": err.to_body, "anthropic": err.to_anthropic_body,
            "ollama": err.to_ollama_body}[dialect]()
    return JSONResponse(body, status_code=err.status, headers=headers)


def whole_number(text: str) -> int | None:
    """`text` as an integer from 0 in plain ASCII digits (not "²", which str.isdigit takes
    and int refuses), or None."""
    return int(text) if text.isascii() and text.isdigit() else None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is malformed or asks for something unsupported."""
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> APIError:
    """401: no API key, or one the server does not know."""
    return APIError(401, message, "invalid_request_error", code="invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """404: unknown route or model."""
    return APIError(404, message, "not_found_error", param, code)


def method_not_allowed(message: str) -> APIError:
    """405: the route exists but not for this HTTP method."""
    return APIError(405, message, "invalid_request_error")


def payload_too_large(message: str) -> APIError:
    """413: the request body exceeds the size limit."""
    return APIError(413, message, "invalid_request_error", code="payload_too_large")


def rate_limited(message: str, retry_after: float | None = None) -> APIError:
    """429: too many requests in flight; the client should retry later."""
    return APIError(429, message, "rate_limit_error", retry_after=retry_after)


_SERVER_ERROR = "The server had an error while processing your request."


def server_error(message: str = _SERVER_ERROR) -> APIError:
    """500: an internal failure; the message must not leak internals."""
    return APIError(500, message, "server_error")


def service_unavailable(message: str, retry_after: float | None = None) -> APIError:
    """503: the server is overloaded, starting, or draining."""
    return APIError(503, message, "service_unavailable", retry_after=retry_after)
