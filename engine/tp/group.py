"""The ranks of one tensor-parallel worker talking: sums over gloo on loopback, and each step's
batch sent from rank 0 to the others as one tensor of integers (no pickle)."""

from __future__ import annotations

from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Protocol, cast

import torch
from torch._C._distributed_c10d import FileStore, ProcessGroupGloo  # typed, as used

from engine.model.batch import ForwardBatch

TIMEOUT = timedelta(minutes=10)  # a step's collectives; a dead rank is noticed sooner


class _Work(Protocol):
    def wait(self) -> bool: ...


class _Collectives(Protocol):
    """What a gloo backend does (its stubs name these on the process group class only)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Work: ...


class RankGroup:
    """This process's place among `size` ranks that meet through the file `store`."""

    def __init__(self, store: Path, rank: int, size: int) -> None:
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # gloo's own
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # loopback
        options._timeout = TIMEOUT
        self.rank = rank
        backend = ProcessGroupGloo(FileStore(str(store), size), rank, size,
                                   options)
        self.group = cast(_Collectives, backend)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every rank, in place."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def send_batch(self, batch: ForwardBatch | None) -> None:
        """Rank 0: the next step's batch to every other rank; None: stop."""
        assert self.rank == 0
        payload = encode_batch(batch) if batch is not None else torch.empty(0, dtype=torch.long)
        self.group.broadcast(torch.tensor([payload.numel()]), 0).wait()
        if payload.numel():
            self.group.broadcast(payload, 0).wait()

    def receive_batch(self) -> ForwardBatch | None:
        """The other ranks: the batch rank 0 sent, or None when it said stop."""
        size = torch.zeros(1, dtype=torch.long)
        self.group.broadcast(size, 0).wait()
        if not int(size):
            return None
        payload = torch.empty(int(size), dtype=torch.long)
        self.group.broadcast(payload, 0).wait()
        return decode_batch(payload)


def encode_batch(batch: ForwardBatch) -> torch.Tensor:
    """[sequences, starts..., token counts..., table lengths..., all-logits flags...,
    tokens..., tables...]."""
    counts = [len(tokens) for tokens in batch.token_ids]
    widths = [len(table) for table in batch.block_tables]
    flags = [batch.logit_rows(i) > 1 for i in range(batch.num_seqs)]
    return torch.tensor([batch.num_seqs, *batch.start_positions, *counts, *widths, *flags,
                         *chain.from_iterable(batch.token_ids),
                         *chain.from_iterable(batch.block_tables)], dtype=torch.long)


def decode_batch(payload: torch.Tensor) -> ForwardBatch:
    values = payload.tolist()
    n = values[0]
    starts, counts, widths = values[1:1 + n], values[1 + n:1 + 2 * n], values[1 + 2 * n:1 + 3 * n]
    flags = [bool(flag) for flag in values[1 + 3 * n:1 + 4 * n]]
    rest = iter(values[1 + 4 * n:])
    tokens = [[next(rest) for _ in range(count)] for count in counts]
    tables = [[next(rest) for _ in range(width)] for width in widths]
    return ForwardBatch(token_ids=tokens, start_positions=starts, block_tables=tables,
                        all_logits=flags if any(flags) else [])
