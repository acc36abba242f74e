"""Fill in the middle end to end: a real 1P+1D cluster of a tiny random code model (the tiny
Llama with Qwen2.5-Coder's markers in its vocabulary) fills a gap through OpenAI's `suffix`,
Ollama's `suffix` and llama.cpp's `/infill` (its `prompt`, the cursor's line, after the
prefix), each prompt laid out as the model learned it and
each middle transformers' own greedy continuation of that layout; a file separator ends a
middle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from engine.weights.tokenizer import load_tokenizer
from tests.e2e.cluster import Cluster, greedy_reference, launch

pytestmark = pytest.mark.e2e

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
LENGTH = 12


@pytest.fixture(scope="module")
def cluster(tiny_coder_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("infill"), tiny_coder_dir) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_coder_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_coder_dir)


@pytest.fixture(scope="module")
def middle(tiny_coder_dir: Path, tokenizer: PreTrainedTokenizerBase
           ) -> Callable[[list[int]], list[int]]:
    """transformers' greedy middle of a prompt: up to LENGTH tokens, ended (and the ending
    left out) by a fill-in-the-middle ending."""
    reference = greedy_reference(tiny_coder_dir)
    endings = {marker(tokenizer, name) for name in
               ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<repo_name>", "<file_sep>")}

    def greedy(prompt: list[int]) -> list[int]:
        tokens = reference(prompt, LENGTH)
        ended = [index for index, token in enumerate(tokens) if token in endings]
        return tokens[:ended[0]] if ended else tokens

    return greedy


def layout(tokenizer: PreTrainedTokenizerBase, *parts: str | int) -> list[int]:
    """Token ids of texts and marker ids, in order, written out here as the model learned
    them (not through gateway/infill.py)."""
    ids: list[int] = []
    for part in parts:
        ids += [part] if isinstance(part, int) else tokenizer.encode(part,
                                                                      add_special_tokens=False)
    return ids


def marker(tokenizer: PreTrainedTokenizerBase, name: str) -> int:
    token = tokenizer.convert_tokens_to_ids(name)
    assert isinstance(token, int)
    return token


def plain_gap(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return layout(tokenizer, marker(tokenizer, "<|fim_prefix|>"), PREFIX,
                  marker(tokenizer, "<|fim_suffix|>"), SUFFIX, marker(tokenizer, "<|fim_middle|>"))


def test_openai_s_suffix_fills_the_gap(cluster: Cluster, tokenizer: PreTrainedTokenizerBase,
                                       middle: Callable[[list[int]], list[int]]) -> None:
    prompt = plain_gap(tokenizer)
    reply = cluster.client.post("/v1/completions", json={
        "model": cluster.model, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": LENGTH,
        "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["text"] == tokenizer.decode(middle(prompt),
                                                          skip_special_tokens=True)


def test_ollama_s_suffix_fills_the_gap(cluster: Cluster, tokenizer: PreTrainedTokenizerBase,
                                       middle: Callable[[list[int]], list[int]]) -> None:
    prompt = plain_gap(tokenizer)
    reply = cluster.client.post("/api/generate", json={
        "model": cluster.model, "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
        "options": {"temperature": 0, "num_predict": LENGTH}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_eval_count"] == len(prompt)
    expected = middle(prompt)
    eos = marker(tokenizer, "<|im_end|>")  # Ollama's generate stops at EOS
    expected = expected[:expected.index(eos)] if eos in expected else expected
    assert body["response"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_llama_cpp_s_infill_fills_the_gap_after_the_project_s_files(
        cluster: Cluster, tokenizer: PreTrainedTokenizerBase,
        middle: Callable[[list[int]], list[int]]) -> None:
    separator = marker(tokenizer, "<|file_sep|>")
    prompt = layout(tokenizer, marker(tokenizer, "<|repo_name|>"), "project\n",
                    separator, "util.py\nTWO = 2\n", separator, "filename\n",
                    marker(tokenizer, "<|fim_prefix|>"), PREFIX + "return",
                    marker(tokenizer, "<|fim_suffix|>"), SUFFIX,
                    marker(tokenizer, "<|fim_middle|>"))
    reply = cluster.client.post("/infill", json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "return",
        "input_extra": [{"filename": "util.py", "text": "TWO = 2"}], "n_predict": LENGTH,
        "temperature": 0, "ignore_eos": True, "return_tokens": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens_evaluated"] == len(prompt)
    assert body["tokens"] == middle(prompt)
    warmed = cluster.client.post("/infill", json={"input_prefix": PREFIX, "n_predict": 0})
    assert warmed.status_code == 200, warmed.text  # an editor's cache warm-up
    assert (warmed.json()["content"], warmed.json()["tokens_predicted"]) == ("", 0)


def test_a_file_separator_ends_the_middle(cluster: Cluster,
                                          tokenizer: PreTrainedTokenizerBase) -> None:
    separator = marker(tokenizer, "<|file_sep|>")
    reply = cluster.client.post("/v1/completions", json={
        "model": cluster.model, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": LENGTH,
        "temperature": 0, "ignore_eos": True, "logit_bias": {str(separator): 100}})
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
