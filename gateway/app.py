"""The Starlette application: routes, error handling, and the control-plane tasks' lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import zmq.asyncio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.channels import ControlServer
from core.config import ROLES
from core.curve import keys_for
from gateway import auth
from gateway.anthropic_api import AnthropicRoutes
from gateway.cluster import cluster_route
from gateway.dispatch import Dispatcher
from gateway.embeddings import Embedder, EmbeddingRoutes
from gateway.errors import (
    APIError,
    dialect_of,
    error_response,
    method_not_allowed,
    not_found,
    server_error,
)
from gateway.llamacpp_api import LlamaCppRoutes
from gateway.ollama_api import OllamaRoutes
from gateway.openai_api import OpenAIRoutes
from gateway.page import page_routes
from gateway.request_id import RequestIdMiddleware
from gateway.state import GatewayState, server_version

log = logging.getLogger(__name__)


def build_app(state: GatewayState) -> Starlette:
    """The gateway's app; raises auth.KeysError when the configured API keys are unusable."""
    keys = auth.load_keys(state.config.auth)
    auth.log_auth_state(state.config.gateway.host, keys)
    routes, service = OpenAIRoutes(state), ServiceRoutes(state)
    anthropic, llamacpp = AnthropicRoutes(routes), LlamaCppRoutes(routes)
    ollama = OllamaRoutes(routes)
    embeddings = EmbeddingRoutes(Embedder(routes))
    return Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/responses", routes.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", routes.response, methods=["GET"]),
            Route("/v1/responses/{response_id}", routes.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", routes.cancel_response,
                  methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", routes.response_input_items,
                  methods=["GET"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
            Route("/completion", llamacpp.completion, methods=["POST"]),
            Route("/completions", llamacpp.completion, methods=["POST"]),
            Route("/infill", llamacpp.infill, methods=["POST"]),
            Route("/embedding", llamacpp.embedding, methods=["POST"]),
            Route("/embeddings", llamacpp.embedding, methods=["POST"]),
            Route("/props", llamacpp.props, methods=["GET"]),
            Route("/apply-template", llamacpp.apply_template, methods=["POST"]),
            Route("/api/chat", ollama.chat, methods=["POST"]),
            Route("/api/generate", ollama.generate, methods=["POST"]),
            Route("/api/embed", ollama.embed, methods=["POST"]),
            Route("/api/embeddings", ollama.embeddings, methods=["POST"]),
            Route("/api/tags", ollama.tags, methods=["GET"]),
            Route("/api/show", ollama.show, methods=["POST"]),
            Route("/api/ps", ollama.ps, methods=["GET"]),
            Route("/api/version", ollama.version, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/version", service.version, methods=["GET"]),
            Route("/ping", service.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) probe
            Route("/health", service.health, methods=["GET"]),
            Route("/metrics", service.metrics, methods=["GET"]),
            Route("/v1/cluster", cluster_route(state), methods=["GET"]),
            Route("/admin/drain/{worker}", service.drain, methods=["POST"]),
            *page_routes(),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error,
                            ClientDisconnect: _client_gone, Exception: _unexpected_error},
        middleware=[Middleware(RequestIdMiddleware),
                    *_cors(state.config.gateway.allowed_origins), *auth.middleware(keys)],
        lifespan=_lifespan(state),
    )


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Answers browsers' preflight requests and marks replies readable by pages of `origins`;
    outside the API key check, so that a preflight (which carries no key) is answered."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"])]


class ServiceRoutes:
    """The routes about the server itself: /health (and /ping), /metrics, /version."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def health(self, request: Request) -> Response:
        if not self.state.control_plane_up():
            return JSONResponse({"status": "control plane stopped"}, status_code=503)
        registry = self.state.registry
        status = registry.health()
        stalled = sorted(w.worker_id for w in registry.workers.values() if w.stalled)
        draining = sorted(w.worker_id for w in registry.workers.values() if w.draining)
        body = {"status": status, "prefill": len(registry.serving("prefill")),
                "decode": len(registry.serving("decode")), "stalled": stalled,
                "draining": draining}
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    async def metrics(self, request: Request) -> Response:
        dispatcher = self.state.dispatcher
        desired = {role: self.state.autoscaler.desired(role) for role in ROLES}
        text = self.state.metrics.render(self.state.registry, self.state.router,
                                         dispatcher.control.dropped, dispatcher.aborts_sent,
                                         dispatcher.resumed,
                                         rejected_peers=dispatcher.control.rejected_peers,
                                         desired=desired)
        return Response(text, media_type="text/plain; version=0.0.4")

    async def drain(self, request: Request) -> Response:
        """`POST /admin/drain/{worker}`: the worker takes no new work, finishes what it holds
        and leaves (202; 404 for a worker not registered)."""
        worker_id = request.path_params["worker"]
        worker = self.state.dispatcher.drain(worker_id, "POST /admin/drain")
        if worker is None:
            raise not_found(f"no worker {worker_id[:100]!r} is registered")
        return JSONResponse({"worker": worker.worker_id, "role": worker.role,
                             "state": "draining", "requests": len(worker.active)},
                            status_code=202)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": server_version()})


def _lifespan(state: GatewayState) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The control plane's tasks, started with the app and stopped with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        context = zmq.asyncio.Context()
        keys = keys_for(state.config.internal)
        control = ControlServer(context, state.config.gateway.control_address, keys)
        metrics = state.metrics
        state.dispatcher = Dispatcher(control, state.router, metrics.observe_stage,
                                      metrics.observe_route, metrics.count_message,
                                      state.config.gateway.worker_wait_s)
        state.control_tasks[:] = [asyncio.create_task(state.dispatcher.serve()),
                                  asyncio.create_task(state.dispatcher.watch_liveness())]
        if keys is not None:
            state.control_tasks.append(asyncio.create_task(control.watch_rejections()))
        for task in state.control_tasks:
            task.add_done_callback(_report_stopped)
        try:
            yield
        finally:
            await state.background.cancel_all()
            for task in state.control_tasks:
                task.cancel()
            control.close()
            context.term()
            if state.tracer is not None:
                state.tracer.shutdown()

    return lifespan


def _report_stopped(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("control-plane task failed; /health now reports 503",
                     exc_info=task.exception())


def _error_response(request: Request, err: APIError) -> JSONResponse:
    """`err` in the shape of the route's API: OpenAI's, or Anthropic's or Ollama's on
    theirs."""
    return error_response(err, dialect_of(request.url.path))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        response = _error_response(request,
                                   method_not_allowed(f"{request.method} is not allowed here"))
        response.headers.update(exc.headers or {})  # Allow: the methods that are
        return response
    if exc.status_code == 404:
        return _error_response(request, not_found(f"no route {request.url.path[:200]}"))
    return _error_response(request, APIError(exc.status_code, str(exc.detail),
                                             "invalid_request_error"))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # the client left while sending its request


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(request, server_error())
