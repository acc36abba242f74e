"""Anthropic's routes: POST /v1/messages (the Messages API, streaming and not) and
/v1/messages/count_tokens, served by the OpenAI routes' machinery: a Messages request is a chat
request spelled another way (messages_request.py), answered as a Message (messages_reply.py).
Errors on these routes take Anthropic's shape (gateway/errors.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.messages_reply import AnthropicAsk
from gateway.messages_request import MessagesRequest, parse_messages_request
from gateway.openai_api import OpenAIRoutes, Served
from gateway.protocol import ChatCompletionRequest
from gateway.reply import ChatFormat


class AnthropicRoutes:
    """Anthropic's routes, each a chat request made from the body and served by `routes`."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    async def messages(self, request: Request) -> Response:
        """A Message, streamed or whole. `max_tokens` may ask for more than the context
        leaves: the reply then stops at the context window (`model_context_window_exceeded`),
        as Anthropic's do, where chat would refuse the request."""
        arrived = time.monotonic()
        body, model, chat = await self._chat_request(request)
        prompt_ids, params, tools = await self.routes.chat_prompt(chat)
        ask = AnthropicAsk(params.max_tokens, body.thinks)
        params = dataclasses.replace(params, max_tokens=None,
                                     default_max_tokens=ask.max_tokens or params.default_max_tokens)
        return await self.routes.serve(request, ChatFormat(), [prompt_ids], params,
                                       Served(model, arrived, tools, message=ask))

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's length in tokens, as /v1/messages would render it."""
        _, _, chat = await self._chat_request(request)
        prompt_ids, _, _ = await self.routes.chat_prompt(chat)
        return JSONResponse({"input_tokens": len(prompt_ids)})

    async def _chat_request(self, request: Request
                            ) -> tuple[MessagesRequest, str, ChatCompletionRequest]:
        """The body, the served model it names, and the chat request it means."""
        routes = self.routes
        body = await asyncio.to_thread(parse_messages_request, await routes.read_body(request))
        routes.ignored.check(body)
        model = routes.served_model(body.model)
        return body, model, await asyncio.to_thread(body.chat_request)
