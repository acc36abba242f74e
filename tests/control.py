"""The gateway's side of a worker's control channel, for tests of a worker in this process."""

from __future__ import annotations

import time

import zmq

from core.messages import Abort, Message, decode
from core.worker import Worker

WAIT_S = 5.0


def sent_to_gateway(worker: Worker, gateway: zmq.Socket) -> list[Message]:
    """Everything `worker` sent the gateway (a ROUTER standing in for it) so far: a marker sent
    last on the same socket comes back last."""
    marker = Abort("end-of-messages", -1)
    worker.control.send(marker)
    messages: list[Message] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        assert remaining_ms > 0 and gateway.poll(remaining_ms), "the marker did not come back"
        _, data = gateway.recv_multipart()
        message = decode(data)
        if message == marker:
            return messages
        messages.append(message)
