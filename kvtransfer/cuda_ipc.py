"""KV through CUDA IPC on one device: ZeroMQ carries only the headers, the data stays on the GPU.

The sender owns one device staging buffer (cudaMalloc'd by cupy, outside every memory pool),
exports its IPC handle once and names it in every header; it copies each chunk into a region of
it device to device. The receiver opens the handle once per sender, copies the chunk out device
to device, verifies it and releases the region. Handles are closed when the receiver closes,
when its cache of open handles evicts one, once the sending process is gone or once no chunk
has named it for two minutes (a PID proves nothing from another PID namespace); the sender frees
its buffer on `close`, once its receivers have released every region or the lease ran out.

Checksums are computed on the device (hashing on the host would need a host copy): a sum modulo
2**64 of splitmix64((index << 16) | word) over the little-endian 16-bit words of K's bytes then
V's, indexed from 0 across both. A positional sum of a strong mix, not xxh3: it catches a
reused or overwritten region, not an adversary.

cupy (the `cuda` extra) is imported only when it is used, so this module imports on any host;
on a host without CUDA the sender refuses to start and the reader drops placed chunks.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import zmq

from core.config import KVBackend
from core.curve import CurveKeys
from kvtransfer.base import BadChunk
from kvtransfer.segments import OpenSegments
from kvtransfer.sender import StagedKVSender
from kvtransfer.wire import DTYPES, KVHeader, Placement, nbytes_of

log = logging.getLogger(__name__)

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_MASK = 2**64 - 1
_THREADS = 256  # the kernel's block size (its shared array is this long)
_MAX_BLOCKS = 1024

_CHECKSUM_SOURCE = r"""
__device__ __forceinline__ unsigned long long kv_mix(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

extern "C" __global__ void kv_checksum(const unsigned short* words, unsigned long long count,
                                       unsigned long long first, unsigned long long* total) {
    __shared__ unsigned long long partial[256];
    unsigned long long sum = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < count; i += stride) {
        sum += kv_mix(((first + i) << 16) | words[i]);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(total, partial[0]);
    }
}
"""


@functools.cache
def _import_cupy() -> ModuleType | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _cupy() -> Any:
    cupy = _import_cupy()
    assert cupy is not None, "checked by cuda_problem"
    return cupy


def cuda_problem() -> str | None:
    """Why this process cannot use CUDA IPC, or None when it can."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this worker"
    if _import_cupy() is None:
        return "cupy is not installed on this worker (the `cuda` extra: cupy-cuda13x)"
    return None


@dataclass(frozen=True)
class _Buffer:
    """A device buffer as a reader sees it: where it starts, its bytes from there, its device."""

    ptr: int
    size: int | None  # None: unknown (the driver could not say), so offsets go unchecked
    device: int


_EXPORTED: dict[str, _Buffer] = {}  # this process's live senders' buffers, by segment id


def device_checksum(parts: Sequence[tuple[int, int]], stream: torch.cuda.Stream,
                    device: int) -> int:
    """The checksum (see the module docstring) of the device bytes at (pointer, nbytes) parts,
    in order, computed on `stream`; waits for the stream, so everything before it is done too."""
    cupy = _cupy()
    kernel = _checksum_kernel()
    total = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", device))
    first = 0
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream.cuda_stream, device):
        for pointer, nbytes in parts:
            count = nbytes // 2
            if count:
                blocks = min(-(-count // _THREADS), _MAX_BLOCKS)
                kernel((blocks,), (_THREADS,), (np.uint64(pointer), np.uint64(count),
                                                np.uint64(first), np.uint64(total.data_ptr())))
            first += count
    stream.synchronize()
    return int(total.item()) & _MASK


@functools.cache
def _checksum_kernel() -> Any:
    return _cupy().RawKernel(_CHECKSUM_SOURCE, "kv_checksum")


def _copy(cupy: Any, target: int, source: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    if nbytes:
        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(target, source, nbytes, runtime.memcpyDeviceToDevice,
                            stream.cuda_stream)


class CudaIpcKVSender(StagedKVSender):
    """Stages CUDA chunks in its device buffer. CPU tensors go inline; so do CUDA tensors that
    find no room in the buffer, through a host copy."""

    backend: KVBackend = "cuda_ipc"

    def __init__(self, context: zmq.Context, buffer_bytes: int, lease_s: float,
                 device: int = 0, keys: CurveKeys | None = None) -> None:
        problem = cuda_problem()
        if problem is not None:
            raise RuntimeError(f"the cuda_ipc KV backend cannot start: {problem}")
        cupy = _cupy()
        self.device = device
        with cupy.cuda.Device(device):
            self.memory = cupy.cuda.Memory(buffer_bytes)  # cudaMalloc: its own allocation
            self.handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.memory.ptr))
        segment = f"cuda-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        _EXPORTED[segment] = _Buffer(self.memory.ptr, buffer_bytes, device)
        super().__init__(context, segment, buffer_bytes, lease_s, keys)

    def _stageable(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        return k.is_cuda and v.is_cuda and self.memory is not None

    def _stage(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Copy K then V to `offset` on the device's current stream; their checksum, once the
        stream has finished (so the region is complete before its header is sent)."""
        cupy = _cupy()
        stream = torch.cuda.current_stream(self.device)
        k, v = k.contiguous(), v.contiguous()
        for tensor in (k, v):
            if tensor.device.index != self.device:  # produced on another device's stream
                torch.cuda.current_stream(tensor.device).synchronize()
        start = self.memory.ptr + offset
        with cupy.cuda.Device(self.device):
            _copy(cupy, start, k.data_ptr(), k.nbytes, stream)
            _copy(cupy, start + k.nbytes, v.data_ptr(), v.nbytes, stream)
        return device_checksum([(start, k.nbytes + v.nbytes)], stream, self.device)

    def close(self) -> None:
        """Close the sockets and free the buffer once every staged region is released, or its
        lease has run out (a receiver that never releases is gone or stuck)."""
        deadline = time.monotonic() + self.ring.lease_s
        while self.sockets and self.staged and time.monotonic() < deadline:
            time.sleep(0.005)  # `staged` takes the receivers' releases
        super().close()
        _EXPORTED.pop(self.segment, None)
        self.memory = None  # cudaFree


class CudaIpcReader:
    """Copies placed chunks out of senders' device buffers, opening each handle once."""

    def __init__(self) -> None:
        self.segments: OpenSegments[_Buffer] = OpenSegments("cuda", _close)

    def read(self, header: KVHeader) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as CUDA tensors on the device the handle was opened on (the current one)."""
        problem = cuda_problem()
        if problem is not None:
            raise BadChunk("placement", problem)
        placement = header.placement
        assert placement is not None
        buffer = self._buffer(placement)
        nbytes = nbytes_of(header)
        if placement.offset < 0 or (buffer.size is not None
                                    and placement.offset + 2 * nbytes > buffer.size):
            raise BadChunk("placement", "the chunk lies outside its CUDA buffer")
        cupy = _cupy()
        try:
            k, v, digest = self._copy_out(buffer, placement.offset, header)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise BadChunk("placement", f"cannot copy from {placement.segment}: {exc}") from None
        if digest != header.checksum:
            raise BadChunk("checksum", "checksum mismatch (region reused or corrupted)")
        return k, v

    def _copy_out(self, buffer: _Buffer, offset: int, header: KVHeader,
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
        cupy = _cupy()
        device = torch.device("cuda", buffer.device)
        dtype = DTYPES[header.dtype]
        k = torch.empty(header.shape, dtype=dtype, device=device)
        v = torch.empty(header.shape, dtype=dtype, device=device)
        stream = torch.cuda.current_stream(device)
        start = buffer.ptr + offset
        with cupy.cuda.Device(buffer.device):
            _copy(cupy, k.data_ptr(), start, k.nbytes, stream)
            _copy(cupy, v.data_ptr(), start + k.nbytes, v.nbytes, stream)
        parts = [(k.data_ptr(), k.nbytes), (v.data_ptr(), v.nbytes)]
        return k, v, device_checksum(parts, stream, buffer.device)

    def _buffer(self, placement: Placement) -> _Buffer:
        local = _EXPORTED.get(placement.segment)
        if local is not None:  # a sender in this process: a handle cannot be opened here
            return local
        if len(placement.handle) != HANDLE_BYTES:
            raise BadChunk("placement", f"a CUDA IPC handle of {len(placement.handle)} bytes")
        return self.segments.get(placement.segment, lambda name: _open(name, placement.handle))

    def close(self) -> None:
        self.segments.close()


def _open(segment: str, handle: bytes) -> _Buffer:
    cupy = _cupy()
    device = torch.cuda.current_device()
    try:
        with cupy.cuda.Device(device):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise BadChunk("placement", f"cannot open the CUDA IPC handle of {segment} "
                                    f"(same host and device? sender gone?): {exc}") from None
    with cupy.cuda.Device(device):
        size = _bytes_from(ptr)
    if size is None:
        log.warning("cannot learn the size of CUDA buffer %s: its offsets go unchecked", segment)
    return _Buffer(ptr, size, device)


def _close(buffer: _Buffer) -> None:
    cupy = _cupy()
    try:
        with cupy.cuda.Device(buffer.device):
            cupy.cuda.runtime.ipcCloseMemHandle(buffer.ptr)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        log.warning("could not close a CUDA IPC handle: %s", exc)


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _bytes_from(ptr: int) -> int | None:
    """Bytes from `ptr` to the end of its allocation (cuMemGetAddressRange, in the current
    context), or None if the driver cannot say. cupy does not wrap this call."""
    lib = _libcuda()
    get_range = getattr(lib, "cuMemGetAddressRange_v2", None) if lib is not None else None
    if get_range is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return base.value + size.value - ptr
