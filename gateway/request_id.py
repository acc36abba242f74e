"""Every reply carries an `X-Request-Id`, as OpenAI's do (its official clients keep it, as
`response._request_id`, for logs and support): the client's own where it sent a sane one, else a
fresh one. It is only a label: the server names requests itself, so two requests with the same
id never share state."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"


class RequestIdMiddleware:
    """Adds the request's id to its reply's headers (streamed or whole, an error too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = client_request_id(Headers(scope=scope)) or f"req_{uuid.uuid4().hex}"

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(headers: Headers) -> str | None:
    """The client's X-Request-Id, if it is a sane one (printable ASCII, at most 128)."""
    value = headers.get(HEADER, "")
    if 0 < len(value) <= 128 and value.isascii() and value.isprintable():
        return value
    return None
