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
import re
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import zmq

from kvtransfer.base import BadChunk
from kvtransfer.sender import StagedKVSender
from kvtransfer.wire import (
    DTYPES,
    KVHeader,
    byte_array,
    checksum,
    nbytes_of,
)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"raging-kv-(\d+)-[0-9a-f]{12}")
_MAX_OPEN = 64


class ShmSegment:
    """A named shared-memory buffer this process owns; removed on `close`."""

    def __init__(self, size: int) -> None:
        self.name = f"raging-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        self.map.close()
        self.path.unlink(missing_ok=True)


def sweep_dead_segments() -> int:
    """Remove the segments of senders that are gone; the number removed."""
    removed = 0
    for path in SHM_DIR.glob("raging-kv-*"):
        match = _NAME.fullmatch(path.name)
        if match and not alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class ShmKVSender(StagedKVSender):
    """Stages chunks in its shared-memory segment."""

    backend = "shm"

    def __init__(self, context: zmq.Context, buffer_bytes: int, lease_s: float) -> None:
        sweep_dead_segments()
        self.buffer = ShmSegment(buffer_bytes)
        super().__init__(context, self.buffer.name, buffer_bytes, lease_s)

    def _stage(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> int:
        region = self.buffer.array[offset:offset + k.nbytes + v.nbytes]
        np.copyto(region[:k.nbytes], byte_array(k))
        np.copyto(region[k.nbytes:], byte_array(v))
        return checksum(memoryview(region))

    def close(self) -> None:
        super().close()
        self.buffer.close()


class ShmReader:
    """Verifies placed chunks where they lie in the senders' segments, mapping each once."""

    def __init__(self) -> None:
        self.maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def read(self, header: KVHeader) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V in the segment: valid until the receiver releases the region."""
        placement = header.placement
        assert placement is not None
        mapped = self._open(placement.segment)
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

    def _open(self, name: str) -> mmap.mmap:
        if name in self.maps:
            self.maps.move_to_end(name)
            return self.maps[name]
        if not _NAME.fullmatch(name):
            raise BadChunk("placement", f"not a KV segment name: {name[:80]!r}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)  # writable only so torch can view it
        except OSError as exc:
            raise BadChunk("placement", f"cannot open segment {name} (same host?): {exc}") from None
        try:
            mapped = mmap.mmap(fd, 0)
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            raise BadChunk("placement", f"cannot map segment {name}: {exc}") from None
        finally:
            os.close(fd)
        if len(self.maps) >= _MAX_OPEN:
            self._close(self.maps.popitem(last=False)[1])
        self.maps[name] = mapped
        return mapped

    def close(self) -> None:
        for mapped in self.maps.values():
            self._close(mapped)
        self.maps.clear()

    @staticmethod
    def _close(mapped: mmap.mmap) -> None:
        with contextlib.suppress(BufferError):  # a tensor still views it: it goes with that
            mapped.close()
