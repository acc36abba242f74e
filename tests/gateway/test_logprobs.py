"""Logprobs in the gateway: token pieces of the real tokenizer, OpenAI's two shapes, and how a
generation carries them (and min_tokens' hold on stop strings)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from core.messages import GenerationTask, Sampling, TopLogprob
from engine.weights.tokenizer import decode_text
from gateway.generation import Delta, Generation
from gateway.handle import Assignment, Event, RequestHandle
from gateway.logprobs import (
    LOGPROB_FLOOR,
    Piece,
    TokenLogprob,
    TokenPieces,
    _byte_level_alphabet,
    chat_logprobs,
    completion_logprobs,
    finite_logprob,
)
from gateway.metrics import Metrics

TEXTS = ["Hello world", " café naïve", " 日本語の文章", " 😀👍🏽 🇫🇷", " Привет, мир", "\n\t  x",
         "<|im_end|>", " ∑∫√ a|b"]


@pytest.fixture(scope="module")
def pieces(tokenizer: PreTrainedTokenizerBase) -> TokenPieces:
    return TokenPieces(tokenizer)


def test_the_byte_level_alphabet_is_gpt2s() -> None:
    assert _byte_level_alphabet() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_the_pieces_of_any_text_add_up_to_its_bytes(
    tokenizer: PreTrainedTokenizerBase, pieces: TokenPieces
) -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 6)))
        ids = tokenizer.encode(text)
        assert b"".join(pieces(i).data for i in ids) == text.encode(), text


def test_a_whole_characters_piece_is_its_decoded_text(
    tokenizer: PreTrainedTokenizerBase, pieces: TokenPieces
) -> None:
    for token_id in tokenizer.encode(" Hello world café <|im_end|>"):
        assert pieces(token_id).text == decode_text(tokenizer, [token_id])
    assert pieces(2) == Piece("<|im_end|>", b"<|im_end|>", 2)


def test_a_piece_cut_mid_character_shows_its_bytes_escaped(
    tokenizer: PreTrainedTokenizerBase, pieces: TokenPieces
) -> None:
    partial = [i for i in tokenizer.encode(" 日本語") if "\ufffd" in decode_text(tokenizer, [i])]
    assert partial
    for token_id in partial:
        piece = pieces(token_id)
        assert "\\x" in piece.text and "\ufffd" not in piece.text
        assert piece.data.decode("utf-8", errors="backslashreplace") == piece.text


def test_an_id_outside_the_vocabulary_is_an_empty_piece(pieces: TokenPieces) -> None:
    assert pieces(10**6) == Piece("", b"", 10**6)


@pytest.mark.parametrize(("value", "shown"), [
    (-0.5, -0.5), (0.0, 0.0), (-math.inf, LOGPROB_FLOOR), (math.nan, LOGPROB_FLOOR),
    (-1e6, LOGPROB_FLOOR), (math.inf, 0.0), (1e-9, 0.0),
])
def test_logprobs_shown_are_finite(value: float, shown: float) -> None:
    assert finite_logprob(value) == shown


HI = Piece("Hi", b"Hi", 12675)
THERE = Piece(" there", b" there", 665)
CUT = Piece("\\xe6", b"\xe6", 160)
ENTRIES = [
    TokenLogprob(HI, -0.1, [(HI, -0.1), (THERE, -2.5)], 0),
    TokenLogprob(CUT, -3.0, [(THERE, -0.2), (HI, -1.0)], 2),
]


def test_chat_shape() -> None:
    assert chat_logprobs(ENTRIES) == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
            {"token": " there", "logprob": -2.5, "bytes": list(b" there")}]},
        {"token": "\\xe6", "logprob": -3.0, "bytes": [0xE6], "top_logprobs": [
            {"token": " there", "logprob": -0.2, "bytes": list(b" there")},
            {"token": "Hi", "logprob": -1.0, "bytes": [72, 105]}]},
    ]}


def test_completions_shape_adds_the_drawn_token_to_the_top() -> None:
    assert completion_logprobs(ENTRIES) == {
        "tokens": ["Hi", "\\xe6"], "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"Hi": -0.1, " there": -2.5},
                         {" there": -0.2, "Hi": -1.0, "\\xe6": -3.0}],
        "text_offset": [0, 2]}


def test_two_tokens_with_one_text_keep_the_likelier() -> None:
    twin = Piece("Hi", b"Hi", 49000)
    entry = TokenLogprob(twin, -4.0, [(HI, -0.1), (twin, -4.0)], 0)
    assert completion_logprobs([entry])["top_logprobs"] == [{"Hi": -0.1}]


def run(tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: tuple[str, ...] = (),
        min_tokens: int = 0, pieces: TokenPieces | None = None) -> list[Delta]:
    """Every delta of a generation whose tokens are `ids`, the last one ending it."""
    return generate(tokenizer, ids, stops, min_tokens, pieces)[0]


def generate(tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: tuple[str, ...] = (),
             min_tokens: int = 0, pieces: TokenPieces | None = None
             ) -> tuple[list[Delta], Generation]:
    """`run`'s deltas, and the generation that made them."""
    task = GenerationTask([1, 2], Sampling(logprobs=1), len(ids), [], True, min_tokens=min_tokens)
    handle = RequestHandle("r", 0, task, Assignment("p", "d"))
    for index, token in enumerate(ids):
        top = [TopLogprob(token, -0.5), TopLogprob(7, -1.5)]
        handle.events.put_nowait(Event(token, "length" if index == len(ids) - 1 else None,
                                       logprob=-0.5 - index, top=top))
    aborted: list[RequestHandle] = []
    generation = Generation(handle, aborted.append, Metrics(), tokenizer, stops, pieces)

    async def collect() -> list[Delta]:
        return [d async for d in generation.deltas(5.0, 5.0) if d is not None]

    return asyncio.run(collect()), generation


def test_every_tokens_logprobs_ride_on_the_deltas(
    tokenizer: PreTrainedTokenizerBase, pieces: TokenPieces
) -> None:
    text = " Hello 日本語 😀 world"
    ids = tokenizer.encode(text)
    deltas = run(tokenizer, ids, pieces=pieces)
    entries = [e for d in deltas for e in d.logprobs]
    assert "".join(d.text for d in deltas) == text
    assert [e.token for e in entries] == [pieces(i) for i in ids]
    assert [e.logprob for e in entries] == [-0.5 - i for i in range(len(ids))]
    assert all(e.top == [(pieces(i), -0.5), (pieces(7), -1.5)] for e, i in zip(
        entries, ids, strict=True))
    offsets = [e.text_offset for e in entries]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for entry, token_id in zip(entries, ids, strict=True):
        if "\\x" not in entry.token.text:  # a token that starts a character starts at its text
            assert text[entry.text_offset:].startswith(decode_text(tokenizer, [token_id]))


def test_without_pieces_no_logprobs(tokenizer: PreTrainedTokenizerBase) -> None:
    assert all(d.logprobs == () for d in run(tokenizer, tokenizer.encode(" Hello world")))


@pytest.mark.parametrize(("min_tokens", "expected"), [(0, " one "), (3, " one two three ")])
def test_stop_strings_count_only_after_min_tokens(
    tokenizer: PreTrainedTokenizerBase, min_tokens: int, expected: str
) -> None:
    ids = tokenizer.encode(" one two three two four")
    assert len(ids) == 5
    deltas = run(tokenizer, ids, stops=("two",), min_tokens=min_tokens)
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].finish_reason == "stop"


def test_the_tokens_that_wrote_a_stretch_of_text_are_counted(
        tokenizer: PreTrainedTokenizerBase) -> None:
    """How a reply counts its reasoning tokens: those that wrote the thought's characters."""
    ids = tokenizer.encode("<think>ok</think>yes")
    _, generation = generate(tokenizer, ids)
    thought = len("<think>ok</think>")
    assert decode_text(tokenizer, ids[:generation.tokens_writing(thought)]) == "<think>ok</think>"
    assert generation.tokens_writing(0) == 0
    assert generation.tokens_writing(1) == 1
    assert generation.tokens_writing(10_000) == len(ids)
