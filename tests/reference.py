"""What transformers itself computes from a model folder, for tests to hold the engine to."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def last_hidden_state(model_dir: Path, prompt_ids: list[int]) -> torch.Tensor:
    """The prompt's last token's final hidden state (after the model's last norm), fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = model.model(torch.tensor([prompt_ids])).last_hidden_state
    return states[0, -1]


def is_hidden_state(embedding: bytes, expected: torch.Tensor, tolerance: float = 1e-4) -> bool:
    """Whether a worker's embedding bytes (engine/pooling.py) hold `expected`."""
    got = torch.frombuffer(bytearray(embedding), dtype=torch.float32)
    return torch.allclose(got, expected, atol=tolerance, rtol=tolerance)
