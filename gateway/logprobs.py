"""Logprobs as OpenAI returns them: each token's text and UTF-8 bytes, and both APIs' shapes.

Workers send token ids and numbers (`TokenEvent.logprob`, `.top`); the gateway turns them into
`TokenLogprob`s here, and formats those as chat's `choices[].logprobs.content[]` or the legacy
completions' `choices[].logprobs` {tokens, token_logprobs, top_logprobs, text_offset}.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from tokenizers import decoders

from engine.weights.tokenizer import decode_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LOGPROB_FLOOR = -9999.0  # what -inf (a banned token) or NaN is shown as: JSON has neither
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE_MARK = "\u2581"  # SentencePiece's word boundary


@dataclass(frozen=True)
class Piece:
    """A token's own text and bytes; a token that ends mid-character shows its bytes as
    `\\xNN` escapes in `text` (OpenAI does the same)."""

    text: str
    data: bytes
    token_id: int


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob entry, detokenized."""

    token: Piece
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)
    top: list[tuple[Piece, float]]  # the most likely tokens at its position, best first
    text_offset: int  # where its text starts in the completion's text


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: in [LOGPROB_FLOOR, 0]; NaN becomes the floor."""
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


class TokenPieces:
    """Each token id's `Piece`, computed once per id (and nothing before the first)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, Piece] = {}

    @cached_property
    def _added(self) -> dict[int, str]:
        """Added tokens (the special ones among them) are their own text, not byte symbols."""
        return {i: str(t) for i, t in self._tokenizer.added_tokens_decoder.items()}

    @cached_property
    def _byte_level(self) -> dict[str, int] | None:
        return _byte_level_alphabet() if _is_byte_level(self._tokenizer) else None

    def __call__(self, token_id: int) -> Piece:
        piece = self._cache.get(token_id)
        if piece is None:
            data = self._bytes(token_id)
            piece = Piece(data.decode("utf-8", errors="backslashreplace"), data, token_id)
            self._cache[token_id] = piece
        return piece

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        symbol = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(symbol, str):
            return b""  # not in the vocabulary
        if self._byte_level is not None and all(c in self._byte_level for c in symbol):
            return bytes(self._byte_level[c] for c in symbol)
        byte = _BYTE_TOKEN.fullmatch(symbol)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if _SPACE_MARK in symbol:
            return symbol.replace(_SPACE_MARK, " ").encode()
        return decode_text(self._tokenizer, [token_id]).encode()


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the byte each symbol character stands for
    (printable bytes stand for themselves, the others for 256 and up, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `choices[].logprobs`."""
    return {"content": [_chat_entry(e) for e in entries], "refusal": None}


def _chat_entry(entry: TokenLogprob) -> dict[str, Any]:
    assert entry.logprob is not None, "chat never echoes its prompt"
    top = [_chat_top(piece, logprob) for piece, logprob in entry.top]
    return {**_chat_top(entry.token, entry.logprob), "top_logprobs": top}


def _chat_top(piece: Piece, logprob: float) -> dict[str, Any]:
    return {"token": piece.text, "logprob": logprob, "bytes": list(piece.data)}


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions' `choices[].logprobs`."""
    return {"tokens": [e.token.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_completion_top(e) for e in entries],
            "text_offset": [e.text_offset for e in entries]}


def _completion_top(entry: TokenLogprob) -> dict[str, float] | None:
    """The k most likely and, as OpenAI always adds it, the drawn token (so up to k + 1).
    Two tokens with the same text keep the likelier one's logprob. None for an echoed
    prompt's first token."""
    if entry.logprob is None:
        return None
    top: dict[str, float] = {}
    for piece, logprob in [*entry.top, (entry.token, entry.logprob)]:
        top.setdefault(piece.text, logprob)
    return top
