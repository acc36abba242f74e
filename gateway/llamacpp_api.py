"""llama.cpp's native routes, for the tools written against its server: `POST /completion`
(and `/completions`), served as a /v1/completions request (llamacpp_request.py) answered in
llama.cpp's shape (llamacpp_reply.py), and `POST /infill`, code's fill in the middle, answered
alike; `GET /props`, what the server is and does; and
`POST /apply-template`; `POST /embedding` (and `/embeddings`), texts' vectors
(gateway/embeddings.py). Its /tokenize and /detokenize bodies are read by the OpenAI routes'
own."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.weights.tokenizer import decode_text
from gateway.embedding_request import LlamaEmbeddingRequest, normalized
from gateway.embeddings import Embedder, json_reply
from gateway.errors import bad_request
from gateway.llamacpp_reply import LlamaAsk
from gateway.llamacpp_request import (
    LlamaCompletionRequest,
    parse_llamacpp_infill,
    parse_llamacpp_request,
)
from gateway.openai_api import OpenAIRoutes, Served
from gateway.params import GenerationParams, generation_params
from gateway.prompts import render_chat_text, tokenize_prompt
from gateway.protocol import TokenizeRequest, parse_tokenize_request
from gateway.reply import CompletionFormat
from gateway.state import server_version


class LlamaCppRoutes:
    """llama.cpp's routes over `routes`, the OpenAI routes' machinery."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self.state = routes.state
        self.embedder = Embedder(routes)

    async def completion(self, request: Request) -> Response:
        """A completion, streamed or whole, of each prompt (a string or token ids)."""
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_llamacpp_request,
                                       await self.routes.read_body(request))
        self.routes.ignored.check(body)
        model = self.routes.served_model(body.model)
        prompts = [await self.routes.tokenize_with(tokenize_prompt, prompt)
                   for prompt in body.prompt]
        params = await self._params(body)
        texts = [prompt if isinstance(prompt, str) else await self.routes.tokenize_with(
            decode_text, ids) for prompt, ids in zip(body.prompt, prompts, strict=True)]
        ask = LlamaAsk(tuple(texts), self._settings(params, body), bool(body.n_probs),
                       body.return_tokens, prompt_only=body.predict == 0)
        return await self.routes.serve(request, CompletionFormat(), prompts, params,
                                       Served(model, arrived, llamacpp=ask))

    async def infill(self, request: Request) -> Response:
        """The middle between `input_prefix` (and `prompt`) and `input_suffix`
        (gateway/infill.py), in `/completion`'s shape. What does not fit the context, less
        room for `n_predict` tokens (a quarter of the context at most), is left out: the other
        files first, then the prefix's start and the suffix's end."""
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_llamacpp_infill,
                                       await self.routes.read_body(request))
        self.routes.ignored.check(body)
        model = self.routes.served_model(body.model)
        params = self.routes.fill_params(await self._params(body), "input_suffix")
        context = self.routes.context_limit()
        reserved = min(body.predict or context, context // 4)
        prompt_ids = await self.routes.fill_prompt_ids(body.gap, context - reserved)
        text = await self.routes.tokenize_with(decode_text, prompt_ids)
        ask = LlamaAsk((text,), self._settings(params, body), bool(body.n_probs),
                       body.return_tokens, route="infill", prompt_only=body.predict == 0)
        return await self.routes.serve(request, CompletionFormat(), [prompt_ids], params,
                                       Served(model, arrived, llamacpp=ask))

    async def _params(self, body: LlamaCompletionRequest) -> GenerationParams:
        """What to generate: the request as /v1/completions reads it, `n_predict` a cap (the
        completion stops at the context instead), `n_indent` and `t_max_predict_ms` its
        limits on lines."""
        completion = body.completion_request(await self._bias(body))
        params = dataclasses.replace(generation_params(completion, self.state.generation_defaults),
                                     line_limits=body.line_limits)
        if not body.predict:  # up to the cap, or the prompt alone
            return params
        return dataclasses.replace(params, default_max_tokens=body.predict)

    async def embedding(self, request: Request) -> Response:
        """Each input's vector, normalized as `embd_normalize` says, in llama.cpp's shape: a
        list of `{index, embedding}`, the embedding a list of one vector (the pooled one)."""
        arrived = time.monotonic()
        body = await self.embedder.body(request, LlamaEmbeddingRequest)
        self.routes.served_model(body.model)
        prompts = await self.embedder.token_ids(body.inputs, body.add_special)
        vectors = await self.embedder.vectors(request, "embedding", prompts, arrived)
        norm = body.embd_normalize
        return await json_reply(lambda: [
            {"index": index, "embedding": [normalized(vector, norm).tolist()]}
            for index, vector in enumerate(vectors)])

    async def props(self, request: Request) -> Response:
        """What llama.cpp's clients read of its server: the context and sampling defaults,
        the slots (sequences the decode workers run at once), the chat template."""
        tokenizer = self.state.tokenizer
        defaults = self.state.generation_defaults
        params = {"temperature": defaults.temperature, "top_k": defaults.top_k,
                  "top_p": defaults.top_p, "min_p": defaults.min_p,
                  "repeat_penalty": defaults.repetition_penalty,
                  "n_predict": defaults.max_tokens, "seed": -1}
        slots = sum(w.max_running for w in self.state.registry.alive("decode"))
        return JSONResponse({
            "default_generation_settings": {"n_ctx": self.routes.context_limit(),
                                            "params": params},
            "total_slots": slots, "model_alias": self.state.served_names[0],
            "model_path": self.state.model_name,
            "modalities": {"vision": False, "audio": False},
            "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or "",
            "build_info": f"raging {server_version()}"})

    async def apply_template(self, request: Request) -> Response:
        """llama.cpp's `POST /apply-template`: `messages` under the chat template, as text."""
        body = parse_tokenize_request(await self.routes.read_body(request))
        self.routes.ignored.check(body)
        if body.messages is None:
            raise bad_request("apply-template takes messages", param="messages")
        text = await self.routes.tokenize_with(_template_text, body)
        return JSONResponse({"prompt": text})

    async def _bias(self, body: LlamaCompletionRequest) -> dict[int, float]:
        """The bias of each token: a text's goes to every one of its tokens."""
        bias: dict[int, float] = {}
        for key, value in body.bias_entries():
            tokens = [key] if isinstance(key, int) else await self.routes.tokenize_with(
                _text_tokens, key)
            bias.update((token, value) for token in tokens)
        return bias

    def _settings(self, params: GenerationParams, body: LlamaCompletionRequest
                  ) -> dict[str, Any]:
        """The `generation_settings` echoed: the sampling the request got."""
        return {"n_predict": -1 if body.predict is None else body.predict,
                "seed": -1 if params.seed is None else params.seed,
                "temperature": params.temperature, "top_k": params.top_k,
                "top_p": params.top_p, "min_p": params.min_p,
                "repeat_penalty": params.repetition_penalty,
                "presence_penalty": params.presence_penalty,
                "frequency_penalty": params.frequency_penalty,
                "ignore_eos": params.ignore_eos, "stop": list(params.stop),
                "n_probs": body.n_probs, "stream": body.stream,
                "grammar": body.grammar or ""}


def _template_text(tokenizer: Any, body: TokenizeRequest) -> str:
    assert body.messages is not None
    return render_chat_text(tokenizer, body.messages, body.template)


def _text_tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))

