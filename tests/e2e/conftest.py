"""Fixtures the end-to-end tests on the tiny random Llama share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.cluster import REAL_LAUNCH_S, TEST_CONFIG, Cluster, greedy_reference, launch


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation of the tiny model by transformers itself."""
    return greedy_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """1 gateway + 1 prefill + 1 decode on the real model, for the module (a module that needs
    another cluster defines its own `cluster`); its context is the module's `CLUSTER_CONTEXT`
    tokens where it sets one (a test that fills the context then prefills it in seconds)."""
    context = getattr(request.module, "CLUSTER_CONTEXT", None)
    config = TEST_CONFIG if context is None else {
        **TEST_CONFIG, "model": {**TEST_CONFIG["model"], "max_model_len": context}}
    with launch(tmp_path_factory.mktemp("run"), real_model_dir, config=config,
                timeout_s=REAL_LAUNCH_S) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official client of the module's `cluster`."""
    with cluster.openai_client() as made:
        yield made
