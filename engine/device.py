"""Which device `model.device` names. The gateway resolves it without torch (it only needs the
dtype that "auto" picks there, for the KV layout fingerprint); workers resolve it with torch."""

from __future__ import annotations

import os
from pathlib import Path

DeviceType = str  # "cpu" or "cuda"


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible to this process, asked of the driver, not of torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def device_type(name: str) -> DeviceType:
    """"cuda" or "cpu": what `name` (auto, cpu, cuda, cuda:N) runs on, without torch."""
    if name == "auto":
        return "cuda" if gpu_present() else "cpu"
    return name.partition(":")[0]
