"""A decode step's forward batch and the rows of its logits: one row a sequence, a guessing
sequence's guesses as rows of their own, every row of a prompt whose logprobs are asked for."""

from __future__ import annotations

import math

import pytest
import torch

from core.messages import DecodeRequest, GenerationTask, PromptLogprob, Sampling
from decode.batch import decode_rows, forward_batch, is_scored, score_prompts
from decode.incoming import ReceivedKV
from decode.scheduler import DecodeSequence

PROMPT = [10, 11, 12, 13, 14, 15]
VOCAB = 20


def decoding(request_id: str, draft: list[int] | None = None) -> DecodeSequence:
    """Its prompt and 2 tokens drawn, all but the last cached; its last token fed this step,
    with its draft after it."""
    task = GenerationTask(PROMPT, Sampling(), 16, [], False)
    guesses = draft or []
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"), tokens=[*PROMPT, 1, 2],
                          num_generated=2, num_cached=len(PROMPT) + 1,
                          num_scheduled=1 + len(guesses), blocks=[3, 4], draft=guesses)


def prompt_chunk(request_id: str, start: int, count: int,
                 logprobs: int | None = 1) -> DecodeSequence:
    """A prompt computed here, `count` of its tokens from `start` on fed this step."""
    task = GenerationTask(PROMPT, Sampling(), 16, [], False, prompt_logprobs=logprobs)
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"), tokens=list(PROMPT),
                          num_generated=0, num_cached=start, num_scheduled=count, blocks=[5, 6])


def test_a_prompt_is_scored_only_while_computed_here_for_a_request_that_asked() -> None:
    assert is_scored(prompt_chunk("p", 0, 4))
    assert not is_scored(prompt_chunk("p", 0, 4, logprobs=None))
    received = prompt_chunk("p", 0, 4)
    received.received_kv = [ReceivedKV(0, 0, torch.empty(0), torch.empty(0))]
    assert not is_scored(received)  # its prompt was computed elsewhere
    assert not is_scored(decoding("d"))


def test_a_guessing_sequence_goes_as_one_row_a_token() -> None:
    plain, guessing = decoding("a"), decoding("b", draft=[7, 8])
    batch = forward_batch([plain, guessing], [False, False])
    start = len(PROMPT) + 1
    assert batch.token_ids == [[2], [2], [7], [8]]
    assert batch.start_positions == [start, start, start + 1, start + 2]
    assert batch.block_tables == [[3, 4]] * 4
    assert batch.all_logits == []  # one row of logits each


def test_a_scored_prompt_asks_for_every_row_of_its_chunk() -> None:
    batch = forward_batch([prompt_chunk("p", 0, 4), decoding("b", draft=[7])], [True, False])
    assert batch.token_ids == [PROMPT[:4], [2], [7]]
    assert batch.start_positions == [0, len(PROMPT) + 1, len(PROMPT) + 2]
    assert batch.all_logits == [True, False, False]


def test_without_scores_or_guesses_each_sequence_has_one_row() -> None:
    batch = [decoding("a"), decoding("b")]
    assert score_prompts(batch, [False, False], torch.zeros(2, VOCAB)) == [0, 1]


def test_a_sequence_s_last_row_comes_before_its_guesses_rows() -> None:
    batch = [decoding("a", draft=[7, 8]), decoding("b"), decoding("c", draft=[9])]
    assert score_prompts(batch, [False] * 3, torch.zeros(6, VOCAB)) == [0, 3, 4]


def predicting(targets: list[int]) -> torch.Tensor:
    """Logits whose row i puts `targets[i]` ahead of the rest."""
    logits = torch.zeros(len(targets), VOCAB)
    logits[range(len(targets)), targets] = 5.0
    return logits


def test_a_scored_prompt_gets_the_logprobs_of_the_tokens_its_rows_predict() -> None:
    ahead = 5.0 - math.log(VOCAB - 1 + math.exp(5.0))
    first = prompt_chunk("p", 0, 4)
    first.prompt_scores = [PromptLogprob(0.0, [])]  # of an earlier start: it started over
    assert score_prompts([first], [True], predicting(PROMPT[1:5])) == [3]
    assert [s.logprob for s in first.prompt_scores] == pytest.approx([ahead] * 4)
    assert [[t.token_id for t in s.top] for s in first.prompt_scores] == [[t] for t in PROMPT[1:5]]
    first.num_cached, first.num_scheduled = 4, 2  # the rest: its last row predicts the output
    logits = torch.cat([torch.zeros(1, VOCAB), predicting([PROMPT[5], 0])])
    assert score_prompts([decoding("d"), first], [False, True], logits) == [0, 2]
    assert len(first.prompt_scores) == len(PROMPT) - 1
    assert first.prompt_scores[-1].logprob == pytest.approx(ahead)


def test_a_last_chunk_of_one_token_scores_nothing_and_keeps_the_earlier_scores() -> None:
    """Its one row predicts the output (so do a one-token prompt's): an empty scoring."""
    chunked = prompt_chunk("p", 0, len(PROMPT) - 1)
    score_prompts([chunked], [True], predicting(PROMPT[1:]))
    chunked.num_cached, chunked.num_scheduled = len(PROMPT) - 1, 1
    assert score_prompts([chunked], [True], torch.zeros(1, VOCAB)) == [0]
    assert len(chunked.prompt_scores) == len(PROMPT) - 1


def test_only_a_step_that_only_decodes_counts_its_rows() -> None:
    batch = [decoding("a", draft=[7, 8]), decoding("b")]
    assert decode_rows(batch, [False, False]) == 4
    chunk = prompt_chunk("p", 0, 4, logprobs=None)
    assert decode_rows([*batch, chunk], [False, False, False]) == 0
    assert decode_rows([*batch, prompt_chunk("p", 0, 4)], [False, False, True]) == 0
    recomputing = decoding("r")  # preempted: its tokens computed again, a chunk at a time
    recomputing.num_cached, recomputing.num_scheduled = 0, 4
    assert decode_rows([*batch, recomputing], [False, False, False]) == 0
