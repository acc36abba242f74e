"""What the workers get for a request: every sampling control, and where its output starts."""

from __future__ import annotations

from dataclasses import replace

from core.messages import JSON_OBJECT, Sampling, Thinking
from gateway.openai_api import generation_task
from gateway.params import GenerationParams


def test_every_control_reaches_the_task() -> None:
    params = GenerationParams(
        temperature=0.5, top_p=0.9, top_k=7, seed=3, stop_token_ids=(4, 5), ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_tokens=2,
        logprobs=4, min_p=0.1, allowed_token_ids=(3, 4), priority=-2)
    task = generation_task(params, [10, 11, 12], 20, "salt", [[7], [8, 9]])
    assert task.sampling == Sampling(0.5, 0.9, 7, 3, 0.5, -0.5, 1.3, 4, 0.1, [3, 4], [[7], [8, 9]])
    assert task.priority == -2
    assert (task.prompt_ids, task.max_tokens, task.stop_token_ids, task.ignore_eos) == (
        [10, 11, 12], 20, [4, 5], True)
    assert (task.cache_salt, task.min_tokens, task.prompt_len, task.output_before) == (
        "salt", 2, 3, 0)
    assert task.thinking is None


def test_the_thought_a_grammar_waits_out_reaches_the_task() -> None:
    waits = Thinking(opened=True)
    params = GenerationParams(grammar=JSON_OBJECT)
    assert generation_task(params, [10, 11], 20, "", waits=waits).thinking == waits


def test_a_resumed_task_knows_which_of_its_prompt_is_output() -> None:
    """The dispatcher resumes a request with the streamed tokens appended to its prompt
    (dataclasses.replace): penalties and min_tokens still count them as output."""
    task = generation_task(GenerationParams(min_tokens=4), [10, 11, 12], 20, "")
    resumed = replace(task, prompt_ids=[*task.prompt_ids, 7, 8], max_tokens=18)
    assert (resumed.prompt_len, resumed.output_before, resumed.min_tokens) == (3, 2, 4)
