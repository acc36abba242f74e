"""Anthropic's routes: POST /v1/messages (the Messages API, streaming and not) and
/v1/messages/count_tokens, served by the OpenAI routes' machinery: a Messages request is a chat
request spelled another way (messages_request.py), answered as a Message (messages_reply.py).
Errors on these routes take Anthropic's shape (gateway/errors.py)."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.messages_request import parse_messages_request
from gateway.openai_api import OpenAIRoutes, Served
from gateway.reply import ChatFormat


class AnthropicRoutes:
    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    async def messages(self, request: Request) -> Response:
        arrived = time.monotonic()
        routes = self.routes
        body = await asyncio.to_thread(parse_messages_request, await routes.read_body(request))
        routes.ignored.check(body)
        model = routes.served_model(body.model)
        chat = await asyncio.to_thread(body.chat_request)
        prompt_ids, params, tools = await routes.chat_prompt(chat)
        return await routes.serve(request, ChatFormat(), [prompt_ids], params,
                                  Served(model, arrived, tools, anthropic=True))

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's length in tokens, as /v1/messages would render it."""
        routes = self.routes
        body = await asyncio.to_thread(parse_messages_request, await routes.read_body(request))
        routes.ignored.check(body)
        routes.served_model(body.model)
        chat = await asyncio.to_thread(body.chat_request)
        prompt_ids, _, _ = await routes.chat_prompt(chat)
        return JSONResponse({"input_tokens": len(prompt_ids)})
