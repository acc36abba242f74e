"""The receiving side of `python -m bench transfer`: prints its address, then for each request
its id and how many verified chunks came before its notice."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import zmq

from core.curve import load
from kvtransfer import KVItem, KVNotice, KVPayload, make_receiver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", required=True)
    parser.add_argument("--cpu", type=int, help="run on this CPU, as a pinned decode worker does")
    parser.add_argument("--keys-dir", help="CURVE keys (core/curve.py); plain ZeroMQ without")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    # Chunks are copied where a decode worker would put them: into memory it already holds.
    cache: dict[tuple[object, ...], torch.Tensor] = {}
    context = zmq.Context()
    keys = load(Path(args.keys_dir)) if args.keys_dir else None
    receiver = make_receiver(context, args.bind, keys)
    print(receiver.address, flush=True)
    socket = receiver.fileno_socket()
    chunks = 0

    def handle(item: KVItem) -> None:
        nonlocal chunks
        if isinstance(item, KVPayload):
            for kind, tensor in (("k", item.k), ("v", item.v)):
                key = (kind, item.header.layer_start, *tensor.shape)
                cache.setdefault(key, torch.empty_like(tensor)).copy_(tensor)
            chunks += 1
        elif isinstance(item, KVNotice):
            print(f"{item.request_id} {chunks}", flush=True)
            chunks = 0
        else:
            print(f"rejected {item.request_id}: {item.reason}", flush=True)

    while True:
        socket.poll()
        receiver.drain(handle)


if __name__ == "__main__":
    main()
