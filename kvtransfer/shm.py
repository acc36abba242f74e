"""KV through shared memory on one host: ZeroMQ carries only the headers.

The sender owns one segment in /dev/shm (mode 0600), copies each chunk into a region of it and
sends the header with the region's place; the receiver maps the segment once, copies the chunk
out, verifies it and releases the region. A segment whose owner died is removed by the next
sender that starts on the host, so a SIGKILL leaks nothing for long.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from pathlib import Path

import numpy as np
import torch
import zmq

from core.config import KVBackend
from core.curve import CurveKeys
from core.pids import alive
from kvtransfer.base import BadChunk
from kvtransfer.segments import OpenSegments, segment_owner
from kvtransfer.sender import StagedKVSender
from kvtransfer.wire import (
    DTYPES,
    KVHeader,
    byte_array,
    checksum,
    copy_and_hash,
    nbytes_of,
)

SHM_DIR = Path("/dev/shm")
PREFIX = "raging-kv"  # segment names: PREFIX-<owner pid>-<12 hex>


class ShmSegment:
    """A named shared-memory buffer this process owns; removed on `close`."""

    def __init__(self, size: int) -> None:
        self.name = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array.fill(0)  # fault every page in now, not during the first transfers

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        del self.array
        _unmap(self.map)


def sweep_dead_segments() -> int:
    """Remove the segments of senders that are gone; the number removed."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        owner = segment_owner(PREFIX, path.name)
        if owner is not None and not alive(owner):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class ShmKVSender(StagedKVSender):
    """Stages chunks in its shared-memory segment."""

    backend: KVBackend = "shm"

    def __init__(self, context: zmq.Context, buffer_bytes: int, lease_s: float,
                 keys: CurveKeys | None = None) -> None:
        sweep_dead_segments()
        self.buffer = ShmSegment(buffer_bytes)
        super().__init__(context, self.buffer.name, buffer_bytes, lease_s, keys)

    def _stage(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> int:
        region = self.buffer.array[offset:offset + k.nbytes + v.nbytes]
        k_part, v_part = region[:k.nbytes], region[k.nbytes:]
        k, v = self._inline(k, v)  # host copies of KV computed on a GPU
        return copy_and_hash([(k_part, byte_array(k)), (v_part, byte_array(v))])

    def close(self) -> None:
        super().close()
        self.buffer.close()


class ShmReader:
    """Verifies placed chunks where they lie in the senders' segments, mapping each once."""

    def __init__(self) -> None:
        self.segments: OpenSegments[mmap.mmap] = OpenSegments(PREFIX, _unmap)

    def read(self, header: KVHeader) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V in the segment: valid until the receiver releases the region."""
        placement = header.placement
        assert placement is not None
        mapped = self.segments.get(placement.segment, _map)
        nbytes = nbytes_of(header)
        if placement.offset < 0 or placement.offset + 2 * nbytes > len(mapped):
            raise BadChunk("placement", "the chunk lies outside its shared-memory segment")
        region = memoryview(mapped)[placement.offset:placement.offset + 2 * nbytes]
        if checksum(region) != header.checksum:
            raise BadChunk("checksum", "checksum mismatch (region reused or corrupted)")
        dtype = DTYPES[header.dtype]
        k = torch.frombuffer(region[:nbytes], dtype=dtype).view(header.shape)
        v = torch.frombuffer(region[nbytes:], dtype=dtype).view(header.shape)
        return k, v

    def close(self) -> None:
        self.segments.close()


def _map(name: str) -> mmap.mmap:
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR)  # writable only so torch can view it
    except OSError as exc:
        raise BadChunk("placement", f"cannot open segment {name} (same host?): {exc}") from None
    try:
        return mmap.mmap(fd, 0)
    except (OSError, ValueError) as exc:  # ValueError: an empty file
        raise BadChunk("placement", f"cannot map segment {name}: {exc}") from None
    finally:
        os.close(fd)


def _unmap(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a tensor still views it: it goes with that
        mapped.close()
