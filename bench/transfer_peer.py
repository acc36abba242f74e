"""The receiving side of `python -m bench transfer`: prints its address, then each chunk's id."""

from __future__ import annotations

import argparse

import zmq

from kvtransfer import make_receiver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()
    context = zmq.Context()
    receiver = make_receiver(context, args.bind)
    print(receiver.address, flush=True)
    socket = receiver.fileno_socket()
    while True:
        socket.poll()
        for payload in receiver.drain():
            print(payload.header.request_id, flush=True)
        for rejected in receiver.take_rejections():
            print(f"rejected {rejected.request_id}: {rejected.reason}", flush=True)


if __name__ == "__main__":
    main()
