"""The sampler's logprobs: torch.log_softmax of the (penalized) logits, whatever the sampling."""

from __future__ import annotations

import pytest
import torch

from core.messages import MAX_LOGPROBS, Sampling, TopLogprob
from engine.sampling.sampler import Draw, History, draw, make_generator, prompt_logprobs

VOCAB = 1000


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("params", [
    Sampling(temperature=0.0, logprobs=5),
    Sampling(temperature=0.7, logprobs=1, seed=3),
    Sampling(temperature=1.3, top_k=3, logprobs=MAX_LOGPROBS),
    Sampling(temperature=1.0, top_p=0.5, logprobs=2),
], ids=repr)
def test_logprobs_are_log_softmax_before_temperature_top_k_and_top_p(params: Sampling) -> None:
    logits = random_logits(4, seed=0)
    expected = torch.log_softmax(logits, dim=-1)
    draws = draw(logits, [params] * 4, [make_generator(row) for row in range(4)])
    for row, got in enumerate(draws):
        assert got.logprob == pytest.approx(float(expected[row, got.token_id]), abs=1e-6)
        values, ids = expected[row].topk(params.logprobs or 0)
        assert [t.token_id for t in got.top] == ids.tolist()
        assert [t.logprob for t in got.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_greedy_takes_the_best_logprob() -> None:
    logits = random_logits(3, seed=1)
    for got in draw(logits, [Sampling(temperature=0.0, logprobs=3)] * 3, [make_generator(0)] * 3):
        assert got.logprob is not None and got.top[0] == TopLogprob(got.token_id, got.logprob)
        assert got.top[0].logprob >= got.top[1].logprob >= got.top[2].logprob


def test_logprobs_zero_gives_the_drawn_tokens_only() -> None:
    got = draw(random_logits(1, seed=2), [Sampling(logprobs=0)], [make_generator(0)])[0]
    assert got.logprob is not None and got.logprob <= 0 and got.top == []


def test_no_logprobs_unless_asked() -> None:
    logits = random_logits(2, seed=3)
    params = [Sampling(temperature=0.0), Sampling(temperature=0.9)]
    draws = draw(logits, params, [make_generator(0), make_generator(1)])
    assert all(d == Draw(d.token_id) for d in draws)


def test_asking_for_logprobs_does_not_change_the_draw() -> None:
    logits = random_logits(5, seed=4)
    plain = [Sampling(temperature=0.8, top_k=50, seed=9)] * 5
    asking = [Sampling(temperature=0.8, top_k=50, seed=9, logprobs=4)] * 5
    tokens = [d.token_id for d in draw(logits, plain, [make_generator(r) for r in range(5)])]
    with_logprobs = draw(logits, asking, [make_generator(r) for r in range(5)])
    assert tokens == [d.token_id for d in with_logprobs]


def test_low_precision_logits_are_scored_in_float32() -> None:
    logits = random_logits(1, seed=5).to(torch.bfloat16)
    got = draw(logits, [Sampling(temperature=0.0, logprobs=2)], [make_generator(0)])[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[0]
    assert got.logprob == pytest.approx(float(expected.max()), abs=1e-6)


def test_a_banned_token_has_no_probability_left() -> None:
    logits = random_logits(1, seed=6)
    best = int(logits.argmax())
    got = draw(logits, [Sampling(temperature=0.0, logprobs=MAX_LOGPROBS)], [make_generator(0)],
               [History([], 0, banned=(best,))])[0]
    expected = torch.log_softmax(logits[0].index_fill(0, torch.tensor([best]), -torch.inf), -1)
    assert got.token_id != best and best not in {t.token_id for t in got.top}
    assert got.logprob == pytest.approx(float(expected[got.token_id]), abs=1e-6)


def test_a_vocabulary_smaller_than_k_gives_every_token() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    got = draw(logits, [Sampling(temperature=0.0, logprobs=MAX_LOGPROBS)], [make_generator(0)])[0]
    assert [t.token_id for t in got.top] == [2, 1, 0]


def test_a_one_token_prompt_has_no_prompt_logprobs_to_give() -> None:
    """Its only row predicts the output, so no row is scored (an empty index, not a crash)."""
    assert prompt_logprobs(torch.randn(0, 50), [], 3) == []


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_are_each_row_s_raw_log_softmax_at_its_target(k: int) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    targets = [7, 0, 49, 7]
    entries = prompt_logprobs(logits, targets, k)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for entry, row, target in zip(entries, expected, targets, strict=True):
        assert entry.logprob == pytest.approx(float(row[target]), abs=1e-6)
        values, ids = row.topk(k)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
