"""Sampling: greedy, top-k/top-p edge cases, and per-request reproducibility."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core.messages import Sampling
from engine.sampling.sampler import History, draw, make_generator, sample, seed_at

VOCAB = 1000


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(5, seed=0)
    params = [Sampling(temperature=0.0)] * 5
    tokens = sample(logits, params, [make_generator(None) for _ in range(5)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert params[0].greedy and not Sampling().greedy


def test_each_output_position_of_a_seeded_request_has_a_seed_of_its_own() -> None:
    """Whoever draws position j (the prefill worker, a decode worker, one it resumed on) draws
    with the same seed; positions, and requests whose seeds are near (choice i: seed + i),
    never share one."""
    seeds = {seed_at(seed, position) for seed in (0, 1, 2, 2**64 - 1) for position in range(64)}
    assert len(seeds) == 4 * 64
    assert all(seed is not None and 0 <= seed < 2**63 for seed in seeds)
    assert seed_at(5, 3) == seed_at(5, 3) and seed_at(None, 3) is None
    logits = random_logits(1, seed=3)
    wanted = Sampling(temperature=1.0, seed=5)
    draws = [sample(logits, [wanted], [make_generator(seed_at(5, j))])[0] for j in range(32)]
    assert len(set(draws)) > 1  # the positions draw apart, from one set of logits


def test_seeded_request_is_independent_of_its_batch() -> None:
    logits = random_logits(6, seed=1)
    wanted = Sampling(temperature=0.8, top_p=0.9, top_k=50, seed=123)
    alone = [sample(logits[2:3], [wanted], [g])[0] for g in [make_generator(123)] * 20]
    others = [Sampling(temperature=1.3, seed=None), Sampling(top_p=0.5)]
    generators = [make_generator(None), make_generator(123), make_generator(7)]
    batched = [
        sample(logits[1:4], [others[0], wanted, others[1]], generators)[1] for _ in range(20)
    ]
    assert alone == batched
    assert len(set(alone)) > 1  # really sampled, not collapsed to argmax


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = random_logits(1, seed=2)
    params = [Sampling(temperature=1.0)]

    def draw(seed: int) -> list[int]:
        g = make_generator(seed)
        return [sample(logits, params, [g])[0] for _ in range(30)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(8, seed=3)
    argmax = logits.argmax(dim=-1).tolist()
    for params in (Sampling(temperature=2.0, top_k=1), Sampling(top_p=1e-6)):
        generators = [make_generator(i) for i in range(8)]
        assert sample(logits, [params] * 8, generators) == argmax


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = random_logits(1, seed=4)
    best = set(logits[0].topk(3).indices.tolist())
    g = make_generator(0)
    drawn = {sample(logits, [Sampling(temperature=5.0, top_k=3)], [g])[0] for _ in range(200)}
    assert drawn == best


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = make_generator(0)
    drawn = {sample(logits, [Sampling(top_p=0.7)], [g])[0] for _ in range(300)}
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}]
)
def test_bad_params_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Sampling(**kwargs)


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    generator = make_generator(3)
    draws = [sample(probs.log()[None], [Sampling(temperature=1.0)], [generator])[0]
             for _ in range(4000)]
    shares = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(shares, probs, atol=0.03), shares


def test_rounding_noise_in_the_logits_does_not_change_the_draw() -> None:
    """Another batch shape moves logits by rounding errors: near-uniform logits (a random
    model's) must still give the same token for the same seed, top-p on or off."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 0.01
    noisy = logits + torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 1e-6
    for params in (Sampling(temperature=0.9), Sampling(temperature=0.9, top_p=0.95)):
        same = sum(
            sample(logits[None], [params], [make_generator(seed)])
            == sample(noisy[None], [params], [make_generator(seed)])
            for seed in range(100))
        assert same >= 98, (params, same)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    logits = random_logits(2, seed=4)
    params = [Sampling(temperature=temperature, top_p=0.5)] * 2
    generators = [make_generator(0), make_generator(1)]
    assert sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_nan_logits_do_not_raise() -> None:
    logits = torch.full((1, VOCAB), float("nan"))
    token = sample(logits, [Sampling(temperature=0.7, top_p=0.9)], [make_generator(0)])[0]
    assert 0 <= token < VOCAB


def _logits(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1: min_p 0.5 keeps the first two.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = {sample(logits, [Sampling(min_p=0.5)], [make_generator(s)])[0] for s in range(200)}
    assert kept == {0, 1}
    anything = {sample(logits, [Sampling()], [make_generator(s)])[0] for s in range(200)}
    assert anything == {0, 1, 2, 3}


def test_min_p_one_is_greedy_and_zero_is_off() -> None:
    logits = random_logits(4, seed=9)
    argmax = logits.argmax(dim=-1).tolist()
    generators = [make_generator(i) for i in range(4)]
    assert sample(logits, [Sampling(temperature=2.0, min_p=1.0)] * 4, generators) == argmax
    for seed in range(20):  # min_p 0: the same draws as without it
        assert (sample(logits, [Sampling(min_p=0.0)] * 4, [make_generator(seed)] * 4)
                == sample(logits, [Sampling()] * 4, [make_generator(seed)] * 4))


def test_allowed_token_ids_are_the_only_ones_drawn_greedy_or_not() -> None:
    logits = random_logits(1, seed=4)
    allowed = [3, 17, 512]
    best = max(allowed, key=lambda token: float(logits[0, token]))
    assert sample(logits, [Sampling(temperature=0, allowed_token_ids=allowed)],
                  [make_generator(0)]) == [best]
    drawn = {sample(logits, [Sampling(temperature=5.0, allowed_token_ids=allowed)],
                    [make_generator(s)])[0] for s in range(100)}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_a_bad_words_last_token_is_banned_only_after_the_rest() -> None:
    logits = _logits(0.0, 0.0, 5.0, 1.0)  # greedy picks 2
    word = Sampling(temperature=0, bad_words=[[1, 2]])
    after = History(tokens=[0, 0, 1], output_start=2)  # the output so far ends in 1
    before = History(tokens=[0, 1, 0], output_start=2)  # 1 is in the prompt, then 0
    prompt_only = History(tokens=[0, 1], output_start=2)  # 1 ends the prompt, not the output
    assert draw(logits, [word], [make_generator(0)], [after])[0].token_id == 3
    for history in (before, prompt_only):
        assert draw(logits, [word], [make_generator(0)], [history])[0].token_id == 2
    single = Sampling(temperature=0, bad_words=[[2]])  # one token: always banned
    assert sample(logits, [single], [make_generator(0)]) == [3]


def test_restrictions_that_leave_nothing_yield() -> None:
    logits = _logits(0.0, 4.0, 1.0)
    nothing = Sampling(temperature=0, allowed_token_ids=[1], bad_words=[[1]])
    assert sample(logits, [nothing], [make_generator(0)]) == [1]
    grammar = History(allowed=torch.tensor([True, False, False]))
    disjoint = Sampling(temperature=0, allowed_token_ids=[1])
    assert draw(logits, [disjoint], [make_generator(0)], [grammar])[0].token_id == 0
