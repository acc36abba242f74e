"""Fixtures the end-to-end tests on the tiny random Llama share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.cluster import greedy_reference


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation of the tiny model by transformers itself."""
    return greedy_reference(tiny_model_dir)
