"""A tensor-parallel worker's runner (rank 0) and what every rank loads (engine.tp)."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from core.config import QuantInputs, WeightsMode
from core.process import freeze_start_up
from engine.heap import return_freed_memory
from engine.kernels.cpu.build import kernels, running_isa
from engine.kv.allocator import BlockAllocator
from engine.kv.cache import PagedKVCache
from engine.model.batch import ForwardBatch
from engine.model.chunk_cost import ChunkCost
from engine.model.llama import LlamaModel
from engine.tp.group import RankGroup
from engine.tp.shards import Shard
from engine.weights.choice import choose_weights
from engine.weights.load import load_weights
from engine.weights.quant_blocks import load_quant_blocks
from engine.weights.spec import kv_fingerprint, load_spec

log = logging.getLogger(__name__)

RANK_LOSS_GRACE_S = 2.0  # how long a failed step waits for a rank's watcher
STOP_S = 10.0  # a rank told to stop that has not within this is killed


@dataclass(frozen=True)
class RankPlan:
    """What every rank of one worker is started with (as JSON on a rank's command line)."""

    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    size: int
    threads: int
    store: str  # the file the ranks meet through
    kv_file: str  # the shared KV cache
    parent: int  # rank 0's PID: a rank whose parent is gone stops
    weights: WeightsMode = "auto"  # model.weights
    quant_inputs: QuantInputs = "exact"
    quant_rows: int = 0  # products of up to this many rows read the quant blocks


def load_rank(plan: RankPlan, rank: int,
              group: RankGroup) -> tuple[LlamaModel, PagedKVCache, PagedKVCache]:
    """This rank's model share, the whole shared KV cache and this rank's heads of it
    (engine.tp). The copies of the weights are chosen as for one process
    (engine.weights.choice), then sliced; where the model's quant blocks do not split, they
    are dense."""
    folder = Path(plan.model_dir)
    spec = load_spec(folder)
    shard = Shard(rank, plan.size, spec)
    dtype = getattr(torch, plan.dtype)
    blocks = load_quant_blocks(folder, plan.quant_inputs == "int8")
    usable = kernels() is not None and shard.quant(blocks) is not None
    dense, quant = choose_weights(load_weights(folder, dtype), blocks, plan.weights, dtype,
                                  usable)
    model = LlamaModel(shard.local_spec(), shard.weights(dense), quant=shard.quant(quant),
                       quant_rows=plan.quant_rows, reduce=group.all_reduce)
    cache = PagedKVCache(spec, plan.num_blocks, plan.block_size, dtype,
                         shared_file=Path(plan.kv_file))
    return model, cache, cache.head_slice(*shard.kv_heads)


class TensorParallelRunner:
    """Rank 0 of a worker split over `size` processes: the `Runner` its worker steps with."""

    def __init__(self, model_dir: Path, num_blocks: int, block_size: int, dtype: torch.dtype,
                 size: int, on_rank_lost: Callable[[int, int], None] | None = None,
                 weights: WeightsMode = "auto", quant_inputs: QuantInputs = "exact",
                 quant_rows: int = 0) -> None:
        """`on_rank_lost(rank, exit status)`: what happens when another rank dies; by default
        this process exits, and its worker with it. The rest: as for `ModelRunner`."""
        assert size > 1
        self.model_dir = Path(model_dir)
        self.spec = load_spec(self.model_dir)
        self.block_size = block_size
        self.device = torch.device("cpu")
        Shard(0, size, self.spec)  # refused here if `size` does not divide the model
        self.plan = replace(_plan(self.model_dir, dtype, num_blocks, block_size, size),
                            weights=weights, quant_inputs=quant_inputs, quant_rows=quant_rows)
        self.ranks: list[subprocess.Popen[bytes]] = []
        self._stopping = False
        self._rank_lost = threading.Event()
        self._lost = on_rank_lost or _exit_worker
        try:
            self._start(size)
        except BaseException:
            self._stopping = True
            for process in self.ranks:
                process.kill()
            raise
        finally:  # mapped by every rank, or by none: gone from the file system either way
            for path in (self.plan.kv_file, self.plan.store):
                Path(path).unlink(missing_ok=True)
        self.allocator = BlockAllocator(num_blocks)
        self.chunk_cost = ChunkCost.of(self.spec)
        atexit.register(self.close)  # gloo aborts the process if torn down with ranks joined

    def _start(self, size: int) -> None:
        _create_zeroed(Path(self.plan.kv_file), PagedKVCache.shared_bytes(
            self.spec, self.plan.num_blocks, self.plan.block_size, getattr(torch, self.plan.dtype)))
        self.ranks = [_start_rank(self.plan, rank) for rank in range(1, size)]
        for rank, process in enumerate(self.ranks, start=1):
            threading.Thread(target=self._watch, args=(rank, process), daemon=True,
                             name=f"tp-rank-{rank}").start()
        self.group = RankGroup(Path(self.plan.store), 0, size)
        self.model, self.cache, self.local_cache = load_rank(self.plan, 0, self.group)
        self.group.all_reduce(torch.zeros(1))  # every rank has mapped the files

    @property
    def kernel_isa(self) -> str:
        return running_isa()

    @property
    def kv_fingerprint(self) -> str:
        """The whole model's: a worker of any `tp` exchanges KV with this one."""
        return kv_fingerprint(self.spec, str(self.cache.dtype).removeprefix("torch."))

    def forward(self, batch: ForwardBatch,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """As `ModelRunner.forward`, every rank computing its share."""
        try:
            self.group.send_batch(batch)
            return self.model.forward(batch, self.local_cache, layer_hook)
        except RuntimeError:
            # A dead rank fails the step (gloo: "connection reset") as its watcher learns of the
            # death: it ends this process, saying which rank went, unless the failure was else.
            self._rank_lost.wait(RANK_LOSS_GRACE_S)
            raise

    @property
    def hidden(self) -> torch.Tensor:
        """Rank 0's: the ranks' sums leave each of them the whole hidden state."""
        return self.model.hidden

    def close(self) -> None:
        """Stop the other ranks (they also stop when this process ends). Once is enough."""
        if self._stopping:
            return
        self._stopping = True
        if all(process.poll() is None for process in self.ranks):
            self.group.send_batch(None)
        for process in self.ranks:
            try:
                process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        status = process.wait()
        if not self._stopping:
            log.error("tensor-parallel rank %d (pid %d) ended with status %d: this worker "
                      "cannot compute without it", rank, process.pid, status)
            self._rank_lost.set()
            self._lost(rank, status)


def _exit_worker(rank: int, status: int) -> None:
    logging.shutdown()
    os._exit(1)  # from a watching thread: the step may be blocked on the dead rank


def _plan(model_dir: Path, dtype: torch.dtype, num_blocks: int, block_size: int,
          size: int) -> RankPlan:
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    name = f"raging-tp-{os.getpid()}-{secrets.token_hex(4)}"
    return RankPlan(str(model_dir), str(dtype).removeprefix("torch."), num_blocks, block_size,
                    size, torch.get_num_threads(), str(folder / f"{name}.store"),
                    str(folder / f"{name}.kv"), os.getpid())


def _create_zeroed(path: Path, size: int) -> None:
    with path.open("xb") as file:
        os.ftruncate(file.fileno(), size)


def _start_rank(plan: RankPlan, rank: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "engine.tp", str(rank),
                             json.dumps(asdict(plan))])


def serve_rank(plan: RankPlan, rank: int) -> None:
    """Ranks 1..: load this rank's share, then run each step rank 0 sends until it says stop."""
    _die_with(plan.parent)
    torch.set_num_threads(plan.threads)
    group = RankGroup(Path(plan.store), rank, plan.size)
    model, _, local = load_rank(plan, rank, group)
    return_freed_memory()
    freeze_start_up()
    group.all_reduce(torch.zeros(1))
    while (batch := group.receive_batch()) is not None:
        model.forward(batch, local)


def _die_with(parent: int) -> None:
    """Be killed when the process that started this one ends (Linux), and end now if it has."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(1)
