"""Which copies of the weight matrices a model is built from (model.weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.weights import choice
from engine.weights.choice import available_memory, choose_weights
from engine.weights.files import EMBED, LM_HEAD
from engine.weights.quant_blocks import QuantMatrix, dequantize, quantize

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"


def folder_weights(blocks_only: bool) -> tuple[dict[str, torch.Tensor], dict[str, QuantMatrix]]:
    """A tied model's weights: a norm, an embedding and one matrix, all but the norm with quant
    blocks; with `blocks_only`, as a GGUF prepared directly holds them."""
    g = torch.Generator().manual_seed(0)
    quant = {name: quantize(torch.randn(8, 64, generator=g), 4) for name in (EMBED, Q)}
    dense = {NORM: torch.ones(64)}
    if not blocks_only:
        dense |= {name: dequantize(matrix) for name, matrix in quant.items()}
        dense[LM_HEAD] = dense[EMBED]
    return dense, quant


def test_quant_keeps_no_dense_copy_of_a_matrix_with_blocks() -> None:
    dense, quant = choose_weights(*folder_weights(blocks_only=False), "quant", torch.float32, True)
    assert set(dense) == {NORM} and set(quant) == {EMBED, Q}


@pytest.mark.parametrize("mode", ["dense", "auto"])
def test_dense_copies_are_made_from_the_blocks_where_the_folder_has_none(mode: str) -> None:
    dense, quant = choose_weights(*folder_weights(blocks_only=True), mode,  # type: ignore[arg-type]
                                  torch.bfloat16, True)
    assert set(dense) == {NORM, EMBED, Q, LM_HEAD} and dense[LM_HEAD] is dense[EMBED]
    assert dense[Q].dtype == torch.bfloat16
    assert torch.equal(dense[Q], dequantize(quant[Q]).to(torch.bfloat16))


def test_auto_makes_no_copy_that_takes_over_a_quarter_of_free_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copy_bytes = 2 * 8 * 64 * 4
    monkeypatch.setattr(choice, "available_memory", lambda: 4 * copy_bytes - 1)
    dense, _ = choose_weights(*folder_weights(blocks_only=True), "auto", torch.float32, True)
    assert set(dense) == {NORM}
    monkeypatch.setattr(choice, "available_memory", lambda: 4 * copy_bytes)
    dense, _ = choose_weights(*folder_weights(blocks_only=True), "auto", torch.float32, True)
    assert Q in dense


def test_auto_leaves_a_folder_with_both_copies_as_it_is() -> None:
    given = folder_weights(blocks_only=False)
    dense, quant = choose_weights(*given, "auto", torch.float32, True)
    assert dense == given[0] and quant == given[1]


@pytest.mark.parametrize("mode", ["quant", "auto", "dense"])
def test_blocks_nothing_can_multiply_become_dense(mode: str) -> None:
    dense, quant = choose_weights(*folder_weights(blocks_only=True), mode,  # type: ignore[arg-type]
                                  torch.float32, False)
    assert quant == {} and {EMBED, Q} <= set(dense)


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:  50 kB\n")
    assert available_memory(meminfo) == 50 * 1024
    assert available_memory() > 0
