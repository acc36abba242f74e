"""Ollama's routes, for the tools and chat UIs written against an Ollama server: `POST
/api/chat` and `POST /api/generate`, served as chat (or, for a raw prompt, completion) requests
(ollama_request.py) answered in Ollama's shape (ollama_reply.py); `GET /api/tags`, `POST
/api/show`, `GET /api/ps` and `GET /api/version`, what the server serves; `POST /api/embed`
and the older `POST /api/embeddings`, texts' vectors (gateway/embeddings.py). Errors on these
routes are Ollama's `{"error": message}`. Models are not pulled, created, copied or deleted
here: those routes are 404s.

Ollama names a model `name:tag`; a served name is listed as `name:latest`, and a request may
give it with that tag or without.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.embedding_request import OllamaEmbeddingsRequest, OllamaEmbedRequest, normalized
from gateway.embeddings import Embedder, json_reply
from gateway.errors import bad_request
from gateway.infill import Gap
from gateway.model_facts import ModelFacts
from gateway.ollama_reply import OllamaAsk, loaded, nanoseconds
from gateway.ollama_request import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    parse_ollama_chat,
    parse_ollama_generate,
)
from gateway.openai_api import OLLAMA_TAG, OpenAIRoutes, Served
from gateway.params import GenerationParams, generation_params
from gateway.prompts import tokenize_prompt
from gateway.reply import ChatFormat, CompletionFormat, Format
from gateway.state import server_version, utc_text
from gateway.validation import RequestModel, parse_body

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API these routes follow
_KEPT_UNTIL = "2318-08-23T00:00:00Z"  # /api/ps's expiry of a model that is never unloaded


class ShowRequest(RequestModel):
    """`POST /api/show`'s body: the model, under Ollama's name for it or its older one."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None  # ignored: the model_info given is all there is


class OllamaRoutes:
    """Ollama's routes over `routes`, the OpenAI routes' machinery."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self.state = routes.state
        self.embedder = Embedder(routes)

    async def chat(self, request: Request) -> Response:
        """A chat reply, streamed (by default) or whole; no messages: the model 'loads'."""
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_ollama_chat, await self.routes.read_body(request))
        self.routes.ignored.check(body)
        model = self._echoed(body.model)
        self._check_capabilities(body)  # first, as Ollama's: a load says the model can
        if not body.messages:
            return JSONResponse(loaded(model, "chat", body.unloads))
        chat = await asyncio.to_thread(body.chat_request)
        prompt_ids, params, tools = await self.routes.chat_prompt(chat)
        params = _length(params, body.settings.predict)
        return await self.routes.serve(request, ChatFormat(), [prompt_ids], params,
                                       Served(model, arrived, tools,
                                              ollama=OllamaAsk("chat", arrived)))

    async def generate(self, request: Request) -> Response:
        """A completion of `prompt`, under the chat template unless `raw`, after the tokens of
        `context`; no prompt: the model 'loads'."""
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_ollama_generate,
                                       await self.routes.read_body(request))
        self.routes.ignored.check(body)
        model = self._echoed(body.model)
        self._check_capabilities(body)
        if not body.prompt:
            return JSONResponse(loaded(model, "generate", body.unloads))
        fmt, prompt_ids, params = await self._prompt(body)
        prompt_ids = [*tokenize_prompt(self.state.tokenizer, body.context or []), *prompt_ids]
        params = _length(params, body.settings.predict)
        ask = OllamaAsk("generate", arrived, tuple(prompt_ids))
        return await self.routes.serve(request, fmt, [prompt_ids], params,
                                       Served(model, arrived, ollama=ask))

    async def _prompt(self, body: OllamaGenerateRequest
                      ) -> tuple[Format, list[int], GenerationParams]:
        """The prompt's format, token ids and parameters: a chat's, a raw completion's, or a
        middle's between the prompt and the suffix."""
        if body.suffix:
            completion = await asyncio.to_thread(body.completion_request)
            params = self.routes.fill_params(
                generation_params(completion, self.state.generation_defaults), "suffix")
            return CompletionFormat(), await self.routes.fill_prompt_ids(
                Gap(body.prompt, body.suffix)), params
        if not body.raw:
            chat = await asyncio.to_thread(body.chat_request)
            prompt_ids, params, _ = await self.routes.chat_prompt(chat)
            return ChatFormat(), prompt_ids, params
        completion = await asyncio.to_thread(body.completion_request)
        prompt_ids = await self.routes.tokenize_with(tokenize_prompt, body.prompt)
        return CompletionFormat(), prompt_ids, generation_params(
            completion, self.state.generation_defaults)

    async def embed(self, request: Request) -> Response:
        """`POST /api/embed`: each input's vector, normalized; an input longer than the
        context is cut to it unless `truncate` is false; `dimensions` above the model's are
        all of them, as Ollama takes them. No input: the model 'loads'."""
        started = time.monotonic()
        body = await self.embedder.body(request, OllamaEmbedRequest)
        model = self._echoed(body.model)
        hidden = self.embedder.hidden_size
        size = min(body.dimensions, hidden) if body.dimensions and body.dimensions > 0 else hidden
        prompts = await self.embedder.token_ids(body.inputs)
        if body.truncate:
            prompts = [ids[:self.embedder.room()] for ids in prompts]
        vectors = await self.embedder.vectors(request, "ollama_embed", prompts,
                                              started) if prompts else []
        took = nanoseconds(time.monotonic() - started)
        return await json_reply(lambda: {
            "model": model, "embeddings": [normalized(v[:size]).tolist() for v in vectors],
            "total_duration": took, "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids in prompts)})

    async def embeddings(self, request: Request) -> Response:
        """`POST /api/embeddings`, the older route: one prompt's vector, not normalized (cut
        to the context); no prompt: an empty one."""
        arrived = time.monotonic()
        body = await self.embedder.body(request, OllamaEmbeddingsRequest)
        self.routes.served_model(body.model)
        if not body.prompt:
            return JSONResponse({"embedding": []})
        (prompt_ids,) = await self.embedder.token_ids([body.prompt])
        prompt_ids = prompt_ids[:self.embedder.room()]
        (vector,) = await self.embedder.vectors(request, "ollama_embeddings", [prompt_ids],
                                                arrived)
        return await json_reply(lambda: {"embedding": vector.tolist()})

    async def tags(self, request: Request) -> Response:
        """The served models, as Ollama lists those it has."""
        return JSONResponse({"models": [self._listed(name) for name in self.state.served_names]})

    async def ps(self, request: Request) -> Response:
        """The served models while decode workers serve them (Ollama's loaded models)."""
        if not self.state.registry.serving("decode"):
            return JSONResponse({"models": []})
        running = [{**self._listed(name), "expires_at": _KEPT_UNTIL, "size_vram": 0,
                    "context_length": self.routes.context_limit()}
                   for name in self.state.served_names]
        return JSONResponse({"models": running})

    async def show(self, request: Request) -> Response:
        """A model's details, template, default parameters and architecture."""
        body = parse_body(ShowRequest, await self.routes.read_body(request))
        self.routes.ignored.check(body)
        asked = body.model or body.name
        if asked is None:
            raise bad_request("model is required", param="model")
        name = self.routes.served_model(asked)
        facts = self._facts()
        return JSONResponse({
            "license": "", "modelfile": f"# served by raging\nFROM {self.state.model_name}\n",
            "parameters": self._parameters(),
            "template": getattr(self.state.tokenizer, "chat_template", None) or "",
            "details": _details(facts), "model_info": self._model_info(facts),
            "capabilities": self._capabilities(), "modified_at": utc_text(facts.modified_at),
            "model": _tagged(name)})

    async def version(self, request: Request) -> Response:
        """The version of Ollama's API these routes follow (clients gate features on it), and
        raging's own beside it."""
        return JSONResponse({"version": OLLAMA_API_VERSION, "raging": server_version()})

    def _echoed(self, model: str | None) -> str:
        """The model name a reply echoes: the request's own (a served one), or the first
        served name, tagged, where it gave none."""
        served = self.routes.served_model(model)
        return model if model is not None else _tagged(served)

    def _check_capabilities(self, body: OllamaChatRequest | OllamaGenerateRequest) -> None:
        """400s as Ollama's for a model that cannot: thinking without a reasoning parser,
        tools without a tool-call parser (their calls could only come back as text), any text
        from an embedding model."""
        gateway, name = self.state.config.gateway, self._echoed(body.model)
        if not self._facts().generates:
            kind = "chat" if isinstance(body, OllamaChatRequest) else "generate"
            raise bad_request(f"'{name}' does not support {kind}", param="model")
        if isinstance(body, OllamaGenerateRequest) and body.suffix and self.state.fill is None:
            raise bad_request(f"'{name}' does not support insert", param="suffix")
        if body.think not in (None, False) and not gateway.reasoning_parser:
            raise bad_request(f"'{name}' does not support thinking (the gateway runs no "
                              "reasoning parser)", param="think")
        tools = body.tools if isinstance(body, OllamaChatRequest) else None
        if tools and not gateway.tool_call_parser:
            raise bad_request(f"'{name}' does not support tools (the gateway runs no tool-call "
                              "parser)", param="tools")

    def _facts(self) -> ModelFacts:
        facts = self.state.facts
        assert facts is not None, "the gateway app knows its model"
        return facts

    def _listed(self, name: str) -> dict[str, Any]:
        facts = self._facts()
        return {"name": _tagged(name), "model": _tagged(name),
                "modified_at": utc_text(facts.modified_at), "size": facts.weights_bytes,
                "digest": facts.digest.removeprefix("sha256:"), "details": _details(facts)}

    def _parameters(self) -> str:
        """The sampling defaults a request gets, one `name value` per line, as a Modelfile's."""
        defaults = self.state.generation_defaults
        return "\n".join(f"{name} {value}" for name, value in (
            ("temperature", defaults.temperature), ("top_k", defaults.top_k),
            ("top_p", defaults.top_p), ("min_p", defaults.min_p),
            ("repeat_penalty", defaults.repetition_penalty),
            ("num_predict", defaults.max_tokens)))

    def _model_info(self, facts: ModelFacts) -> dict[str, Any]:
        """The architecture, under the GGUF metadata keys Ollama gives (the context is the
        one a request meets)."""
        spec, family = facts.spec, facts.family
        return {"general.architecture": family, "general.basename": self.state.model_name,
                "general.parameter_count": facts.parameter_count,
                f"{family}.context_length": self.routes.context_limit(),
                f"{family}.embedding_length": spec.hidden_size,
                f"{family}.block_count": spec.num_layers,
                f"{family}.feed_forward_length": spec.intermediate_size,
                f"{family}.attention.head_count": spec.num_heads,
                f"{family}.attention.head_count_kv": spec.num_kv_heads,
                f"{family}.attention.key_length": spec.head_dim,
                f"{family}.attention.value_length": spec.head_dim,
                f"{family}.attention.layer_norm_rms_epsilon": spec.rms_norm_eps,
                f"{family}.rope.freq_base": spec.rope_theta,
                f"{family}.vocab_size": spec.vocab_size}

    def _capabilities(self) -> list[str]:
        """completion, with tools where a tool-call parser runs, thinking where a reasoning
        one does and insert (a `suffix`) where the model can fill in the middle; embedding
        alone for an embedding model without an output head."""
        if not self._facts().generates:
            return ["embedding"]
        gateway = self.state.config.gateway
        return ["completion", *(["tools"] if gateway.tool_call_parser else []),
                *(["insert"] if self.state.fill else []),
                *(["thinking"] if gateway.reasoning_parser else [])]


def _length(params: GenerationParams, predict: int | None) -> GenerationParams:
    """`num_predict` is a cap: the reply stops at the context instead, as Ollama's does."""
    if predict is None:
        return params
    return dataclasses.replace(params, max_tokens=None, default_max_tokens=predict)


def _details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": facts.family,
            "families": [facts.family], "parameter_size": facts.parameter_size,
            "quantization_level": facts.precision}


def _tagged(name: str) -> str:
    return name if ":" in name else name + OLLAMA_TAG
