"""The generation parameters: what to generate, independent of the API a request came through
(`GenerationParams`), read from a validated chat or completion request (`generation_params`),
the fields it leaves out taken from the `GenerationDefaults`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from core.config import GenerationDefaults
from core.messages import Grammar
from gateway.detokenizer import NO_LINE_LIMITS, LineLimits
from gateway.errors import bad_request
from gateway.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What to generate, independent of the API the request came through.

    `max_tokens` None means "the request set none": `default_max_tokens` or the context
    limit, whichever is less; `top_k` 0 disables top-k; `include_usage` asks for a final usage
    chunk when streaming; `logprobs` None asks for no logprobs, k for each token's and the k
    most likely tokens'.
    """

    max_tokens: int | None = None
    default_max_tokens: int | None = None  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far on every chunk (with include_usage)
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: Grammar | None = None  # structured output, as GenerationTask.grammar
    n: int = 1  # choices: the prompt is prefilled once, each choice samples on its own
    timing: bool = False  # the response carries the latency breakdown (gateway.timing)
    min_p: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    priority: int = 0  # vLLM's: lower is prefilled sooner
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    echo: bool = False  # completions: the text (and logprobs) start with the prompt's
    line_limits: LineLimits = NO_LINE_LIMITS  # llama.cpp's n_indent and t_max_predict_ms


def generation_params(req: ChatCompletionRequest | CompletionRequest,
                      defaults: GenerationDefaults | None = None) -> GenerationParams:
    """The internal generation parameters of a validated request; what it leaves out comes
    from `defaults` (sampling values, the max_tokens cap)."""
    defaults = defaults or GenerationDefaults()
    stream = bool(req.stream)
    temperature = _given(req.temperature, defaults.temperature)
    return GenerationParams(
        max_tokens=_max_tokens(req, defaults.max_tokens),
        default_max_tokens=_default_max_tokens(req, defaults.max_tokens),
        temperature=temperature,
        top_p=_given(req.top_p, defaults.top_p),
        top_k=max(_given(req.top_k, defaults.top_k), 0),
        min_p=_given(req.min_p, defaults.min_p),
        seed=req.seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        include_usage=stream and bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=stream and bool(req.stream_options and req.stream_options.include_usage
                                         and req.stream_options.continuous_usage_stats),
        stream=stream,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_given(_given(req.repetition_penalty, req.repeat_penalty),
                                  _default_penalty(temperature, defaults)),
        min_tokens=req.min_tokens or 0,
        logprobs=_logprobs(req),
        grammar=req.grammar,
        n=req.n or 1,
        timing=bool(req.raging and req.raging.timing),
        skip_special_tokens=req.skip_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words or ()),
        priority=req.priority or 0,
        logit_bias=tuple((int(token), bias) for token, bias in (req.logit_bias or {}).items()
                         if bias),
        echo=isinstance(req, CompletionRequest) and bool(req.echo),
    )


_T = TypeVar("_T")


def _default_penalty(temperature: float, defaults: GenerationDefaults) -> float:
    """A greedy request gets no default repetition penalty: its output stays the model's own
    greedy output (what transformers' generate gives); a sampled one gets the default's."""
    return defaults.repetition_penalty if temperature > 0 else 1.0


def _given(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _default_max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int) -> int:
    """The cap for a request that sets no max_tokens; never below its min_tokens."""
    return max(cap, req.min_tokens or 0)


def _max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int) -> int | None:
    """The completion's length limit, if the request sets one (chat's max_completion_tokens
    wins; /v1/completions' absent max_tokens is OpenAI's 16, or the cap when it is less);
    a 400 when min_tokens exceeds it."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if isinstance(req, CompletionRequest) and "max_tokens" not in req.model_fields_set:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, cap)
    if max_tokens is not None and (req.min_tokens or 0) > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens ({max_tokens})",
                          param="min_tokens")
    return max_tokens


def _logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many most likely tokens to show per token; None: no logprobs at all."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs
