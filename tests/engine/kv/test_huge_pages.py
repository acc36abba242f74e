"""The KV cache's host memory: zeroed, aligned to a huge page, and advised onto huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low <= address < high
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_are_zero_aligned_and_shaped(dtype: torch.dtype) -> None:
    tensor = huge_pages.zeros((3, 1000, 3, 64), dtype)
    assert tensor.shape == (3, 1000, 3, 64) and tensor.dtype == dtype
    assert tensor.is_contiguous() and not tensor.any()
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    tensor[2, 999] = 1  # the whole extent is writable
    assert int(tensor.sum()) == 3 * 64


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has transparent huge pages off")
def test_the_memory_is_advised_onto_huge_pages() -> None:
    tensor = huge_pages.zeros((8, huge_pages.HUGE_PAGE // 4), torch.float32)  # 16 MB
    assert "hg" in vm_flags(tensor.data_ptr())
