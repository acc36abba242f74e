"""The tokens a simulated model answers: deterministic, different for every request, and
checkable by anyone holding the request's token ids (`continuation`).

Position p of a sequence has a state `s_p = advance(s_{p-1}, token_p, p)` from `SEED`; the
token after position p is `choice(s_p)`. A worker keeps each position's state in that
position's KV (engine.sim.runner), as a model keeps what it read: a decode step reads the state of
the sequence's last cached position from its cache, so a stream comes out right only if every
position's KV reached it whole, in order and under the right request.

The vocabulary is bytes (ids 0-255) and three chat tokens; answers are lowercase words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BYTES = 256
END_OF_TEXT, IM_START, IM_END = 256, 257, 258
SPECIAL_TOKENS = {END_OF_TEXT: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
VOCAB_SIZE = 259
EOS = IM_END
SEED = 0x2545F491
_MODULUS = 1 << 31
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz     ."  # 32: a word every ~6 letters
STATE_BYTES = 4  # a state is 31 bits, kept as 4 values 0-255 (exact in every float dtype)


def advance(state: int, token: int, position: int) -> int:
    """The state after `token` at `position`, from the state before it."""
    return (state * 1103515245 + (token + 1) * 2654435761 + position * 40503 + 12345) % _MODULUS


@dataclass(frozen=True)
class Choice:
    """The token after a state, and the letter drawn instead when that token is banned (the
    end of the answer, while `min_tokens` or `ignore_eos` hold it back)."""

    token: int
    letter: int


def choice(state: int, mean_output_tokens: int) -> Choice:
    """What follows a position whose state is `state`: the end of the answer one time in
    `mean_output_tokens` (never for 0), else a letter."""
    letter = _ALPHABET[(state >> 16) % len(_ALPHABET)]
    ends = mean_output_tokens > 0 and (state >> 4) % mean_output_tokens == 0
    return Choice(EOS if ends else letter, letter)


def states(tokens: Sequence[int], start: int, state: int) -> list[int]:
    """The states of `tokens` at positions start.., from `state`, the one before them."""
    out = []
    for offset, token in enumerate(tokens):
        state = advance(state, token, start + offset)
        out.append(state)
    return out


def continuation(prompt: Sequence[int], max_tokens: int, mean_output_tokens: int,
                 ignore_eos: bool = False) -> list[int]:
    """The tokens a simulated model answers `prompt` with (greedy or sampled alike), up to
    `max_tokens`: to the end of the answer, included, or with `ignore_eos` past it (the end
    token stays in the output, as a model that ignores it generates it)."""
    state = states(prompt, 0, SEED)[-1]
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(choice(state, mean_output_tokens).token)
        if out[-1] == EOS and not ignore_eos:
            break
        state = advance(state, out[-1], len(prompt) + len(out) - 1)
    return out


def text_of(tokens: Sequence[int]) -> str:
    """What a client reads of `tokens`: their bytes, special tokens left out."""
    return bytes(token for token in tokens if token < BYTES).decode()
