"""A grammar waits out a reasoning model's thought: free while it thinks, held from the end
marker on (split over tokens or not), whether the prompt opened the thought or the output's
first token did. First the bookkeeping over a made-up vocabulary, then real grammars."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from core.messages import JSON_OBJECT, GenerationTask, Grammar, Sampling, Thinking
from engine.sampling.grammar import Constraint, Grammars
from engine.sampling.thought import ThoughtGate, opening
from engine.weights.tokenizer import decode_text

VOCAB = [b"", b"<", b"think", b">", b"</", b"{", b"x", b"<think>", b"</think>\n", b"<th", b" ",
         b">\n{"]
TOKEN = {text: token_id for token_id, text in enumerate(VOCAB)}
GRAMMAR = torch.tensor([text == b"{" for text in VOCAB])  # what the grammar allows here
EOS = 2


def gate(opened: bool) -> ThoughtGate:
    return ThoughtGate(Thinking(opened=opened), VOCAB,
                       lambda marker: opening(VOCAB, marker, len(VOCAB)))


def allowed(g: ThoughtGate) -> set[bytes] | None:
    mask = g.allowed(lambda: GRAMMAR)
    return None if mask is None else {VOCAB[i] for i in mask.nonzero().flatten().tolist()}


def feed(g: ThoughtGate, *texts: bytes) -> list[bool]:
    return [g.take(TOKEN[text]) for text in texts]


def test_opening_tokens_hold_the_whole_marker() -> None:
    mask = opening(VOCAB, b"<think>", len(VOCAB))
    assert {VOCAB[i] for i in mask.nonzero().flatten().tolist()} == {b"<think>"}


def test_a_thought_the_prompt_opened_is_free_until_its_end_marker() -> None:
    g = gate(opened=True)
    assert allowed(g) is None
    assert feed(g, b"x", b"</", b"think") == [True, True, True]
    assert allowed(g) is None
    assert feed(g, b">") == [True]  # the end marker, split over three tokens
    assert g.answering and allowed(g) == {b"{"}
    assert feed(g, b"{") == [False]  # the grammar's from here


def test_an_end_marker_inside_a_token_ends_the_thought() -> None:
    g = gate(opened=True)
    assert feed(g, b"x", b"</think>\n") == [True, True]
    assert g.answering and g.answer_begun == b""
    g = gate(opened=True)
    assert feed(g, b"</", b"think", b">\n{") == [True] * 3
    assert g.answering and g.answer_begun == b"{"  # for the grammar


def test_an_output_may_open_a_thought_or_answer_at_once() -> None:
    g = gate(opened=False)
    assert allowed(g) == {b"{", b"<think>"}
    assert feed(g, b"{") == [False]
    assert g.answering and allowed(g) == {b"{"}


def test_a_start_marker_token_opens_a_free_thought() -> None:
    g = gate(opened=False)
    assert feed(g, b"<think>") == [True]
    assert allowed(g) is None
    assert feed(g, b" ", b"</", b"think", b">") == [True] * 4
    assert g.answering


def test_a_marker_in_pieces_opens_no_thought() -> None:
    """"<" is not "<think>": a model that writes one is answering (and a grammar that allows
    no "<" would not have let it)."""
    g = gate(opened=False)
    assert feed(g, b"<") == [False]
    assert g.answering


def constraint(grammars: Grammars, opened: bool, output: list[int] | None = None,
               grammar: Grammar = JSON_OBJECT) -> Constraint:
    prompt = [1, 5, 6]
    task = GenerationTask(prompt_ids=[*prompt, *(output or [])], sampling=Sampling(),
                          max_tokens=64, stop_token_ids=[], ignore_eos=False,
                          output_start=len(prompt), grammar=grammar,
                          thinking=Thinking(opened=opened))
    made = grammars.constraint(task, (EOS,))
    assert made is not None
    return made


def allowed_text(c: Constraint, tokenizer: PreTrainedTokenizerBase) -> set[str] | None:
    mask = c.allowed()
    if mask is None:
        return None
    return {decode_text(tokenizer, [t]) for t in mask.nonzero().flatten().tolist()}


def test_a_json_grammar_holds_from_the_end_of_the_thought(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    c = constraint(grammars, opened=True)
    for token in tokenizer.encode("Let me see.\n</think>"):
        assert c.allowed() is None
        c.advance(token)
    after = allowed_text(c, tokenizer)
    assert after and all(text.startswith("{") for text in after)


def test_without_a_start_marker_token_the_grammar_holds_from_the_first(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    """The tiny model's vocabulary writes `<think>` only in pieces: it does not think."""
    first = constraint(grammars, opened=False).allowed()
    assert first is not None and not grammars.openers(b"<think>").any()
    held = constraint(grammars, opened=True, output=tokenizer.encode("</think>")).allowed()
    assert held is not None and torch.equal(first, held)


def test_an_answer_begun_in_the_token_that_ends_the_thought_counts(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    """'>"' is one token: the grammar sees its quote."""
    c = constraint(grammars, opened=True, grammar=Grammar("regex", '"[a-z]+"'))
    for token in [*tokenizer.encode("hm</think"), tokenizer.convert_tokens_to_ids('>"')]:
        c.advance(token)
    after = allowed_text(c, tokenizer)
    assert after and "a" in after and '"' not in after and '"a' not in after


def test_a_resumed_request_picks_up_after_its_thought(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    """Its streamed output (thought, end marker, the object begun) is replayed."""
    c = constraint(grammars, opened=True, output=tokenizer.encode('hm</think>{"a": 1'))
    after = allowed_text(c, tokenizer)
    assert after and "}" in after and "{" not in after
