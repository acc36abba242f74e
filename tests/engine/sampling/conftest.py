"""What the structured-output tests share: the tiny model's grammar compiler and tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.sampling.grammar import Grammars


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> Grammars:
    return Grammars(tiny_model_dir, vocab_size=49152)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)
