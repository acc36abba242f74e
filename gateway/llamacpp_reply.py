"""A completion shown as llama.cpp's native `/completion` shows it: whole, one object with the
text in `content` and what ended it (an array of them, for several prompts); streamed, one
`data:` object per piece of text, then one with `stop: true` and the summary, per prompt (no
`[DONE]`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.generation import KEEPALIVE, Generation
from gateway.logprobs import Piece, TokenLogprob
from gateway.reply import KEEPALIVE_EVENT, CompletionFormat, Reply, StopReason, WholeChoice
from gateway.state import GatewayState

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass(frozen=True)
class LlamaAsk:
    """What the reply echoes of the request: its prompts' text and its sampling settings."""

    prompts: tuple[str, ...]
    settings: dict[str, Any]
    probabilities: bool  # n_probs > 0: each token's logprob and the likeliest there
    return_tokens: bool = False  # the whole reply shows its token ids
    route: str = "completion"  # or "infill"
    prompt_only: bool = False  # n_predict 0: the prompt evaluated, nothing shown


class LlamaCppReply(Reply):
    """A completion of each prompt, in llama.cpp's native shape: one object whole (an array of
    them for several prompts); streamed, each object naming its prompt by `index`, a prompt's
    summary as soon as it ends."""

    def __init__(self, generations: list[Generation], state: GatewayState, *, model: str,
                 span: Span | None, ask: LlamaAsk) -> None:
        assert len(generations) == len(ask.prompts), "a /completion has one output per prompt"
        super().__init__(CompletionFormat(), generations, state, include_usage=False,
                         logprobs=ask.probabilities, model=model, span=span)
        self.ask = ask
        self.texts = ["" for _ in generations]  # streamed so far
        # finish and stop reasons
        self.endings: list[tuple[str, StopReason]] = [("stop", None) for _ in generations]

    @property
    def route(self) -> str:
        return self.ask.route

    async def _events(self) -> AsyncIterator[str]:
        async for index, delta in self._deltas():
            if delta is KEEPALIVE:
                yield KEEPALIVE_EVENT
                continue
            if delta.finish_reason == "error":
                self.outcome = "error"
                yield _data(self.error_body(delta.error))
                return
            text = "" if self.ask.prompt_only else delta.text
            self.texts[index] += text
            if text or delta.logprobs:
                yield _data(self._piece(index, text, delta.token_ids, delta.logprobs))
            if delta.finish_reason is not None:
                self.endings[index] = (delta.finish_reason, delta.stop_reason)
                yield _data(self._summary(index, "", ()))
        self.outcome = "ok"

    def _whole_body(self, wholes: list[WholeChoice]) -> Any:
        summaries = []
        for index, whole in enumerate(wholes):
            assert whole.finish_reason is not None
            self.texts[index] = "" if self.ask.prompt_only else "".join(whole.parts)
            self.endings[index] = (whole.finish_reason, whole.stop_reason)
            summaries.append(self._summary(
                index, self.texts[index], whole.token_ids if self.ask.return_tokens else (),
                whole.logprobs))
        return summaries[0] if len(summaries) == 1 else summaries

    def _piece(self, index: int, text: str, token_ids: Sequence[int],
               logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        generation = self.generations[index]
        piece = {"index": index, "content": text, "tokens": list(token_ids), "stop": False,
                 "id_slot": -1,
                 "tokens_predicted": generation.completion_tokens,
                 "tokens_evaluated": generation.prompt_tokens}
        if self.ask.probabilities:
            piece["completion_probabilities"] = [_probabilities(entry) for entry in logprobs]
        return piece

    def _summary(self, index: int, content: str, token_ids: Sequence[int],
                 logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """A prompt's last object: what ended its completion, its counts and timings."""
        generation = self.generations[index]
        finish, matched = self.endings[index]
        by_string = finish == "stop" and isinstance(matched, str)
        summary = {
            **self._piece(index, content, token_ids, logprobs), "stop": True,
            "model": self.model, "generation_settings": self.ask.settings,
            "prompt": self.ask.prompts[index], "has_new_line": "\n" in self.texts[index],
            "truncated": False,
            "stop_type": "limit" if finish == "length" else "word" if by_string else "eos",
            "stopping_word": matched if by_string else "",
            "tokens_cached": generation.handle.cached_tokens, "timings": _timings(generation)}
        if not self.ask.probabilities:
            summary.pop("completion_probabilities", None)
        return summary


def _probabilities(entry: TokenLogprob) -> dict[str, Any]:
    """A token's entry in `completion_probabilities`, as llama.cpp's."""
    return {**_token(entry.token), "logprob": entry.logprob,
            "top_logprobs": [{**_token(piece), "logprob": logprob}
                             for piece, logprob in entry.top]}


def _token(piece: Piece) -> dict[str, Any]:
    return {"id": piece.token_id, "token": piece.text, "bytes": list(piece.data)}


def _timings(generation: Generation) -> dict[str, float]:
    """llama.cpp's timings: the prompt's (from arrival to the first token) and the output's
    (from the first token to the last), in ms, with their rates; `predicted_n` counts every
    token, the first too, as llama.cpp's does (it equals `tokens_predicted`)."""
    prompt_s, predicted_s = generation.phases()
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    prompt_n = generation.prompt_tokens - generation.handle.cached_tokens
    predicted_n = generation.completion_tokens
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": _per(prompt_ms, prompt_n),
            "prompt_per_second": _rate(prompt_n, prompt_ms),
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": _per(predicted_ms, predicted_n),
            "predicted_per_second": _rate(predicted_n, predicted_ms)}


def _per(ms: float, count: int) -> float:
    return ms / count if count else 0.0


def _rate(count: int, ms: float) -> float:
    return count * 1000 / ms if ms > 0 else 0.0


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
