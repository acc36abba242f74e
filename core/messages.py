"""Control-plane messages: small frozen dataclasses and their msgpack codec.

`decode` is the one place control bytes become messages (see core/codec.py): anything malformed
raises `MalformedMessage`, which the channels count and drop.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

from core.codec import Codec, MalformedMessage  # noqa: F401  (re-exported)
from core.config import KVBackend, Role

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token
FinishReason = Literal["stop", "length"]  # a stop or EOS token; max_tokens
# The stages of a request on its way to its first tokens (docs/observability.md).
Stage = Literal["gateway_queue", "prefill_wait", "prefill_compute", "kv_transfer", "first_decode"]
STAGES: tuple[Stage, ...] = typing.get_args(Stage)


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "lark"]


@dataclass(frozen=True)
class Grammar:
    """Structured output: what the output must match. `text` is a JSON schema's (json_schema),
    a regular expression (regex), an EBNF grammar whose start rule is `root` (ebnf) or a Lark
    one whose start rule is `start` (lark); any JSON object (json_object) needs none."""

    kind: GrammarKind
    text: str = ""


JSON_OBJECT = Grammar("json_object")


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thought, which a grammar waits out (vLLM's way): the output may open
    it with `start`, or the prompt left it `opened`; the grammar applies after `end`."""

    start: str = "<think>"
    end: str = "</think>"
    opened: bool = False

    def __post_init__(self) -> None:
        if not (self.start and self.end):
            raise ValueError("a thought's markers must not be empty")


class RequestKey(NamedTuple):
    """One epoch of one request: what every process keys a request's state by. A resumed
    request runs under a new epoch, and nothing of an older one may touch it."""

    request_id: str
    epoch: int


class Keyed:
    """A message about one epoch of one request."""

    request_id: str
    epoch: int

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.request_id, self.epoch)


@dataclass(frozen=True)
class TokenBias:
    """A token and what is added to its logit before each draw (OpenAI's logit_bias)."""

    token_id: int
    bias: float


@dataclass(frozen=True)
class Sampling:
    """How to pick the next token; temperature 0 is greedy, top_k 0 and top_p 1 are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: minus this for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM/HF's, over prompt + output: > 1 penalizes
    logprobs: int | None = None  # None: none; k: the drawn token's logprob and the k best
    min_p: float = 0.0  # drop tokens less likely than this times the most likely one's
    allowed_token_ids: list[int] | None = None  # None: any; else only these can be drawn
    # vLLM's bad_words, tokenized: a word's last token is banned after the ones before it.
    bad_words: list[list[int]] = field(default_factory=list)
    logit_bias: list[TokenBias] = field(default_factory=list)  # OpenAI's: added to the logits

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        self._check_penalties()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not word for word in self.bad_words):
            raise ValueError("a bad word must have tokens")
        if not all(math.isfinite(b.bias) for b in self.logit_bias):
            raise ValueError("logit_bias values must be finite")

    def _check_penalties(self) -> None:
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be finite")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")

    def for_choice(self, index: int) -> Sampling:
        """Choice `index` of a request with n > 1 choices: its own seed, so the choices differ
        yet each is reproducible (no seed: each draws from fresh entropy anyway)."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % 2**64)

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken: at temperature 0, and below 1e-5,
        where dividing the logits by it would overflow them to inf."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class GenerationTask:
    """What a worker needs to generate for one request, beyond the request id."""

    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    cache_salt: str = ""  # seeds the prefix-cache block hashes: tenants never share blocks
    min_tokens: int = 0  # stop and EOS tokens cannot be drawn before this many output tokens
    # Where the output starts in prompt_ids: a resumed request's prompt ends with the output
    # its client already has, which penalties and min_tokens count. None: all of it is prompt.
    output_start: int | None = None
    grammar: Grammar | None = None  # structured output: what the output must match
    thinking: Thinking | None = None  # with a grammar: the thought it waits out, if any
    priority: int = 0  # vLLM's: lower is scheduled sooner (before the deadline order)
    # echo with logprobs: each prompt token's logprob and the k most likely tokens there
    # (`PromptLogprobs`, from the decode worker that prefills it); None: not asked.
    prompt_logprobs: int | None = None
    # The prompt's embedding is asked for, not its tokens: the worker that computes its last
    # token sends that token's final hidden state with the first token (`embedding`).
    embedding: bool = False

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.output_start is not None and not 0 <= self.output_start <= len(self.prompt_ids):
            raise ValueError(f"output_start must be in [0, {len(self.prompt_ids)}]")

    @property
    def prompt_len(self) -> int:
        """How many of prompt_ids are the client's prompt."""
        return len(self.prompt_ids) if self.output_start is None else self.output_start

    @property
    def output_before(self) -> int:
        """Output tokens generated in earlier epochs (the tail of prompt_ids)."""
        return len(self.prompt_ids) - self.prompt_len


@dataclass(frozen=True)
class Register:
    worker_id: str
    instance_id: str
    role: Role
    kv_address: str  # where a decode worker receives KV; "" for prefill
    fingerprint: str
    block_size: int
    num_blocks: int
    host: str = ""  # the machine it runs on (its host name), for people looking at the cluster
    # Where it computes, so that the gateway knows which workers take turns on the same cores:
    # the CPUs it may run on (empty: not known), its torch threads, its batch's most sequences.
    cpus: list[int] = field(default_factory=list)
    threads: int = 0  # 0: not known
    max_running: int = 0  # decode: decode.max_running; 0: no bound known (prefill)
    isa: str = ""  # the instruction set its kernels run at (engine.kernels.isa; "torch": none)
    prefix_caching: bool = False  # it keeps computed KV blocks for later prompts
    kv_bytes_per_token: int = 0  # of K and V over every layer, as its cache holds them
    cache_blocks: int = 0  # the most blocks its prefix cache keeps (0: as many as its pool)


@dataclass(frozen=True)
class RegisterReply:
    accepted: bool
    reason: str


@dataclass(frozen=True)
class RegisterAgain:
    """The gateway does not know the sender (it restarted, or declared the worker dead)."""

    reason: str


@dataclass(frozen=True)
class Leave:
    """A worker stopping on purpose: the gateway stops routing to it at once."""

    worker_id: str
    instance_id: str


@dataclass(frozen=True)
class Alive:
    """A worker's liveness beat, sent by a thread of its own (core/pulse.py) however long the
    loop's step: the gateway declares a worker dead only when these stop. Load and progress
    come in `Heartbeat`, from the loop."""

    worker_id: str
    instance_id: str


@dataclass(frozen=True)
class TransferTotals:
    """A worker's KV transfer totals since it started, on one side of one backend."""

    backend: KVBackend | Literal["any"]  # "any": a decode worker receives from every backend
    direction: Literal["send", "receive"]
    chunks: int
    bytes: int
    seconds: float
    failures: int


@dataclass(frozen=True)
class DropCount:
    """KV chunks a worker dropped since it started, for one reason."""

    reason: str
    count: int


@dataclass(frozen=True)
class Held(Keyed):
    """A request (in one epoch) a worker holds: queued, in its forward pass, or receiving KV."""

    request_id: str
    epoch: int


@dataclass(frozen=True)
class PullTotals:
    """A decode worker's pulls of cached prefixes since it started."""

    pulls: int = 0  # prefixes received whole
    fallbacks: int = 0  # prefixes that did not come (none cached there, lost, late): computed
    tokens: int = 0  # prompt tokens received rather than computed
    bytes: int = 0
    seconds: float = 0.0  # from asking to having every layer, summed over pulls
    saved_s: float = 0.0  # the tokens' prefill time here (as measured) less the pulls' time


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    instance_id: str
    queued_tokens: int
    free_blocks: int
    running: int
    waiting: int
    preemptions: int = 0  # since the worker started
    guessed_tokens: int = 0  # decode: tokens guessed (n-gram speculation), since start
    kept_guesses: int = 0  # ... of which the draws kept
    transfers: list[TransferTotals] = field(default_factory=list)
    dropped_chunks: list[DropCount] = field(default_factory=list)
    in_transfer: int = 0  # requests (decode) or staged chunks (prefill) whose KV is in flight
    leases_expired: int = 0  # reservations reclaimed because their lease ran out, since start
    progress: int = 0  # model layers computed since start: stops growing when the loop wedges
    holding: list[Held] = field(default_factory=list)  # every request the worker holds now
    rejected_peers: int = 0  # peers its server sockets turned away (CURVE), since start
    draining: bool = False  # it takes no new work, and leaves once it holds none
    pulls: PullTotals = field(default_factory=PullTotals)  # decode
    prefill_s_per_token: float = 0.0  # its prompts' compute time per token lately (0: unknown)
    # The worker's monotonic clock as it sent this (0: unknown). Only differences between its
    # heartbeats' are used, never compared with another process's clock as such.
    sent_at: float = 0.0


@dataclass(frozen=True)
class StageTime:
    """How long a request spent in one stage, measured on the one process that reports it:
    durations only, as the processes' clocks are never compared."""

    stage: Stage
    seconds: float

    def __post_init__(self) -> None:
        if not 0 <= self.seconds < math.inf:
            raise ValueError(f"a stage lasts a finite time >= 0, not {self.seconds}")


@dataclass(frozen=True)
class PrefillRequest(Keyed):
    request_id: str
    epoch: int
    task: GenerationTask
    decode_worker: str
    decode_address: str
    # n > 1: the other choices' request ids. The prompt is prefilled once and its KV forked
    # on decode, where choice i draws with `task.sampling.for_choice(i)` from its first token.
    siblings: list[str] = field(default_factory=list)
    traceparent: str = ""  # W3C trace context of the gateway's request span; "": not traced
    decode_host: str = ""  # the decode worker's host: KV staged in shared memory only on its own
    # A decode worker prefilling the prompt itself first pulls the KV of up to `pull_tokens`
    # leading prompt tokens from the cache of worker `pull_from` (`SharePrefix`); 0: none.
    pull_from: str = ""
    pull_tokens: int = 0


@dataclass(frozen=True)
class DecodeRequest(Keyed):
    """Prefill to decode, ahead of the request's KV: what to generate, and the KV layout the
    sender computed it in. The request's `FirstToken` follows its last layer."""

    request_id: str
    epoch: int
    task: GenerationTask
    fingerprint: str
    siblings: list[str] = field(default_factory=list)  # as in PrefillRequest
    traceparent: str = ""  # as in PrefillRequest


def choice_keys(request: PrefillRequest | DecodeRequest) -> list[RequestKey]:
    """The key of each choice of a request: itself, then its siblings (n > 1)."""
    return [request.key, *(RequestKey(sibling, request.epoch) for sibling in request.siblings)]


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position, with its logprob."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class FirstToken(Keyed):
    request_id: str
    epoch: int
    token_id: int
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # prompt tokens whose KV the prefill worker had cached already
    logprob: float | None = None  # the token's, when the request asked for logprobs
    top: list[TopLogprob] = field(default_factory=list)  # the k most likely, when asked for
    stages: list[StageTime] = field(default_factory=list)  # prefill_wait, prefill_compute
    embedding: bytes = b""  # a request for one (`GenerationTask.embedding`): see TokenEvent


@dataclass(frozen=True)
class TokenEvent(Keyed):
    request_id: str
    epoch: int
    index: int  # position in the output: 0 is the first token (sent by prefill)
    token_id: int
    finish_reason: FinishReason | None
    logprob: float | None = None  # the token's, when the request asked for logprobs
    top: list[TopLogprob] = field(default_factory=list)  # the k most likely, when asked for
    # The stages the sender measured that ended with this token (its first token's or its
    # first decode step's), once per epoch; empty on every other token.
    stages: list[StageTime] = field(default_factory=list)
    cached_tokens: int = 0  # on a first token drawn by decode: prompt tokens it found cached
    # On the first token of a request for its embedding: the prompt's last token's final
    # hidden state (after the model's last norm, not normalized), float32 little-endian.
    embedding: bytes = b""


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, and the most likely tokens there."""

    logprob: float
    top: list[TopLogprob]


@dataclass(frozen=True)
class PromptLogprobs(Keyed):
    """Decode worker to gateway, before the first token of a request that asked: one entry per
    prompt token after the first (the first has nothing before it)."""

    request_id: str
    epoch: int
    entries: list[PromptLogprob]


@dataclass(frozen=True)
class TokenBatch:
    """All tokens one decode step produced, sent as one message."""

    events: list[TokenEvent]


@dataclass(frozen=True)
class Abort(Keyed):
    request_id: str
    epoch: int


@dataclass(frozen=True)
class RequestFailed(Keyed):
    request_id: str
    epoch: int
    reason: str
    retry: bool = False  # not the request's fault (its KV could not be handed off): serve it again


@dataclass(frozen=True)
class SharePrefix(Keyed):
    """A decode worker, through the gateway, to the worker `holder` whose prefix cache probably
    holds the first `num_tokens` tokens of `prompt_ids` (full blocks, under `cache_salt`): send
    their KV to `address`, where the rest of the prompt is prefilled. Sent once the decode
    worker expects the KV, so that none of it arrives before."""

    request_id: str
    epoch: int
    prompt_ids: list[int]
    cache_salt: str
    num_tokens: int
    holder: str
    worker: str  # the decode worker pulling
    address: str
    host: str = ""  # the decode worker's host: KV staged in shared memory only on the sender's


@dataclass(frozen=True)
class SharedPrefix(Keyed):
    """The holder to the decode worker pulling a request's prefix, ahead of the KV: how many
    leading tokens' KV follows (what it found cached; 0: none, compute them all). From the
    gateway, with 0, when the holder is gone."""

    request_id: str
    epoch: int
    num_tokens: int
    fingerprint: str


@dataclass(frozen=True)
class Drain:
    """Gateway to worker (`POST /admin/drain/{worker}`), as SIGTERM is from its own host: take
    no new work, finish what it holds, then leave."""

    reason: str


@dataclass(frozen=True)
class Drained:
    """Gateway to a draining worker: no request it was given is in flight any more (a decode
    worker's next prompts may still be on a prefill worker, unknown to it; a prefill worker's
    KV is in use once its decode worker has generated a token), so it may leave."""


Message = (
    Register | RegisterReply | RegisterAgain | Leave | Heartbeat | PrefillRequest | DecodeRequest
    | FirstToken | TokenBatch | Abort | RequestFailed | Alive | Drain | Drained | SharePrefix
    | SharedPrefix | PromptLogprobs
)
_CODEC: Codec[Message] = Codec(typing.get_args(Message))
encode = _CODEC.encode
decode = _CODEC.decode
