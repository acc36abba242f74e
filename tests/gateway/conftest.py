"""Fixtures the gateway's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path) -> PreTrainedTokenizerBase:
    """The real model's tokenizer, a fresh one per module (a test may change its template)."""
    return AutoTokenizer.from_pretrained(real_model_dir)
