"""Incremental detokenization and stop strings, checked against full decodes of a real tokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import decode_text
from gateway.detokenizer import (
    IncrementalDetokenizer,
    LineLimiter,
    LineLimits,
    StopStringMatcher,
    text_offsets,
)

CASES = 1000
FFFD = "\ufffd"
FRAGMENTS = [
    "Hello", " world", ",", ".", "\n", "  ", "\t", " the", " quick", " fox", "123", " 4.5",
    " café", " naïve", " résumé", " Ørsted", " façade", "ß", " Ångström",
    " 😀", "👍🏽", " 👨‍👩‍👧", "🇫🇷", " 🎉🎉", "🤖",
    " 日本語", "の文章", " 中文字符", "漢字", " 한국어", " Привет", " مرحبا", " ∑∫√",
    "<|im_end|>", "<|im_start|>", " <tag>", " a|b", "\ufffd",
]  # fmt: skip


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))


def random_ids(rng: random.Random, tok: PreTrainedTokenizerBase) -> list[int]:
    """Encoded mixed-script text, sometimes cut mid-character or salted with other tokens."""
    ids = tok.encode(random_text(rng))
    if rng.random() < 0.3 and len(ids) > 2:
        start = rng.randrange(len(ids) - 1)
        ids = ids[start : rng.randint(start + 1, len(ids))]
    if rng.random() < 0.2:
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice([0, 1, 2, rng.randrange(len(tok))]))
    return ids


def random_prompt(rng: random.Random, tok: PreTrainedTokenizerBase) -> list[int]:
    choice = rng.randrange(3)
    if choice == 0:
        return []
    ids = tok.encode(random_text(rng))
    return ids if choice == 1 else ids[: rng.randint(1, len(ids))]


def stream(
    tok: PreTrainedTokenizerBase, prompt: Sequence[int], ids: Sequence[int], skip: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [detok.add(token) for token in ids] + [detok.flush()]


def test_random_sequences_match_full_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(1234)
    partial_chars = 0
    for _ in range(CASES):
        prompt, ids = random_prompt(rng, tokenizer), random_ids(rng, tokenizer)
        deltas = stream(tokenizer, prompt, ids)
        full = decode_text(tokenizer, ids, skip_special_tokens=True)
        assert "".join(deltas) == full, (prompt, ids)
        if FFFD not in full:
            assert not any(FFFD in delta for delta in deltas), (prompt, ids)
        partial_chars += deltas[:-1].count("")
    assert partial_chars > CASES  # the cases really do split characters across tokens


def test_special_tokens_kept_when_not_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(99)
    for _ in range(200):
        prompt, ids = random_prompt(rng, tokenizer), random_ids(rng, tokenizer)
        deltas = stream(tokenizer, prompt, ids, skip=False)
        assert "".join(deltas) == decode_text(tokenizer, ids, skip_special_tokens=False)
    deltas = stream(tokenizer, [], tokenizer.encode("Hi<|im_end|>"), skip=False)
    assert "".join(deltas) == "Hi<|im_end|>"
    assert stream(tokenizer, [], tokenizer.encode("Hi<|im_end|>"))[-2:] == ["", ""]


def test_emoji_is_held_until_complete(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("I 😀 日本")
    assert len(ids) > 4  # byte-level BPE splits the emoji and CJK into several tokens
    deltas = stream(tokenizer, tokenizer.encode("Say:"), ids)
    assert "" in deltas[:-1]
    assert [d for d in deltas if d] == [d for d in deltas if d and FFFD not in d]
    assert "".join(deltas) == "I 😀 日本"
    assert any("😀" in d for d in deltas)


def test_text_offsets_rise_within_the_text_and_split_characters_share_one(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """echo's text_offset: the character each token starts at, never past the text, even for
    tokens holding a piece of an emoji or a CJK character."""
    rng = random.Random(7)
    for _ in range(200):
        ids = random_ids(rng, tokenizer)
        text = decode_text(tokenizer, ids, skip_special_tokens=True)
        offsets = text_offsets(tokenizer, ids)
        assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), ids
        assert offsets[:1] in ([], [0])
    ids = tokenizer.encode("héllo wörld 🎉 ok")
    offsets = text_offsets(tokenizer, ids)
    assert offsets[-1] == len("héllo wörld 🎉")  # " ok" starts after the emoji
    assert len(set(offsets)) < len(offsets)  # the emoji's byte tokens share its offset


def test_flush_turns_unfinished_character_into_replacement(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode(" 😀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(token) for token in ids] == [""] * len(ids)
    assert detok.flush() == decode_text(tokenizer, ids)
    assert FFFD in decode_text(tokenizer, ids)


def test_prompt_cut_mid_character_does_not_swallow_output(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode("ab 😀 cd")
    cut = next(i for i in range(1, len(ids)) if decode_text(tokenizer, ids[:i]).endswith(FFFD))
    deltas = stream(tokenizer, ids[:cut], ids[cut:])
    assert "".join(deltas) == decode_text(tokenizer, ids[cut:])


def test_prompt_context_keeps_leading_space(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.encode("Hello")
    deltas = stream(tokenizer, prompt, tokenizer.encode(" world"))
    assert "".join(deltas) == " world"


class _CountingTokenizer:
    """Delegates to a real tokenizer, recording how many ids each decode call sees."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.widths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.widths.append(len(ids))
        return decode_text(self.inner, ids, **kwargs)


def test_decode_window_does_not_grow_with_output(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Some text with 日本語 and 😀 emoji. " * 60)
    counting = _CountingTokenizer(tokenizer)
    deltas = stream(counting, tokenizer.encode("prompt " * 50), ids)  # type: ignore[arg-type]
    assert "".join(deltas) == decode_text(tokenizer, ids)
    assert len(ids) > 500
    assert max(counting.widths) <= 12


def reference_cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the stop-string occurrence that ends first (the longer one on a tie)."""
    hits = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    if not hits:
        return text, False
    return text[: min(hits)[2]], True


def random_stops(rng: random.Random, text: str) -> tuple[str, ...]:
    stops = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 8)])
        else:
            stops.append(rng.choice(["STOP", "\n\n", "日本語の", "😀😀", "zzz"]))
    return tuple(stops)


def stream_with_stops(
    tok: PreTrainedTokenizerBase, ids: Sequence[int], stops: tuple[str, ...], limit: str
) -> tuple[str, bool]:
    """Stream `ids` through detokenizer and matcher; assert nothing past `limit` is emitted."""
    detok, matcher = IncrementalDetokenizer(tok, []), StopStringMatcher(stops)
    emitted = ""
    for token in ids:
        text, hit = matcher.feed(detok.add(token))
        emitted += text
        assert limit.startswith(emitted)
        if hit:
            assert matcher.feed("more text") == ("", True) and matcher.flush() == ""
            return emitted, True
    text, hit = matcher.feed(detok.flush())
    emitted += text + ("" if hit else matcher.flush())
    return emitted, hit


def test_random_stop_strings_cut_the_stream(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(4321)
    hits = 0
    for _ in range(CASES):
        ids = random_ids(rng, tokenizer)
        text = decode_text(tokenizer, ids, skip_special_tokens=True)
        stops = random_stops(rng, text)
        expected, should_hit = reference_cut(text, stops)
        assert stream_with_stops(tokenizer, ids, stops, expected) == (expected, should_hit), (
            ids,
            stops,
        )
        hits += should_hit
    assert hits > CASES // 2


def feed_all(matcher: StopStringMatcher, chunks: Sequence[str]) -> list[tuple[str, bool]]:
    return [matcher.feed(chunk) for chunk in chunks]


def test_stop_prefix_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(("hello",))
    released = feed_all(matcher, ["say he", "l", "p me"])
    assert released == [("say ", False), ("", False), ("help me", False)]
    assert matcher.feed("and hel") == ("and ", False)
    assert matcher.flush() == "hel"
    assert not matcher.stopped


def test_stop_across_chunks_excludes_stop_and_rest() -> None:
    matcher = StopStringMatcher(("</s>", "END"))
    assert feed_all(matcher, ["abc<", "/", "s> tail"]) == [("abc", False), ("", False), ("", True)]
    assert matcher.stopped
    assert matcher.feed("x") == ("", True)
    assert matcher.flush() == ""


def test_stop_hit_inside_one_chunk() -> None:
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("one END two END") == ("one ", True)


def test_first_completed_stop_wins() -> None:
    assert StopStringMatcher(("bcd", "abcde")).feed("xabcdef") == ("xa", True)
    assert StopStringMatcher(("ab", "b")).feed("xab") == ("x", True)
    matcher = StopStringMatcher(("aab",))
    fed = feed_all(matcher, ["a", "a", "a", "b"])
    assert fed == [("", False), ("", False), ("a", False), ("", True)]


def test_no_stops_passes_everything_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(("ok", ""))


def test_include_stop_keeps_the_stop_string_and_hit_names_it() -> None:
    matcher = StopStringMatcher(("END", "STOP"), include_stop=True)
    assert matcher.feed("abcEN") == ("abc", False)
    assert matcher.feed("Dxyz") == ("END", True)
    assert matcher.hit == "END"
    plain = StopStringMatcher(("END", "STOP"))
    assert plain.feed("a STOP b END") == ("a ", True) and plain.hit == "STOP"
    assert StopStringMatcher(("x",)).hit is None


def limited(limits: LineLimits, pieces: list[str]) -> str:
    """The text a LineLimiter lets through of `pieces`, fed one at a time."""
    limiter, kept = LineLimiter(limits), ""
    for piece in pieces:
        cut = limiter.feed(piece)
        kept += piece if cut is None else piece[:cut]
        if cut is not None:
            break
    return kept


def test_a_line_less_indented_than_asked_ends_the_text_at_its_start() -> None:
    body = ["    x = 1", "\n    ", "y = 2\n", "  ", "  z", " = 3\n", "w = 4\n"]
    assert limited(LineLimits(min_indent=4), body) == "    x = 1\n    y = 2\n    z = 3\n"
    assert limited(LineLimits(min_indent=5), body) == "    x = 1\n    "
    assert limited(LineLimits(), body) == "".join(body)
    # the first line is never measured; a blank line is less indented than any
    assert limited(LineLimits(min_indent=2), ["x\n", "\n", "  y"]) == "x\n"
    assert limited(LineLimits(min_indent=2), ["x\n\t\ty\n", "z"]) == "x\n\t\ty\n"


def test_a_time_limit_ends_the_text_once_it_holds_a_new_line() -> None:
    now = [0.0]
    limiter = LineLimiter(LineLimits(after_s=2.5), lambda: now[0])
    assert limiter.feed("a") is None  # its clock starts at the first text
    now[0] = 3.0
    assert limiter.feed("b") is None  # past the limit, but no new line yet
    assert limiter.feed("c\nd") == 3  # a new line: this text is the last, whole
    now[0] = 10.0
    limiter = LineLimiter(LineLimits(after_s=2.5), lambda: now[0])
    assert limiter.feed("a\n") is None
    now[0] = 12.0
    assert limiter.feed("b") is None
    now[0] = 12.6
    assert limiter.feed("c") == 1
