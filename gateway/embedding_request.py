"""The bodies of the embedding routes, and what is done to a vector the workers send.

OpenAI's `POST /v1/embeddings` (with vLLM's extras: `truncate_prompt_tokens`,
`add_special_tokens`, `normalize`, `priority`, and chat `messages`), Ollama's `POST /api/embed`
and its older `POST /api/embeddings`, llama.cpp's `POST /embedding` (`content`,
`embd_normalize`). A vector comes from a worker as float32 bytes (engine/pooling.py); each API
cuts it to `dimensions` first, then normalizes it its own way.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator, model_validator

from gateway.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatMessage,
    TemplateOptions,
    TokenId,
    check_template_flags,
    normalize_prompts,
    unreserved,
)
from gateway.validation import RequestModel, invalid_value

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request
EUCLIDEAN, UNNORMALIZED = 2, -1  # llama.cpp's embd_normalize values
_INT16_SCALE = 32760.0  # llama.cpp's embd_normalize 0: the largest value scaled to this


class EmbeddingRequest(RequestModel):
    """`POST /v1/embeddings`: one input (text or token ids) or a list of them; or, as vLLM
    takes it, `messages` under the chat template (one vector)."""

    input: list[str | list[TokenId]] | None = Field(default=None, max_length=MAX_INPUTS)
    model: str | None = Field(default=None, max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)  # ignored, as vLLM does
    # vLLM's: keep the last k tokens of a longer input (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # Default: true for `input`, false for `messages` (the template writes its own), as vLLM's.
    add_special_tokens: bool | None = None
    normalize: bool = True
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = False  # vLLM's default when embedding messages
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    _no_reserved_kwargs = field_validator("chat_template_kwargs")(unreserved)

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: object) -> object:
        return None if value is None else normalize_prompts(value, "input")

    @model_validator(mode="after")
    def _input_or_messages(self) -> EmbeddingRequest:
        if (self.input is None) == (self.messages is None):
            raise invalid_value("give one of input or messages")
        check_template_flags(self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS) to a text."""
        asked = self.add_special_tokens
        return asked if asked is not None else self.messages is None

    @property
    def template(self) -> TemplateOptions:
        return TemplateOptions(self.add_generation_prompt, self.continue_final_message,
                               self.chat_template_kwargs)


class OllamaEmbedRequest(RequestModel):
    """Ollama's `POST /api/embed`: a text or several; no input only 'loads' the model."""

    # As Ollama reads them, the options' numbers may come as floats: not strict.
    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False, frozen=True)

    model: str | None = Field(default=None, max_length=256)
    input: str | Annotated[list[str], Field(max_length=MAX_INPUTS)] | None = None
    truncate: bool = True  # False: an input longer than the context is an error
    dimensions: int | None = None  # 0 or less: all of them, as Ollama reads it
    options: dict[str, object] | None = None  # the model's load settings: ignored
    keep_alive: str | float | None = None  # ignored: the model stays loaded

    @property
    def inputs(self) -> list[str]:
        """The texts to embed: an empty or null `input` is none, as Ollama reads it."""
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return self.input or []


class OllamaEmbeddingsRequest(RequestModel):
    """Ollama's older `POST /api/embeddings`: one text, its vector not normalized."""

    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False, frozen=True)

    model: str | None = Field(default=None, max_length=256)
    prompt: str = ""  # "": no vector, the model only 'loads'
    options: dict[str, object] | None = None
    keep_alive: str | float | None = None


class LlamaEmbeddingRequest(RequestModel):
    """llama.cpp's `POST /embedding` (and `/embeddings`): `content` (or `input`), one text or
    token list or several; `embd_normalize` picks the norm (2 Euclidean, -1 none, 0 the
    largest value scaled to int16's range, 1 taxicab, p > 2 the p-norm)."""

    content: list[str | list[TokenId]] | None = Field(default=None, max_length=MAX_INPUTS)
    input: list[str | list[TokenId]] | None = Field(default=None, max_length=MAX_INPUTS)
    embd_normalize: int = Field(default=EUCLIDEAN, ge=-1, le=64)
    add_special: bool = True  # llama.cpp's: the tokenizer's BOS and the like
    model: str | None = Field(default=None, max_length=256)

    @field_validator("content", "input", mode="before")
    @classmethod
    def _inputs(cls, value: object) -> object:
        return None if value is None else normalize_prompts(value, "content or input")

    @model_validator(mode="after")
    def _given(self) -> LlamaEmbeddingRequest:
        if self.content is None and self.input is None:
            raise invalid_value("give content")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        given = self.content if self.content is not None else self.input
        assert given is not None, "checked as it was read"
        return given


def vector_of(data: bytes) -> np.ndarray:
    """The floats a worker sent (little-endian float32), as float64 for the sums after; a
    ValueError for none, or for inf or NaN (JSON has neither, nor has a sound model's state)."""
    if not data or len(data) % 4:
        raise ValueError(f"its worker sent no embedding ({len(data)} bytes)")
    vector = np.frombuffer(data, dtype="<f4").astype(np.float64)
    if not np.isfinite(vector).all():
        raise ValueError("the model's hidden state is not finite")
    return vector


def normalized(vector: np.ndarray, norm: int = EUCLIDEAN) -> np.ndarray:
    """`vector` divided by its `norm` (llama.cpp's embd_normalize numbering); a zero vector
    stays zero."""
    largest = float(np.abs(vector).max(initial=0.0))
    if norm == UNNORMALIZED or largest == 0.0:
        return vector
    if norm == 0:
        return vector * (_INT16_SCALE / largest)
    scaled = np.abs(vector) / largest  # in [0, 1]: no power of it overflows
    return vector / (largest * float(np.sum(scaled**norm)) ** (1 / norm))


def base64_of(vector: np.ndarray) -> str:
    """OpenAI's `encoding_format: base64`: the float32 bytes, little-endian, in base64."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
