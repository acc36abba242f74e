"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/responses (streaming and
not; kept responses read and deleted by id), /v1/models; and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core.messages import GenerationTask, Grammar, Sampling, Thinking, TokenBias
from core.tracing import Attributes
from engine.weights.tokenizer import decode_text
from gateway.auth import cache_salt
from gateway.background import KEPT_LOGS, EventLog
from gateway.chat_request import parse_chat_request
from gateway.errors import (
    APIError,
    bad_request,
    not_found,
    payload_too_large,
    rate_limited,
    service_unavailable,
    whole_number,
)
from gateway.generation import Echo, Generation
from gateway.handle import RequestHandle
from gateway.ignored_fields import IgnoredFields
from gateway.infill import Gap, fill_prompt
from gateway.llamacpp_reply import LlamaAsk, LlamaCppReply
from gateway.logprobs import Piece, TokenPieces
from gateway.messages_reply import AnthropicAsk, MessagesReply
from gateway.ollama_reply import OllamaAsk, OllamaReply
from gateway.params import GenerationParams, generation_params
from gateway.prompts import bad_words_token_ids, check_context, render_chat_prompt, tokenize_prompt
from gateway.protocol import (
    ChatCompletionRequest,
    TemplateOptions,
    TokenizeRequest,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from gateway.reasoning import opens_in_thought, thinking
from gateway.reply import KEEPALIVE_EVENT, ChatFormat, CompletionFormat, Format, Reply
from gateway.response_store import StoredResponse, input_items_page
from gateway.responses_reply import ResponseContext, ResponsesReply
from gateway.responses_request import parse_responses_request
from gateway.state import GatewayState, utc_text
from gateway.timing import TIMING_HEADER, asks_for_timing
from gateway.tools import ToolPlan, tool_plan

if TYPE_CHECKING:
    from opentelemetry.trace import Span

_Result = TypeVar("_Result")
OLLAMA_TAG = ":latest"  # Ollama's name of a model's one version
_PROMPT_END_TOKENS = 8  # the prompt's last tokens, read for a `<think>` left open


@dataclass(frozen=True)
class Served:
    """How a request is answered beside its parameters: the `model` name it gave (echoed), when
    it `arrived` (where its gateway_queue stage starts), and its tool calling, if any."""

    model: str
    arrived: float
    tools: ToolPlan | None = None
    response: ResponseContext | None = None  # answered as a Response (/v1/responses)
    message: AnthropicAsk | None = None  # answered as an Anthropic Message (/v1/messages)
    llamacpp: LlamaAsk | None = None  # answered as llama.cpp's /completion
    ollama: OllamaAsk | None = None  # answered as Ollama's /api/chat or /api/generate


class OpenAIRoutes:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.pieces = TokenPieces(state.tokenizer)
        self.ignored = IgnoredFields(state.metrics.ignored_fields,
                                     state.config.gateway.strict_fields)

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        # Off the loop: a response_format's schema is checked with xgrammar, slow the first time.
        body = await asyncio.to_thread(parse_chat_request, await self.read_body(request))
        self.ignored.check(body)
        model = self.served_model(body.model)
        prompt_ids, params, tools = await self.chat_prompt(body)
        return await self.serve(request, ChatFormat(), [prompt_ids], params,
                                 Served(model, arrived, tools))

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: a chat request spelled another way (responses_request.py),
        answered as a Response (responses_reply.py)."""
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_responses_request, await self.read_body(request))
        self.ignored.check(body)
        model = self.served_model(body.model)
        owner = cache_salt(request)
        earlier = [] if body.previous_response_id is None else self._stored_response(
            body.previous_response_id, owner, "previous_response_id").conversation
        chat = await asyncio.to_thread(body.chat_request, earlier)
        prompt_ids, params, tools = await self.chat_prompt(chat)
        store = self.state.responses if body.store is not False and (
            self.state.responses.capacity) else None
        if body.background and store is None:
            raise bad_request("background responses are polled from the responses this server "
                              "keeps, and it keeps none (gateway.stored_responses is 0)",
                              param="background")
        context = ResponseContext(body, [*earlier, *body.input_messages()], body.input_items(),
                                  owner, store, params.temperature, params.top_p)
        return await self.serve(request, ChatFormat(), [prompt_ids], params,
                                 Served(model, arrived, tools, context))

    async def response(self, request: Request) -> Response:
        """`GET /v1/responses/{id}`: a kept response, as it was returned; with `stream=true`,
        a background stream's events after sequence number `starting_after` (all without),
        followed until it ends."""
        response_id, owner = request.path_params["response_id"], cache_salt(request)
        stored = self._stored_response(response_id, owner)
        after = stream_resumed_after(request.query_params)
        if after is None:
            return JSONResponse(stored.body)
        log = self.state.background.log(owner, response_id)
        if log is None:
            raise bad_request("only a response made with background and stream true is "
                              f"streamed again (the last {KEPT_LOGS} ended ones)", param="stream")
        return self._following(log, after)

    async def delete_response(self, request: Request) -> Response:
        """`DELETE /v1/responses/{id}`: forget a kept response (cancelled first, if it is a
        background one still running)."""
        response_id, owner = request.path_params["response_id"], cache_salt(request)
        await self.state.background.cancel(owner, response_id)
        self.state.background.forget(owner, response_id)
        if not self.state.responses.delete(response_id, owner):
            raise _response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(self, request: Request) -> Response:
        """`POST /v1/responses/{id}/cancel`: stop a background response; it is kept
        `cancelled`. One that has ended is returned as it is (cancelling is idempotent)."""
        response_id, owner = request.path_params["response_id"], cache_salt(request)
        await self.state.background.cancel(owner, response_id)  # kept, cancelled, as it ends
        stored = self._stored_response(response_id, owner)
        if not stored.body.get("background"):
            raise bad_request("only a response created with background true can be "
                              "cancelled", param="response_id")
        return JSONResponse(stored.body)

    async def response_input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items`: a kept response's own input items, a page
        at a time (`limit`, `order`, `after`)."""
        stored = self._stored_response(request.path_params["response_id"], cache_salt(request))
        page = input_items_page(stored.input_items, request.query_params)
        return JSONResponse(page)

    def _stored_response(self, response_id: str, owner: str,
                         param: str | None = None) -> StoredResponse:
        stored = self.state.responses.get(response_id, owner)
        if stored is None:
            raise _response_not_found(response_id, param)
        return stored

    async def chat_prompt(self, body: ChatCompletionRequest
                           ) -> tuple[list[int], GenerationParams, ToolPlan | None]:
        """A chat request's prompt token ids, generation parameters and tool plan."""
        gateway = self.state.config.gateway
        tools = tool_plan(body, gateway.tool_call_parser, gateway.max_parallel_tool_calls)
        render = functools.partial(render_chat_prompt, tools=tools,
                                   options=TemplateOptions.of(body))
        prompt_ids = await self.tokenize_with(render, body.messages)
        params = generation_params(body, self.state.generation_defaults)
        if tools is not None and tools.grammar:
            params = dataclasses.replace(params, grammar=Grammar("json_schema", tools.grammar))
        return prompt_ids, params, tools

    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        body = await asyncio.to_thread(parse_completion_request, await self.read_body(request))
        self.ignored.check(body)
        model = self.served_model(body.model)
        params = generation_params(body, self.state.generation_defaults)
        if body.suffix:  # as OpenAI's: an empty one asks for nothing
            params = self.fill_params(params, "suffix")
            prompts = [await self.fill_prompt_ids(Gap(str(prompt), body.suffix))
                       for prompt in body.prompt]
        else:
            prompts = [await self.tokenize_with(tokenize_prompt, prompt) for prompt in body.prompt]
        return await self.serve(request, CompletionFormat(), prompts, params,
                                 Served(model, arrived))

    def fill_params(self, params: GenerationParams, param: str) -> GenerationParams:
        """`params` for a middle, which the model's fill-in-the-middle endings stop too; a
        400 naming `param` for a model that never learned to fill one."""
        fill = self.state.fill
        if fill is None:
            raise bad_request(
                "This model has no fill-in-the-middle tokens, so it cannot fill a gap: "
                "serve a code model that has them (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, "
                "CodeLlama, ...).", param=param)
        return dataclasses.replace(
            params, stop_token_ids=(*params.stop_token_ids, *fill.endings))

    async def fill_prompt_ids(self, gap: Gap, room: int | None = None) -> list[int]:
        """The token ids of the prompt that fills `gap` (see gateway/infill.py), after
        `fill_params` checked the model can."""
        fill = self.state.fill
        assert fill is not None, "fill_params() refuses a model without the markers first"
        return await self.tokenize_with(
            lambda tokenizer, gap: fill_prompt(tokenizer, fill, gap, room), gap)

    async def tokenize(self, request: Request) -> Response:
        """`POST /tokenize`, vLLM's and llama.cpp's: a prompt's or messages' token ids."""
        body = parse_tokenize_request(await self.read_body(request))
        self.ignored.check(body)
        self.served_model(body.model)
        tokens = await self.tokenize_with(_tokenize_body, body)
        reply: dict[str, Any] = {"count": len(tokens), "max_model_len": self.context_limit(),
                                 "tokens": tokens}
        if body.return_token_strs:
            reply["token_strs"] = self.state.tokenizer.convert_ids_to_tokens(tokens)
        if body.with_pieces:
            reply["tokens"] = [{"id": token, "piece": _piece_shown(self.pieces(token))}
                               for token in tokens]
        return JSONResponse(reply)

    async def detokenize(self, request: Request) -> Response:
        """`POST /detokenize`: the text of token ids, as vLLM (`prompt`) and llama.cpp
        (`content`) name it."""
        body = parse_detokenize_request(await self.read_body(request))
        self.ignored.check(body)
        self.served_model(body.model)
        vocab = len(self.state.tokenizer)
        if any(token >= vocab for token in body.tokens):
            raise bad_request(f"tokens must be below {vocab}", param="tokens")
        text = await self.tokenize_with(decode_text, body.tokens)
        return JSONResponse({"prompt": text, "content": text})

    async def tokenize_with(self, function: Callable[[Any, Any], _Result], text: Any) -> _Result:
        """Off the event loop (a huge prompt must not stall /health), on the one tokenizer thread:
        a Hugging Face fast tokenizer must not be used by two threads at once."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, function, self.state.tokenizer,
                                          text)

    async def models(self, request: Request) -> Response:
        """The list as OpenAI's and Anthropic's clients both read it."""
        names = self.state.served_names
        cards = [self._model_card(name) for name in names]
        return JSONResponse({"object": "list", "data": cards, "has_more": False,
                             "first_id": names[0], "last_id": names[-1]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}` (the openai client's `models.retrieve`): its card, or 404;
        `/v1/models/` is the list, as `/v1/models`."""
        name = request.path_params["model"]
        if not name:
            return await self.models(request)
        return JSONResponse(self._model_card(self.served_model(name)))

    def _model_card(self, name: str) -> dict[str, object]:
        """As vLLM's, with `root` the model itself and the defaults a request gets; and as
        Anthropic's (`type`, `display_name`, `created_at`)."""
        defaults = dataclasses.asdict(self.state.generation_defaults)
        del defaults["from_model"]
        return {"id": name, "object": "model", "created": self.state.started,
                "owned_by": "raging", "root": self.state.model_name,
                "max_model_len": self.context_limit(), "generation_defaults": defaults,
                "type": "model", "display_name": name,
                "created_at": utc_text(self.state.started)}

    async def read_body(self, request: Request) -> bytes:
        """The body, refusing (413) anything over the limit without buffering it."""
        limit = self.state.config.gateway.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise payload_too_large(f"request body exceeds {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():  # ClientDisconnect: handled by the app
            size += len(chunk)
            if size > limit:
                raise payload_too_large(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def served_model(self, model: str | None) -> str:
        """The served name a request gave (bare, or with Ollama's `:latest` tag, which its
        /api/tags lists and Ollama's own /v1 routes take too), or the first one where it gave
        none, or an empty one (as vLLM and llama.cpp do); a 404 for a name this server does
        not serve."""
        names = self.state.served_names
        if not model:
            return names[0]
        if model not in names and model.removesuffix(OLLAMA_TAG) in names:
            return model.removesuffix(OLLAMA_TAG)
        if model not in names:
            served = ", ".join(f"'{name}'" for name in names)
            raise not_found(f"The model '{model[:100]}' does not exist; this server serves "
                            f"{served}.", param="model", code="model_not_found")
        return model

    def context_limit(self) -> int:
        """The longest sequence a request may make: the model's context, or less where the
        workers' KV caches hold less."""
        capacity = self.state.registry.capacity_tokens() or self.state.max_model_len
        return min(self.state.max_model_len, capacity)

    def admit(self, prompt_tokens: int) -> None:
        """503 while the control plane is down; 429 at once when the queue is full, in
        requests or in prompt tokens waiting for prefill (a prompt over the token bound alone
        still gets in when nothing waits)."""
        if not self.state.control_plane_up():
            raise service_unavailable("the gateway lost its control plane", retry_after=5.0)
        limits = self.state.config.gateway
        if len(self.state.dispatcher.requests) >= limits.max_inflight_requests:
            raise rate_limited("too many requests in flight; retry shortly", retry_after=1.0)
        queued = self.state.registry.queued_prompt_tokens()
        if queued and queued + prompt_tokens > limits.max_queued_tokens:
            raise rate_limited(f"{queued} prompt tokens are already waiting for prefill; "
                               "retry shortly", retry_after=1.0)

    async def serve(self, request: Request, fmt: Format, prompts: list[list[int]],
                     params: GenerationParams, served: Served) -> Response:
        self._check_generates(served.model)
        await self.state.dispatcher.until_decode_serves()
        limit = self.context_limit()
        max_tokens = [check_context(len(ids), params.max_tokens, limit, params.default_max_tokens)
                      for ids in prompts]
        self._check_token_ids(params)
        bad_words = await self.tokenize_with(bad_words_token_ids, params.bad_words)
        prompt_tokens = sum(len(ids) for ids in prompts)
        self.admit(prompt_tokens)
        in_thought = self._in_thought(prompts[0], params) if isinstance(fmt, ChatFormat) else None
        waits = self._waited_thought(in_thought, params)
        tasks = [generation_task(params, ids, most, cache_salt(request), bad_words, waits)
                 for ids, most in zip(prompts, max_tokens, strict=True)]
        span = self.open_span(request, served.arrived,
                              {"raging.prompt_tokens": prompt_tokens, "raging.choices": params.n})
        handles = self._submit(tasks, params.n, served.arrived, span)
        self.state.metrics.prompt_tokens.inc(prompt_tokens)
        logprobs = params.logprobs is not None
        generations = [Generation(handle, self.state.dispatcher.abort, self.state.metrics,
                                  self.state.tokenizer, params.stop,
                                  self.pieces if logprobs else None,
                                  params.skip_special_tokens, params.include_stop_str_in_output,
                                  self._echo(params, handle.task.prompt_ids), params.line_limits)
                       for handle in handles]
        timing = asks_for_timing(request.headers.get(TIMING_HEADER), params.timing)
        reply = self._reply(fmt, generations, params, served, timing, span, in_thought)
        return await self._respond(request, reply, served, bool(params.stream))

    def _reply(self, fmt: Format, generations: list[Generation], params: GenerationParams,
               served: Served, timing: bool, span: Span | None,
               in_thought: bool | None) -> Reply:
        """The reply in the shape of the request's API; a chat reply's thinking told from its
        answer where a reasoning parser is set (`in_thought`: whether it opens in thought)."""
        if served.response is not None:
            return ResponsesReply(served.response, generations, self.state,
                                  params.logprobs is not None, model=served.model,
                                  timing=timing, span=span, tools=served.tools,
                                  in_thought=in_thought)
        if served.llamacpp is not None:
            return LlamaCppReply(generations, self.state, model=served.model, span=span,
                                 ask=served.llamacpp)
        if served.ollama is not None:
            return OllamaReply(fmt, generations, self.state, model=served.model, span=span,
                               tools=served.tools, in_thought=in_thought,
                               logprobs=params.logprobs is not None, ask=served.ollama)
        if served.message is not None:
            return MessagesReply(generations, self.state, model=served.model, timing=timing,
                                 span=span, tools=served.tools, in_thought=in_thought,
                                 ask=served.message)
        return Reply(fmt, generations, self.state, params.include_usage,
                     params.logprobs is not None, params.n, model=served.model,
                     continuous_usage=params.continuous_usage, timing=timing, span=span,
                     tools=served.tools, in_thought=in_thought)

    def _in_thought(self, prompt_ids: list[int], params: GenerationParams) -> bool | None:
        """Whether the output opens in thought (gateway/reasoning.py); None without a
        reasoning parser. A grammar that constrains the thinking too leaves it none."""
        config = self.state.config.gateway
        if not config.reasoning_parser:
            return None
        if params.grammar is not None and config.grammar_in_reasoning:
            return False
        end = decode_text(self.state.tokenizer, prompt_ids[-_PROMPT_END_TOKENS:],
                          skip_special_tokens=False)
        return opens_in_thought(config.reasoning_parser, end)

    def _waited_thought(self, in_thought: bool | None, params: GenerationParams
                        ) -> Thinking | None:
        """The thought the request's grammar waits out, if it has both."""
        if in_thought is None or params.grammar is None:
            return None
        return None if self.state.config.gateway.grammar_in_reasoning else thinking(in_thought)

    async def _respond(self, request: Request, reply: Reply, served: Served,
                       stream: bool) -> Response:
        """The reply as asked for: a stream, the whole of it, or (a background response) the
        announcement that it is queued, while it runs on."""
        if served.response is not None and served.response.request.background:
            assert isinstance(reply, ResponsesReply)
            announced = reply.announce()
            if not stream:
                self.state.background.start(served.response.owner, reply.id,
                                            reply.in_background(), settle=reply.settle)
                return JSONResponse(announced)
            log = EventLog()
            self.state.background.start(served.response.owner, reply.id,
                                        reply.streamed_in_background(log), log,
                                        functools.partial(reply.settle, log=log))
            return self._following(log, -1)
        if stream:
            return StreamingResponse(reply.stream(), media_type=reply.media_type,
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole(request)

    def _following(self, log: EventLog, after: int) -> Response:
        """A background stream's events after sequence number `after`, as they come: the
        client going away stops only its own following."""
        quiet_s = self.state.config.gateway.keepalive_s

        async def events() -> AsyncIterator[str]:
            async for event in log.follow(after, quiet_s):
                yield KEEPALIVE_EVENT if event is None else event

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _echo(self, params: GenerationParams, prompt_ids: list[int]) -> Echo | None:
        """What the request's choices start with (`echo`): its prompt, as text and tokens."""
        if not params.echo:
            return None
        text = decode_text(self.state.tokenizer, prompt_ids, params.skip_special_tokens)
        return Echo(text, prompt_ids, prompt_only=params.max_tokens == 0)

    def open_span(self, request: Request, arrived: float, attributes: Attributes
                  ) -> Span | None:
        """The request's span (a child of the client's `traceparent`, if it sent one); None
        when tracing is off."""
        tracer = self.state.tracer
        if tracer is None:
            return None
        return tracer.open(f"{request.method} {request.url.path}",
                           request.headers.get("traceparent"), arrived, attributes)

    def _check_generates(self, model: str) -> None:
        """400 for text from an embedding model that has no output head, as vLLM's for a
        pooling model."""
        facts = self.state.facts
        if facts is not None and not facts.generates:
            raise bad_request(f"The model '{model}' has no output head (an embedding model): "
                              "it serves /v1/embeddings, not text generation", param="model")

    def _check_token_ids(self, params: GenerationParams) -> None:
        """400 for stop_token_ids, allowed_token_ids or logit_bias keys outside the vocabulary."""
        vocab = len(self.state.tokenizer)
        if any(token >= vocab for token in params.stop_token_ids):
            raise bad_request(f"stop_token_ids must be below {vocab}", param="stop_token_ids")
        if any(token >= vocab for token in params.allowed_token_ids or ()):
            raise bad_request(f"allowed_token_ids must be below {vocab}",
                              param="allowed_token_ids")
        if any(token >= vocab for token, _ in params.logit_bias):
            raise bad_request(f"logit_bias keys must be token ids below {vocab}",
                              param="logit_bias")

    def _submit(self, tasks: list[GenerationTask], n: int, arrived: float,
                span: Span | None) -> list[RequestHandle]:
        """Each task's `n` choices, task by task (choice index = task * n + choice); when one
        cannot be routed, the ones already sent are aborted (and the span ends)."""
        dispatcher, tracer = self.state.dispatcher, self.state.tracer
        traceparent = "" if tracer is None or span is None else tracer.traceparent(span)
        handles: list[RequestHandle] = []
        try:
            for task in tasks:
                handles += dispatcher.submit_choices(task, n, arrived, traceparent)
        except APIError as exc:
            for handle in handles:
                dispatcher.abort(handle)
            if tracer is not None and span is not None:
                tracer.close(span, time.monotonic(), {"raging.outcome": "unavailable",
                                                      "http.response.status_code": exc.status})
            raise
        return handles


def generation_task(params: GenerationParams, prompt_ids: list[int], max_tokens: int,
                    salt: str, bad_words: list[list[int]] | None = None,
                    waits: Thinking | None = None) -> GenerationTask:
    """What the workers get for a request; `bad_words` tokenized (bad_words_token_ids);
    `waits`: the thought its grammar waits out."""
    allowed = params.allowed_token_ids
    sampling = Sampling(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logprobs=params.logprobs,
        min_p=params.min_p, allowed_token_ids=None if allowed is None else list(allowed),
        bad_words=bad_words or [],
        logit_bias=[TokenBias(token, bias) for token, bias in params.logit_bias],
    )
    echoed_logprobs = params.echo and params.logprobs is not None
    return GenerationTask(
        # max_tokens 0 (echo): a token is drawn, as ever, and not shown
        prompt_ids=prompt_ids, sampling=sampling, max_tokens=max(max_tokens, 1),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        cache_salt=salt, min_tokens=params.min_tokens, output_start=len(prompt_ids),
        grammar=params.grammar, thinking=waits, priority=params.priority,
        prompt_logprobs=params.logprobs if echoed_logprobs else None,
    )


def stream_resumed_after(query: Mapping[str, str]) -> int | None:
    """For GET /v1/responses/{id}: None unless `stream` is true; else the sequence number
    the events start after (`starting_after`; -1, before the first, without one)."""
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise bad_request("stream must be true or false", param="stream")
    after = query.get("starting_after")
    if stream == "false":
        if after is not None:
            raise bad_request("starting_after needs stream true", param="starting_after")
        return None
    if after is None:
        return -1
    number = whole_number(after)
    if number is None:
        raise bad_request("starting_after must be a sequence number (an integer from 0)",
                          param="starting_after")
    return number


def _response_not_found(response_id: str, param: str | None = None) -> APIError:
    return not_found(f"Response with id '{response_id[:100]}' not found.", param=param)


def _piece_shown(piece: Piece) -> str | list[int]:
    """A token's text as llama.cpp's /tokenize shows it: its bytes where they are not UTF-8."""
    try:
        return piece.data.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece.data)


def _tokenize_body(tokenizer: Any, body: TokenizeRequest) -> list[int]:
    """/tokenize's token ids: the prompt's, or the messages' under the chat template."""
    if body.messages is not None:  # the template writes the special tokens it wants
        return render_chat_prompt(tokenizer, body.messages, options=body.template)
    assert body.text is not None
    return list(tokenizer.encode(body.text, add_special_tokens=body.special_tokens))
