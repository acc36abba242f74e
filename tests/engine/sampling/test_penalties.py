"""Penalties, logit_bias and the min_tokens ban in the sampler, against OpenAI's formula and
transformers' repetition penalty; a row's draw still depends on nothing but its own row."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from core.messages import MAX_LOGPROBS, Sampling, TokenBias
from engine.sampling.sampler import History, draw, make_generator, sample

VOCAB = 1000
PROMPT = [5, 6, 7, 7]
OUTPUT = [3, 3, 9, 5, 3]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def history(banned: tuple[int, ...] = ()) -> History:
    return History([*PROMPT, *OUTPUT], len(PROMPT), banned)


def openai_penalized(logits: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula, over the output only."""
    counts = torch.zeros(VOCAB)
    for token in OUTPUT:
        counts[token] += 1
    return logits - frequency * counts - presence * (counts > 0).float()


def hf_repetition(logits: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty over prompt + output."""
    ids = torch.tensor([[*PROMPT, *OUTPUT]])
    return RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[None].clone())[0]


def assert_logprobs_of(expected_logits: torch.Tensor, params: Sampling, hist: History) -> None:
    """Drawing from LOGITS gives the greedy token and the logprobs of `expected_logits`."""
    got = draw(LOGITS[None], [params], [make_generator(0)], [hist])[0]
    expected = torch.log_softmax(expected_logits, dim=-1)
    assert got.token_id == int(expected.argmax())
    assert got.logprob == pytest.approx(float(expected[got.token_id]), abs=1e-5)
    values, ids = expected.topk(MAX_LOGPROBS)
    assert [t.token_id for t in got.top] == ids.tolist()
    assert [t.logprob for t in got.top] == pytest.approx(values.tolist(), abs=1e-5)


LOGITS = random_logits(1, seed=0)[0]


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3),
                                                     (-2.0, 2.0)])
def test_presence_and_frequency_follow_openai(presence: float, frequency: float) -> None:
    params = Sampling(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
                      logprobs=MAX_LOGPROBS)
    assert_logprobs_of(openai_penalized(LOGITS, presence, frequency), params, history())


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    params = Sampling(temperature=0.0, repetition_penalty=penalty, logprobs=MAX_LOGPROBS)
    assert_logprobs_of(hf_repetition(LOGITS, penalty), params, history())


def test_all_three_apply_in_vllms_order() -> None:
    """Repetition first (it scales the raw logits), then frequency and presence."""
    params = Sampling(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3,
                      repetition_penalty=1.5, logprobs=MAX_LOGPROBS)
    expected = openai_penalized(hf_repetition(LOGITS, 1.5), 0.4, 0.3)
    assert_logprobs_of(expected, params, history())


def test_a_penalty_moves_greedy_off_a_repeated_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    settings: tuple[dict[str, Any], ...] = ({}, {"presence_penalty": 1.0},
                                            {"frequency_penalty": 0.2},
                                            {"repetition_penalty": 1.5})
    plain, presence, frequency, repetition = (
        sample(logits, [Sampling(temperature=0.0, **kwargs)], [make_generator(0)], [history()])
        for kwargs in settings)
    assert plain == [3] and presence == frequency == repetition == [4]


def test_prompt_tokens_are_not_frequency_or_presence_penalized() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 1.0, 0.8  # 7 is in the prompt only, 8 nowhere
    params = Sampling(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample(logits, [params], [make_generator(0)], [history()]) == [7]
    with_repetition = Sampling(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [with_repetition], [make_generator(0)], [history()]) == [8]


def test_without_penalties_the_history_changes_nothing() -> None:
    logits = random_logits(4, seed=1)
    params = [Sampling(temperature=t, logprobs=3, seed=1) for t in (0.0, 0.5, 1.0, 1.5)]
    alone = draw(logits, params, [make_generator(i) for i in range(4)])
    with_history = draw(logits, params, [make_generator(i) for i in range(4)], [history()] * 4)
    assert alone == with_history


def test_banned_tokens_are_never_drawn() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    banned = history(banned=(0, 1))
    generator = make_generator(0)
    drawn = {sample(logits, [Sampling(temperature=2.0)], [generator], [banned])[0]
             for _ in range(300)}
    assert drawn and not drawn & {0, 1}
    greedy = draw(logits, [Sampling(temperature=0.0, logprobs=2)], [generator], [banned])[0]
    assert greedy.token_id == 2
    assert greedy.top[0].token_id == 2 and {0, 1}.isdisjoint(t.token_id for t in greedy.top)


def test_ids_outside_the_vocabulary_are_ignored() -> None:
    logits = random_logits(1, seed=2)
    outside = History([-1, VOCAB, VOCAB + 7, 3], 0, banned=(VOCAB, -5))
    params = Sampling(temperature=0.0, presence_penalty=1.0, repetition_penalty=1.2)
    inside = History([3], 0)
    generator = make_generator(0)
    assert sample(logits, [params], [generator], [outside]) == sample(
        logits, [params], [generator], [inside])


def test_a_penalized_row_is_independent_of_its_batch() -> None:
    logits = random_logits(3, seed=3)
    params = [Sampling(temperature=0.9, presence_penalty=1.0, seed=1),
              Sampling(temperature=0.8, top_p=0.9, frequency_penalty=0.5,
                       repetition_penalty=1.3, logprobs=4, seed=2),
              Sampling(temperature=0.0, repetition_penalty=0.8)]
    histories = [History([1, 2, 2], 1), history(banned=(11,)), History(list(range(50)), 25)]
    for _ in range(20):
        seeds = torch.randint(0, 2**31, (3,)).tolist()
        batched = draw(logits, params, [make_generator(s) for s in seeds], histories)
        alone = [draw(logits[row:row + 1], params[row:row + 1], [make_generator(seeds[row])],
                      histories[row:row + 1])[0] for row in range(3)]
        assert batched == alone


def test_penalties_do_not_touch_the_callers_logits() -> None:
    logits = random_logits(2, seed=4)
    before = logits.clone()
    params = [Sampling(temperature=0.0, presence_penalty=1.0, repetition_penalty=1.5)] * 2
    sample(logits, params, [make_generator(0)] * 2, [history(banned=(1,))] * 2)
    assert torch.equal(logits, before)


def test_logit_bias_adds_to_the_logits_the_logprobs_show() -> None:
    logits = random_logits(1, seed=5)
    biases = [TokenBias(3, 2.5), TokenBias(9, -7.0), TokenBias(VOCAB + 1, 50.0)]
    got = draw(logits, [Sampling(temperature=0.0, logprobs=5, logit_bias=biases)],
               [make_generator(0)])[0]
    expected = logits[0].clone()
    expected[3] += 2.5
    expected[9] -= 7.0
    logprobs = torch.log_softmax(expected, dim=-1)
    assert got.token_id == int(expected.argmax())
    assert got.logprob == pytest.approx(float(logprobs[got.token_id]), abs=1e-5)
    assert [t.token_id for t in got.top] == logprobs.topk(5).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_a_bias_of_100_forces_a_token_and_minus_100_bans_one(temperature: float) -> None:
    logits = random_logits(1, seed=6)
    generator = make_generator(1)
    forced = Sampling(temperature=temperature, logit_bias=[TokenBias(17, 100.0)])
    assert {sample(logits, [forced], [generator])[0] for _ in range(50)} == {17}
    favourite = int(logits[0].argmax())
    banned = Sampling(temperature=temperature, logit_bias=[TokenBias(favourite, -100.0)])
    assert favourite not in {sample(logits, [banned], [generator])[0] for _ in range(200)}


def test_logit_bias_does_not_touch_the_callers_logits_or_other_rows() -> None:
    logits = random_logits(2, seed=7)
    before = logits.clone()
    params = [Sampling(temperature=0.0, logit_bias=[TokenBias(0, 100.0)]),
              Sampling(temperature=0.0)]
    assert sample(logits, params, [make_generator(0)] * 2) == [0, int(logits[1].argmax())]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": float("nan")}, {"frequency_penalty": float("inf")},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
    {"repetition_penalty": float("inf")}, {"logprobs": -1}, {"logprobs": MAX_LOGPROBS + 1},
    {"logit_bias": [TokenBias(1, float("inf"))]},
])
def test_bad_penalties_and_logprobs_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Sampling(**kwargs)
