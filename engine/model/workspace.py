"""Scratch tensors reused across layers and steps.

Gathering a decode batch's KV takes tens of MB per layer; a fresh allocation of that size is
mapped anew by the allocator and page-faults on every touch, which costs more than the copy.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Buffers kept on the CPU; on a GPU each `take` is a fresh tensor, since its caching
    allocator already reuses memory and a tensor kept here could be freed under a captured
    CUDA graph that still writes it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous `shape` tensor backed by the buffer `name` (grown when too small).

        Its contents are whatever the last user left: callers overwrite it completely.
        """
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)
