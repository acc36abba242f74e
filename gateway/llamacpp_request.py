"""The bodies of llama.cpp's native `POST /completion` and `POST /infill`, read as
/v1/completions requests.

llama.cpp's names map onto the OpenAI and vLLM fields the gateway already serves: `n_predict`
(or `max_tokens`; -1: the cap; 0: the prompt alone) caps the length, and stops at the context
as llama.cpp does,
where /v1/completions would refuse; a temperature at or below 0 is greedy; `n_probs` is
logprobs, `grammar` (GBNF) and
`json_schema` are structured output, `seed` -1 draws a fresh one, `logit_bias` comes in any of
llama.cpp's shapes. Its slot and cache controls mean nothing here (every prompt's prefix is
cached, and the gateway picks the workers): they are accepted and ignored, as are its samplers
that are not served (mirostat, DRY, XTC, ...), which gateway/ignored_fields.py reports.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from gateway.detokenizer import LineLimits
from gateway.infill import MAX_FILES, Gap
from gateway.protocol import (
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    CompletionRequest,
    Penalty,
    TokenId,
    completion_request_of,
    normalize_prompts,
)
from gateway.validation import RequestModel, invalid_value, parse_body

BANNED = -100.0  # llama.cpp's `false` bias: the token is never drawn
_INT32_MAX, _UINT64_MAX = 2**31 - 1, 2**64 - 1
# The completion's fields named otherwise here, for its errors.
_NATIVE_NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs", "guided_grammar": "grammar",
                 "guided_json": "json_schema"}
# [token id or text, bias or false], or {token id: bias or false}
BiasEntry = Annotated[list[TokenId | str | float | bool], Field(min_length=2, max_length=2)]


class LlamaCompletionRequest(RequestModel):
    """llama.cpp's `/completion` body, as far as it is served."""

    prompt: list[str | list[TokenId]]  # one prompt (text or token ids), or several
    n_predict: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # -1: up to the cap
    max_tokens: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # without n_predict
    temperature: float | None = Field(default=None, le=2.0)  # <= 0: greedy
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)  # <= 0: off
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int = Field(default=-1, ge=-1, le=_UINT64_MAX)
    stop: list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    n_probs: int = Field(default=0, ge=0, le=MAX_COMPLETION_LOGPROBS)
    grammar: str | None = Field(default=None, min_length=1)
    json_schema: dict[str, Any] | None = None
    logit_bias: list[BiasEntry] | dict[str, float | bool] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    return_tokens: bool = False  # the whole reply's `tokens`: its token ids (a stream's always)
    model: str | None = Field(default=None, max_length=256)
    n_indent: int = Field(default=0, ge=0, le=_INT32_MAX)  # a line less indented ends it
    t_max_predict_ms: int = Field(default=0, ge=0, le=_INT32_MAX)  # after a new line, a limit
    cache_prompt: bool | None = None  # ignored: every prompt's prefix is cached
    id_slot: int | None = None  # ignored: the gateway picks the workers

    _prompts = field_validator("prompt", mode="before")(normalize_prompts)

    @field_validator("prompt")
    @classmethod
    def _at_most_max_choices(cls, value: list[Any]) -> list[Any]:
        if len(value) > MAX_CHOICES:
            raise invalid_value(f"at most {MAX_CHOICES} prompts are completed at once")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _readable_bias(cls, value: Any) -> Any:
        for key, bias in _pairs(value):
            _bias_pair(key, bias)
        return value

    @property
    def predict(self) -> int | None:
        """The most tokens to make: `n_predict`, else `max_tokens` (as llama.cpp reads them);
        None for -1 or neither, up to the cap; 0: none, the prompt only evaluated (as editors
        warm llama.cpp's cache)."""
        most = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if most is None or most < 0 else most

    @property
    def line_limits(self) -> LineLimits:
        """Its limits on a code completion's lines (none unless set)."""
        after_s = self.t_max_predict_ms / 1000 if self.t_max_predict_ms else None
        return LineLimits(self.n_indent, after_s)

    def bias_entries(self) -> list[tuple[int | str, float]]:
        """`logit_bias` as (token id or text, bias) pairs; `false` bans the token."""
        return [_bias_pair(key, value) for key, value in _pairs(self.logit_bias)]

    def completion_request(self, bias: dict[int, float]) -> CompletionRequest:
        """The same request, as /v1/completions takes it, but for its length (`predict`,
        which the route makes the cap, so that it stops at the context as llama.cpp does);
        `bias`: `bias_entries` with every text's tokens resolved."""
        fields: dict[str, Any] = {
            "prompt": self.prompt, "stream": self.stream, "ignore_eos": self.ignore_eos,
            "temperature": None if self.temperature is None else max(self.temperature, 0.0),
            "seed": None if self.seed < 0 else self.seed,
            "logprobs": (self.n_probs or None) if self.predict != 0 else None, "stop": self.stop,
            "logit_bias": {str(token): value for token, value in bias.items()} or None,
            "guided_grammar": self.grammar, "guided_json": self.json_schema}
        for name in ("top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            fields[name] = getattr(self, name)
        given = {name: value for name, value in fields.items() if value is not None}
        if self.predict == 0:  # the prompt alone, as /v1/completions computes it for echo
            return completion_request_of({**given, "max_tokens": 0, "echo": True},
                                         _NATIVE_NAMES)
        return completion_request_of({**given, "max_tokens": None}, _NATIVE_NAMES)


def _no_prompt() -> list[str | list[int]]:
    return [""]


class InfillFile(RequestModel):
    """One of `/infill`'s `input_extra`: another file of the project."""

    filename: str = Field(default="tmp", max_length=4096)
    text: str = ""
    time: float | None = None  # llama.vim's: when it took the text; nothing here


class LlamaInfillRequest(LlamaCompletionRequest):
    """llama.cpp's `/infill` body: the code before and after the gap, other files of the
    project, and `prompt`, which llama.cpp adds to the prefix (editors send the cursor's line
    in it); the rest is `/completion`'s."""

    prompt: list[str | list[TokenId]] = Field(default_factory=_no_prompt)
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillFile] = Field(default_factory=list, max_length=MAX_FILES)

    @field_validator("prompt")
    @classmethod
    def _one_text(cls, value: list[Any]) -> list[Any]:
        if len(value) != 1 or not isinstance(value[0], str):
            raise invalid_value("an infill's prompt (the cursor's line) is one text")
        return value

    @property
    def gap(self) -> Gap:
        """What to fill."""
        files = tuple((extra.filename, extra.text) for extra in self.input_extra)
        return Gap(self.input_prefix + str(self.prompt[0]), self.input_suffix, files)


def _pairs(logit_bias: Any) -> list[tuple[Any, Any]]:
    """(token, bias) pairs; an object's keys are token ids, as llama.cpp reads them."""
    if logit_bias is None:
        return []
    if isinstance(logit_bias, dict):
        return [(int(key) if key.isdigit() else key, value) for key, value in logit_bias.items()]
    return [(entry[0], entry[1]) for entry in logit_bias]


def _bias_pair(key: Any, value: Any) -> tuple[int | str, float]:
    """One bias entry: its token (an id, or a text whose every token takes it) and its
    bias."""
    if isinstance(value, bool):
        if value:
            raise invalid_value("a logit_bias of true means nothing: give a number or false")
        bias = BANNED
    elif isinstance(value, int | float) and -100 <= value <= 100:
        bias = float(value)
    else:
        raise invalid_value("a logit_bias must be a number in [-100, 100] or false")
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise invalid_value("a logit_bias entry starts with a token id or a text")
    return key, bias


def parse_llamacpp_request(body: bytes) -> LlamaCompletionRequest:
    """Parse a /completion body; any invalid body raises a 400 `APIError`."""
    return parse_body(LlamaCompletionRequest, body)


def parse_llamacpp_infill(body: bytes) -> LlamaInfillRequest:
    """Parse an /infill body; any invalid body raises a 400 `APIError`."""
    return parse_body(LlamaInfillRequest, body)
