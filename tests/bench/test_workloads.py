"""Workloads: prompt lengths, seeds, HumanEval's 164 prompts, the share of long prompts."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench.prompts import TextPrompts, TokenPrompts
from bench.workloads import CHAT_INPUT, CHAT_OUTPUT, LONG_INPUT, Workload, build, humaneval_prompts


@pytest.fixture(scope="module")
def token_prompts(real_model_dir: Path) -> TokenPrompts:
    return TokenPrompts(real_model_dir)


def test_token_prompts_have_exact_lengths_and_distinct_starts(
    token_prompts: TokenPrompts,
) -> None:
    for length in (1, 5, 200, 4000):
        assert len(token_prompts.prompt(7, length)) == length
    assert token_prompts.prompt(1, 16) != token_prompts.prompt(2, 16)
    assert token_prompts.prompt(3, 50) == token_prompts.prompt(3, 50)


def test_text_prompts_are_about_the_asked_length(real_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    for length in (50, 200, 2000):
        text = TextPrompts().prompt(0, length)
        assert 0.8 * length <= len(tokenizer.encode(text)) <= 1.2 * length
    assert TextPrompts().count("anything") is None


def test_fixed(token_prompts: TokenPrompts) -> None:
    specs = build(Workload("fixed", input_len=200, output_len=64), token_prompts, 5)
    assert [s.index for s in specs] == [0, 1, 2, 3, 4]
    assert all(len(s.prompt) == s.input_len == 200 and s.output_len == 64 for s in specs)
    assert len({s.prompt for s in specs}) == 5


def test_chat_lengths_follow_the_documented_lognormals() -> None:
    specs = build(Workload("chat", seed=3), TextPrompts(), 2000)
    inputs = [s.input_len for s in specs if s.input_len is not None]
    assert len(inputs) == len(specs)
    outputs = [s.output_len for s in specs]
    assert CHAT_INPUT.low <= min(inputs) and max(inputs) <= CHAT_INPUT.high
    assert CHAT_OUTPUT.low <= min(outputs) and max(outputs) <= CHAT_OUTPUT.high
    assert statistics.median(inputs) == pytest.approx(200, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(120, rel=0.1)
    assert len(set(inputs)) > 300  # spread, not a constant


def test_seeds_repeat_and_differ() -> None:
    def lengths(seed: int) -> list[tuple[int | None, int]]:
        return [(s.input_len, s.output_len)
                for s in build(Workload("mixed", seed=seed), TextPrompts(), 100)]

    assert lengths(1) == lengths(1)
    assert lengths(1) != lengths(2)


def test_mixed_share_of_long_prompts() -> None:
    specs = build(Workload("mixed", long_share=0.07, seed=5), TextPrompts(), 1000)
    long = [s for s in specs if s.kind == "long"]
    assert len(long) == 70
    assert all(LONG_INPUT[0] <= (s.input_len or 0) <= LONG_INPUT[1] for s in long)
    assert all(s.kind == "chat" and (s.input_len or 0) <= CHAT_INPUT.high
               for s in specs if s.kind != "long")
    positions = [s.index for s in long]
    assert positions != list(range(70)) and max(positions) > 500  # scattered among the chats
    assert not [s for s in build(Workload("mixed", long_share=0), TextPrompts(), 100)
                if s.kind == "long"]


def test_humaneval_has_164_prompts(token_prompts: TokenPrompts) -> None:
    prompts = humaneval_prompts()
    assert len(prompts) == 164 and len(set(prompts)) == 164
    assert all("def " in p for p in prompts)
    specs = build(Workload("humaneval", output_len=32, seed=0), token_prompts, 200)
    assert {s.prompt for s in specs[:164]} == set(prompts)  # every one, before any repeats
    assert specs[164].prompt == specs[0].prompt
    assert all(s.output_len == 32 and s.input_len == token_prompts.count(str(s.prompt))
               for s in specs)


def test_bad_workloads_are_refused() -> None:
    for bad in ({"name": "nope"}, {"name": "fixed", "input_len": 0},
                {"name": "mixed", "long_share": 1.5}):
        with pytest.raises(ValueError):
            Workload(**bad)


def test_output_cap_and_prompt_numbering() -> None:
    capped = build(Workload("chat", seed=1, max_output_len=48), TextPrompts(), 200)
    uncapped = build(Workload("chat", seed=1), TextPrompts(), 200)
    assert [s.output_len for s in capped] == [min(48, s.output_len) for s in uncapped]
    assert max(s.output_len for s in uncapped) > 48
    later = build(Workload("chat", seed=1), TextPrompts(), 3, first_prompt=500)
    assert [s.index for s in later] == [0, 1, 2]
    assert later[0].prompt == TextPrompts().prompt(500, later[0].input_len or 0)
    assert Workload("chat", max_output_len=48).describe()["max_output_len"] == 48
    with pytest.raises(ValueError):
        Workload("chat", max_output_len=0)


def test_messages_are_chat_requests_of_about_input_len_tokens(real_model_dir: Path,
                                                              token_prompts: TokenPrompts) -> None:
    specs = build(Workload("messages", input_len=170, output_len=64), token_prompts, 3,
                  first_prompt=10)
    assert all(s.chat and s.kind == "message" and s.output_len == 64 for s in specs)
    assert specs[0].prompt == TextPrompts().prompt(10, 170)  # text, whatever the prompt maker
    assert len({s.prompt for s in specs}) == 3
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    for spec in specs:
        assert spec.input_len == len(tokenizer.encode(str(spec.prompt)))
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": str(spec.prompt)}], add_generation_prompt=True,
            tokenize=False)
        assert 198 <= len(tokenizer.encode(str(templated))) <= 208  # ~203: peers' prompts
    described = Workload("messages", input_len=170, output_len=64).describe()
    assert described["endpoint"] == "/v1/chat/completions" and described["input_len"] == 170
