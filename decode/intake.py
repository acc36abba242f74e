"""How requests come into a decode worker, up to their sequences' admission (decode.admission).

A request handed off by a prefill worker is announced by its `DecodeRequest` notice, its KV
arrives chunk by chunk (decode.incoming), and its `FirstToken` notice completes it. A prompt the
gateway sends here to prefill (`PrefillRequest`) is admitted at once, or, where the KV of its
leading tokens is cached on another worker, once that prefix has been pulled (decode.pulls) or
has failed to come. Either way a request becomes one sequence per choice still going.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from core.channels import ControlClient
from core.codec import MalformedMessage
from core.config import Config
from core.logs import about
from core.messages import (
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestKey,
    SharedPrefix,
    SharePrefix,
    choice_keys,
    decode,
)
from core.worker import WorkerIdentity
from decode.admission import Admission
from decode.incoming import IncomingKV, IncomingTable
from decode.phases import Phase, Phases
from decode.pulls import Pulls
from decode.scheduler import DecodeSequence
from engine.sampling.sampler import make_generator
from kvtransfer import KVItem, KVNotice, KVRejected

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, incoming: IncomingTable, pulls: Pulls, phases: Phases,
                 admission: Admission, control: ControlClient, identity: WorkerIdentity,
                 kv_address: str, host: str, device: torch.device, config: Config) -> None:
        """`kv_address` and `host`: where this worker receives KV, which the holder of a
        prefix it pulls sends it to."""
        self.incoming = incoming
        self.pulls = pulls
        self.phases = phases
        self.admission = admission
        self.control = control
        self.worker_id = identity.worker_id
        self.fingerprint = identity.fingerprint
        self.kv_address = kv_address
        self.host = host
        self.device = device
        self.ttft_s_per_token = config.decode.ttft_ms_per_token / 1000
        self.pull_lease_s = config.kv_transfer.pull_lease_s

    def on_kv(self, item: KVItem) -> None:
        """A chunk or notice from the worker's KV receiver."""
        key = item.key
        if isinstance(item, KVNotice):
            self._on_notice(key, item.meta)
        elif key in self.pulls.pending:
            self._on_pulled_kv(item)
        elif isinstance(item, KVRejected):
            entry = self.incoming.take(key)
            if entry is not None:
                self.admission.fail_handoff(entry.request, item.reason)
        else:
            entry = self.incoming.pending.get(key)
            failure = self.incoming.add(item, time.monotonic())
            if failure is not None:
                assert entry is not None, "only a request expected can fail"
                self.admission.fail_handoff(entry.request, failure)

    def _on_notice(self, key: RequestKey, meta: bytes) -> None:
        try:
            message = decode(meta)
        except MalformedMessage:
            message = None
        if not isinstance(message, DecodeRequest | FirstToken | SharedPrefix) \
                or message.key != key:
            self.incoming.dropped["malformed notice"] += 1
            return
        if isinstance(message, SharedPrefix):
            self.on_shared(message)
            return
        if isinstance(message, DecodeRequest):
            phase = self.phases.of(key)
            if phase in (Phase.WAITING, Phase.RUNNING, Phase.COMPILING):
                self.incoming.dropped["duplicate request"] += 1  # a repeated hand-off
            elif phase is not Phase.ENDED:
                problem = self.incoming.expect(message, time.monotonic())
                if problem is not None:
                    self.admission.fail(key, problem)
            return
        entry = self.incoming.take(key)
        if entry is not None:
            self._admit(entry, message.token_id, message.finish_reason is not None)

    def _admit(self, entry: IncomingKV, first_token: int, first_finished: bool) -> None:
        """All layers and the first token are here: queue the choices still going, the
        first with the received KV, the others (n > 1) to fork it once it is written."""
        request = entry.request
        if not self.incoming.is_complete(entry):
            ended = f"KV ended at layer {entry.next_layer}, before the last one"
            self.admission.fail_handoff(request, ended)
            return
        choices = self._choices(request, [first_token])
        if first_finished:  # as prefill found: the request's own choice ends there
            choices = [c for c in choices if c.key != request.key]
        if choices:
            choices[0].received_kv = entry.layers
            choices[0].timeline = entry.timeline
            choices[0].timeline.kv_ready = time.monotonic()
            self.admission.queue(choices[0], choices[1:])

    def _choices(self, request: DecodeRequest, first_tokens: list[int]) -> list[DecodeSequence]:
        """A sequence per choice of the request not ended yet: with its first token when
        drawn already (`first_tokens[i]`), else to draw it."""
        choices = []
        for i, key in enumerate(choice_keys(request)):
            task = replace(request.task, sampling=request.task.sampling.for_choice(i))
            first = first_tokens[i] if i < len(first_tokens) else None
            if self.phases.of(key) is Phase.ENDED:
                continue
            choices.append(DecodeSequence(
                request=DecodeRequest(*key, task, request.fingerprint,
                                      traceparent=request.traceparent),
                tokens=[*task.prompt_ids, *([] if first is None else [first])],
                num_generated=0 if first is None else 1,
                generator=make_generator(None, self.device),  # seeded: per draw
                deadline=time.monotonic() + self.ttft_s_per_token * len(task.prompt_ids)))
        return choices

    def prefill_here(self, message: PrefillRequest) -> None:
        """Conditional disaggregation: the gateway sent the prompt to this worker, which
        prefills it in chunks inside its decode batches and draws its first token itself
        (and with n > 1, each choice's, from the same logits)."""
        if self.phases.of(message.key) is not None:
            return  # a repeat, or already aborted
        request = DecodeRequest(*message.key, message.task, self.fingerprint,
                                message.siblings, message.traceparent)
        choices = self._choices(request, [])
        now = choices[0].timeline.arrived = time.monotonic()
        if message.pull_tokens:  # its prefix's KV comes from another worker's cache first
            problem = self.incoming.expect(request, now, message.pull_tokens, self.pull_lease_s)
            assert problem is None, problem  # its own fingerprint, its first epoch here
            self.pulls.start(choices, now)
            self.control.send(SharePrefix(
                *message.key, message.task.prompt_ids, message.task.cache_salt,
                message.pull_tokens, message.pull_from, self.worker_id, self.kv_address,
                self.host))
        else:
            self.admission.queue(choices[0], choices[1:])

    def on_shared(self, notice: SharedPrefix) -> None:
        """The holder says how much of a pulled prefix follows: none, and it is computed here."""
        entry = self.incoming.pending.get(notice.key)
        if entry is None or notice.key not in self.pulls.pending:
            self.incoming.dropped["unknown request"] += 1
        elif (notice.num_tokens == 0 or notice.fingerprint != self.fingerprint
              or notice.num_tokens > entry.expected_tokens):
            self._fall_back(notice.key, f"{notice.num_tokens} tokens came cached")
        else:
            entry.tokens = notice.num_tokens

    def _on_pulled_kv(self, item: KVItem) -> None:
        """A chunk of a pulled prefix (or its sender's refusal)."""
        key = item.key
        assert not isinstance(item, KVNotice), "notices are read apart"
        if isinstance(item, KVRejected):
            self._fall_back(key, item.reason)
            return
        entry = self.incoming.pending.get(key)
        now = time.monotonic()
        failure = self.incoming.add(item, now)
        if failure is not None or entry is None:
            self._fall_back(key, failure or "its KV was not expected")
        elif self.incoming.is_complete(entry):
            self.incoming.take(key)
            pull = self.pulls.take(key)
            assert pull is not None
            nbytes = sum(part.k.nbytes + part.v.nbytes for part in entry.layers)
            self.pulls.received(pull, entry.token_end, nbytes, now)
            pull.choices[0].received_kv = entry.layers
            self.admission.queue(pull.choices[0], pull.choices[1:])

    def _fall_back(self, key: RequestKey, why: str) -> None:
        """A pulled prefix did not come: compute the prompt here instead."""
        self.incoming.take(key)
        pull = self.pulls.take(key)
        if pull is not None:
            log.warning("request %s: its pulled prefix did not come (%s): computing it",
                        key.request_id, why, extra=about(key))
            self.pulls.fell_back()
            self.admission.queue(pull.choices[0], pull.choices[1:])

    def expire(self, now: float) -> None:
        """The KV whose lease ran out: a pulled prefix is computed here instead, a hand-off
        fails."""
        for entry in self.incoming.expire(now):
            if entry.request.key in self.pulls.pending:
                self._fall_back(entry.request.key, "the lease ran out")
            else:
                self.admission.fail_handoff(entry.request, "the KV did not arrive in time")
