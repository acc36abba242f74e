"""The KV plane's messages.

Sender to receiver, in order on one socket: `KVHeader` (a chunk: a range of layers of a range
of tokens from `token_start`; its K and V follow as two raw frames, or lie in a shared buffer
named by its `Placement`) and `KVNotice` (a small control message for the receiving worker,
ordered with the chunks). Receiver to sender:
`KVRelease`, when a placed chunk has been copied out and its region may be reused.

The format is per token ([layers, tokens, kv_heads, head_dim]), not per block, so the two sides
may page their caches differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from core.codec import Codec
from core.messages import Keyed, RequestKey

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class Placement:
    """Where a chunk's K and V lie when they do not follow the header: V right after K."""

    kind: str  # "shm" | "cuda_ipc"
    segment: str  # the sender's buffer: a shared-memory name, or an exported CUDA buffer's id
    offset: int  # bytes into the segment
    ticket: int  # names this use of the region in the receiver's `KVRelease`
    handle: bytes  # what opens the segment (a CUDA IPC handle); empty for shared memory


@dataclass(frozen=True)
class KVHeader(Keyed):
    request_id: str
    epoch: int
    layer_start: int
    layer_end: int
    num_tokens: int
    dtype: str
    shape: list[int]  # of K and of V: [layers, tokens, kv_heads, head_dim]
    checksum: int  # xxh3-64 of K's bytes then V's (a device-side sum for CUDA placements)
    placement: Placement | None  # None: K and V are the next two frames
    token_start: int = 0  # the chunk's first token position in its request's prompt


@dataclass(frozen=True)
class KVNotice(Keyed):
    """A control message for the receiving worker, delivered in order with the chunks."""

    request_id: str
    epoch: int
    meta: bytes


@dataclass(frozen=True)
class KVRelease:
    """Receiver to sender: the placed chunk of `ticket` has been read; its region may be reused."""

    segment: str
    ticket: int


@dataclass(frozen=True)
class KVPayload:
    """A received, verified chunk of KV. When `borrowed`, K and V view the sender's staging
    buffer and are valid only while the receiver's drain handles them."""

    header: KVHeader
    k: torch.Tensor
    v: torch.Tensor
    borrowed: bool = False

    @property
    def key(self) -> RequestKey:
        return self.header.key


@dataclass(frozen=True)
class KVRejected(Keyed):
    """A chunk whose header named a request but whose data failed verification."""

    request_id: str
    epoch: int
    reason: str


KVItem = KVPayload | KVNotice | KVRejected  # what a receiver hands its worker, in arrival order

FORWARD_CODEC: Codec[KVHeader | KVNotice] = Codec((KVHeader, KVNotice))
RELEASE_CODEC: Codec[KVRelease] = Codec((KVRelease,))


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def checksum(*buffers: memoryview) -> int:
    """xxh3-64 over the buffers in order: about 10 GB/s here, against 2 GB/s for zlib's crc32,
    and it runs once on each side of every transfer."""
    digest = xxhash.xxh3_64()
    for buffer in buffers:
        digest.update(buffer)
    return digest.intdigest()


_FUSED_CHUNK = 256 * 1024  # copied, then hashed while still in the core's L2 cache


def copy_and_hash(pairs: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Copy each (destination, source) pair of equal-sized byte arrays, in order, and return
    the xxh3-64 of all the bytes copied, in one pass over memory: each piece is hashed right
    after it is copied, while it is still in cache (copy, then hash, would read it twice)."""
    digest = xxhash.xxh3_64()
    for destination, source in pairs:
        assert destination.nbytes == source.nbytes
        for start in range(0, source.nbytes, _FUSED_CHUNK):
            piece = destination[start:start + _FUSED_CHUNK]
            np.copyto(piece, source[start:start + _FUSED_CHUNK])
            digest.update(piece.data)
    return digest.intdigest()


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy flat uint8 array over a contiguous CPU tensor."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return tensor.reshape(-1).view(torch.uint8).numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def header_problem(header: KVHeader) -> str | None:
    """Why a header cannot describe a chunk, or None when it can."""
    if header.dtype not in DTYPES:
        return f"unknown dtype {header.dtype!r}"
    if header.token_start < 0:
        return "negative token start"
    if (len(header.shape) != 4 or any(d <= 0 for d in header.shape)
            or header.shape[:2] != [header.layer_end - header.layer_start, header.num_tokens]):
        return "shape does not match the header (or holds no element)"
    return None


def nbytes_of(header: KVHeader) -> int:
    """Bytes of K (and of V) the header describes; it must have passed `header_problem`."""
    count = 1
    for dim in header.shape:
        count *= dim
    return count * DTYPES[header.dtype].itemsize
