"""Co-batched requests cannot see each other: a request's output is the same whether it runs
alone or batched with others, greedy or sampled with its own seed."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, launch

pytestmark = pytest.mark.e2e

PROMPTS = [
    [100 + i for i in range(n)] for n in (1, 7, 15, 16, 17, 33, 5, 48)
]
SAMPLED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), tiny_model_dir) as running:
        yield running


def complete(cluster: Cluster, prompt: list[int], sampling: dict[str, Any]) -> str:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
            **sampling}
    response = cluster.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def settings(index: int) -> list[dict[str, Any]]:
    """Greedy, and sampled with a seed of its own (the same for its two runs)."""
    return [{"temperature": 0}, {**SAMPLED, "seed": 1000 + index}]


@pytest.mark.parametrize("kind", [0, 1], ids=["greedy", "seeded"])
def test_output_alone_equals_output_in_a_batch(cluster: Cluster, kind: int) -> None:
    jobs = [(prompt, settings(i)[kind]) for i, prompt in enumerate(PROMPTS)]
    alone = [complete(cluster, prompt, sampling) for prompt, sampling in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all at once: they share forward passes
        batched = list(pool.map(lambda job: complete(cluster, *job), jobs))
    assert batched == alone
    assert len(set(alone)) > 1  # the prompts really lead to different outputs


def test_seeds_are_per_request(cluster: Cluster) -> None:
    """Two requests with the same prompt and seed agree, batched or not; another seed, run in
    the same batch, neither changes them nor repeats them."""
    prompt = PROMPTS[3]
    same = {**SAMPLED, "seed": 7}
    jobs = [same, {**SAMPLED, "seed": 8}, same, {**SAMPLED, "seed": 9}]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda sampling: complete(cluster, prompt, sampling), jobs))
    assert texts[0] == texts[2] == complete(cluster, prompt, same)
    assert len({texts[0], texts[1], texts[3]}) == 3
