"""Decode attention read straight from the paged KV cache (a small C++ kernel).

Gathering every sequence's context into a dense tensor before attending costs three passes over
the KV per layer (read, write, read again); the kernel makes one. It is compiled once per
machine with the system C++ compiler (about 30 s, cached under ~/.cache/torch_extensions);
where that fails, attention falls back to gather + SDPA.
"""

from __future__ import annotations

import fcntl
import logging
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import get_default_build_root, load

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@cache
def kernel() -> ModuleType | None:
    """The compiled kernel, or None (logged once) when it cannot be built here."""
    folder = Path(get_default_build_root()) / f"raging_paged_decode-torch{torch.__version__}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / "raging.flock"):
            # torch's own lock file outlives a build that was killed, and then every later
            # build waits on it forever; holding our lock, no build of ours is running.
            (folder / "lock").unlink(missing_ok=True)
            return load(name="raging_paged_decode", sources=[str(_SOURCE)],
                        extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                        build_directory=str(folder))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        log.warning("paged decode kernel unavailable, using gather + SDPA: %s", exc)
        return None


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, released by the kernel when its holder dies."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, contexts: torch.Tensor, block_size: int
                 ) -> torch.Tensor | None:
    """Attention of one query token per sequence `[B, H, D]` over its cached context, or None
    when the kernel does not apply (a cache neither fp32 nor bf16, or no kernel built)."""
    module = kernel() if k_cache.dtype in KERNEL_DTYPES else None
    if module is None:
        return None
    out = module.paged_decode(q.float().contiguous(), k_cache, v_cache, tables, contexts,
                              block_size)
    return out.to(q.dtype)
