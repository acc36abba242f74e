"""One request's token events turned into text deltas: detokenized, stop strings applied, timed."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from gateway.detokenizer import (
    NO_LINE_LIMITS,
    IncrementalDetokenizer,
    LineLimiter,
    LineLimits,
    StopStringMatcher,
    text_offsets,
)
from gateway.handle import Ending, Event, RequestHandle
from gateway.logprobs import TokenLogprob, TokenPieces, finite_logprob
from gateway.metrics import Metrics


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: Ending | None = None  # "error": then `error` says why
    error: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the last delta, when asked
    token_ids: tuple[int, ...] = ()  # the output tokens since the last delta
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


KEEPALIVE = None  # yielded when nothing happened for a keepalive interval


@dataclass(frozen=True)
class Echo:
    """The prompt a completion starts with (`echo`); `prompt_only` (max_tokens 0): nothing
    after it."""

    text: str
    token_ids: list[int]
    prompt_only: bool = False


class Generation:
    """One request's text deltas; `abort` stops the request on its workers (the dispatcher's);
    `pieces` (given when the request asked for logprobs) turns the tokens' logprobs into
    `TokenLogprob`s that ride on the deltas. `skip_special_tokens` and `include_stop` are
    vLLM's skip_special_tokens and include_stop_str_in_output; `limits`, llama.cpp's limits
    on a code completion's lines."""

    def __init__(self, handle: RequestHandle, abort: Callable[[RequestHandle], None],
                 metrics: Metrics, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...],
                 pieces: TokenPieces | None = None, skip_special_tokens: bool = True,
                 include_stop: bool = False, echo: Echo | None = None,
                 limits: LineLimits = NO_LINE_LIMITS) -> None:
        self.handle = handle
        self._abort = abort
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, handle.task.prompt_ids,
                                                  skip_special_tokens)
        self.stops = StopStringMatcher(stops, include_stop)
        self.include_stop = include_stop
        self.limiter = LineLimiter(limits) if limits else None
        self.started = time.monotonic()
        self.last_token_at: float | None = None
        self.first_token_at: float | None = None
        self.ending: Ending | None = None  # how it finished, once it has
        self.completion_tokens = 0
        self.closed = False
        self.pieces = pieces
        self.text_chars = 0  # of the detokenized output, stop strings not applied
        self.text_ends: list[int] = []  # text_chars after each output token
        self.pending: list[TokenLogprob] = []  # logprobs not yet on a delta
        self.unsent_ids: list[int] = []  # output tokens not yet on a delta
        self.echo = echo  # until the first delta, which carries it
        metrics.inflight.inc()
        metrics.queued.inc()

    def close(self) -> None:
        """Always called once at the end: aborts an unfinished request and settles the gauges."""
        if self.closed:
            return
        self.closed = True
        self.abort()
        if self.last_token_at is None:
            self.metrics.queued.dec()
        self.metrics.inflight.dec()
        self._count_end()

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.task.prompt_ids)

    async def deltas(self, keepalive_s: float, progress_timeout_s: float
                     ) -> AsyncIterator[Delta | None]:
        """Text deltas until one carries a finish_reason; KEEPALIVE while waiting.

        A request that gets no token for `progress_timeout_s` fails (and is aborted).
        """
        deadline = time.monotonic() + progress_timeout_s
        while True:
            wait = min(keepalive_s, deadline - time.monotonic())
            try:
                event = (self.handle.events.get_nowait() if not self.handle.events.empty()
                         else await asyncio.wait_for(self.handle.events.get(), max(wait, 0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    self.abort()
                    self.ending = "error"
                    yield Delta("", "error", "the request made no progress in time")
                    return
                yield KEEPALIVE
                continue
            if self.closed:  # closed as the event came: nobody gets it, nothing counts it
                return
            deadline = time.monotonic() + progress_timeout_s
            delta = self._apply(event)
            self.ending = delta.finish_reason or self.ending
            if delta.text or delta.finish_reason:
                yield self._with_pending(delta)
            if delta.finish_reason:
                return

    def abort(self) -> None:
        self._abort(self.handle)

    def phases(self) -> tuple[float, float]:
        """Seconds of the prompt's phase (arrival to the first token) and of the output's (the
        first token to the last); 0 for a phase not reached."""
        first, last = self.first_token_at, self.last_token_at
        if first is None or last is None:
            return 0.0, 0.0
        return first - self.started, last - first

    def tokens_writing(self, chars: int) -> int:
        """How many output tokens it took to write the output's first `chars` characters."""
        if chars <= 0:
            return 0
        return min(bisect.bisect_left(self.text_ends, chars) + 1, len(self.text_ends))

    def _apply(self, event: Event) -> Delta:
        if event.token_id is None:
            return Delta("", "error", event.error)
        if self.echo is None:
            return self._apply_token(event)
        echo, self.echo = self.echo, None
        if self.pieces is not None and not self._queue_prompt_logprobs(echo):
            self.abort()
            return Delta("", "error", "the prompt's logprobs were lost")
        self.text_chars = len(echo.text)
        if echo.prompt_only:
            self._count_token(shown=False)
            return self._finished(echo.text, "length")
        delta = self._apply_token(event)
        return replace(delta, text=echo.text + delta.text)

    def _queue_prompt_logprobs(self, echo: Echo) -> bool:
        """Queue the prompt tokens' logprob entries (the first has none: nothing precedes it);
        False when its worker's message with them never came (a one-token prompt has none)."""
        entries, pieces = self.handle.prompt_logprobs, self.pieces
        assert pieces is not None
        if entries is None and len(echo.token_ids) == 1:
            entries = []
        if entries is None or len(entries) != len(echo.token_ids) - 1:
            return False
        offsets = text_offsets(self.tokenizer, echo.token_ids, self.skip_special_tokens)
        for token_id, entry, offset in zip(echo.token_ids, [None, *entries], offsets,
                                           strict=True):
            top = [] if entry is None else [
                (pieces(t.token_id), finite_logprob(t.logprob)) for t in entry.top]
            logprob = None if entry is None else finite_logprob(entry.logprob)
            self.pending.append(TokenLogprob(pieces(token_id), logprob, top,
                                             min(offset, len(echo.text))))
        return True

    def _apply_token(self, event: Event) -> Delta:
        assert event.token_id is not None
        self._count_token()
        text = self._token_text(event.token_id, event.finish_reason)
        self._note_logprob(event)
        self.text_chars += len(text)
        self.text_ends.append(self.text_chars)
        self.unsent_ids.append(event.token_id)
        emit, hit = self._match_stops(text)
        if hit:
            self.abort()
            return self._finished(emit, "stop", self.stops.hit)
        if event.finish_reason is not None:
            return self._finished(emit + self.stops.flush(), event.finish_reason,
                                  self._stop_token(event))
        kept = None if self.limiter is None else self.limiter.feed(emit)
        if kept is not None:
            self.abort()
            return self._finished(emit[:kept], "length")
        return Delta(emit)

    def _stop_token(self, event: Event) -> int | None:
        """The stop token id that ended the sequence, if one did (EOS is none: vLLM's)."""
        stop_ids = self.handle.task.stop_token_ids
        if event.finish_reason == "stop" and event.token_id in stop_ids:
            return event.token_id
        return None

    def _token_text(self, token_id: int, finish_reason: Ending | None) -> str:
        # A token that ended the sequence as "stop" is EOS or a stop token id: not part of the
        # text, unless the request includes stops in the output.
        stopped = finish_reason == "stop" and not self.include_stop
        text = "" if stopped else self.detokenizer.add(token_id)
        if finish_reason is not None:
            text += self.detokenizer.flush()
        return text

    def _match_stops(self, text: str) -> tuple[str, bool]:
        """Stop strings, as vLLM's min_tokens has it, only count in the text of the tokens
        after the first min_tokens (one that straddles that point is missed)."""
        if self.completion_tokens <= self.handle.task.min_tokens:
            return text, False
        return self.stops.feed(text)

    def _note_logprob(self, event: Event) -> None:
        """Queue the token's logprob entry, detokenized, for the next delta."""
        if self.pieces is None or event.logprob is None or event.token_id is None:
            return
        top = [(self.pieces(t.token_id), finite_logprob(t.logprob)) for t in event.top]
        self.pending.append(TokenLogprob(self.pieces(event.token_id),
                                         finite_logprob(event.logprob), top, self.text_chars))

    def _with_pending(self, delta: Delta) -> Delta:
        """The delta, carrying the tokens (and their logprobs) since the last delta."""
        delta = replace(delta, logprobs=tuple(self.pending), token_ids=tuple(self.unsent_ids))
        self.pending, self.unsent_ids = [], []
        return delta

    def _finished(self, text: str, reason: Ending, stop_reason: str | int | None = None
                  ) -> Delta:
        self.metrics.e2e.observe(time.monotonic() - self.started)
        return Delta(text, reason, stop_reason=stop_reason)

    def _count_token(self, shown: bool = True) -> None:
        """A token arrived (its timing); `shown`: one of the completion's (not the token an
        echoed prompt alone, max_tokens 0, draws and drops)."""
        now = time.monotonic()
        if self.last_token_at is None:
            self.handle.timing.first_token = now
            self.metrics.ttft.observe(now - self.started)
            self.metrics.recent.ttft(now - self.started)
            self.metrics.queued.dec()
            self.first_token_at = now
        else:
            self.metrics.inter_token.observe(now - self.last_token_at)
            self.metrics.recent.tpot(now - self.last_token_at)
        self.last_token_at = now
        if shown:
            self.completion_tokens += 1
            self.metrics.generation_tokens.inc()

    def _count_end(self) -> None:
        """vLLM's per-request series: how it finished ("abort" when it ended unfinished), its
        token counts and, once prefilled (by its own prefill, not a forked choice's), the prompt
        tokens its prefill found cached."""
        decode_s = None
        if self.first_token_at is not None and self.last_token_at is not None:
            decode_s = self.last_token_at - self.first_token_at
        self.metrics.vllm.finished(self.ending or "abort", self.prompt_tokens,
                                   self.completion_tokens, decode_s)
        if self.first_token_at is not None and not self.handle.assignment.forked:
            self.metrics.vllm.prefilled(self.prompt_tokens, self.handle.cached_tokens)
