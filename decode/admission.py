"""A decode worker's sequences on their way into its scheduler, and the requests it turns away.

A request's sequences (one per choice, made by decode.intake) wait off the loop while the
request's grammar compiles (`Phase.COMPILING`), then queue for a decode slot if they fit the KV
pool at all; with n > 1, the other choices wait to fork the first one's prompt KV
(`Phase.FORKING`). A request that cannot be served fails back to the gateway.
"""

from __future__ import annotations

import logging

from core.channels import ControlClient
from core.logs import about
from core.messages import DecodeRequest, RequestFailed, RequestKey
from core.worker import retry_elsewhere
from decode.phases import Phases
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.sampling.grammar import Constraint, Grammars

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, scheduler: DecodeScheduler, phases: Phases, grammars: Grammars,
                 eos_token_ids: tuple[int, ...], control: ControlClient) -> None:
        self.scheduler = scheduler
        self.phases = phases
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.control = control

    def queue(self, sequence: DecodeSequence, forks: list[DecodeSequence]) -> None:
        """Queue the sequence for a decode slot once its grammar has compiled (until then it
        waits in `phases.compiling`, off the loop) and if it fits; `forks` (the request's
        other choices) start from its prompt KV."""
        grammar = sequence.request.task.grammar
        if grammar and not self.grammars.ready(grammar):
            self.phases.compiling[sequence.key] = (sequence, forks)
            return
        problem = self._prepare(sequence)
        servable = []
        for fork in forks:
            failure = problem or self._prepare(fork)
            if failure:
                self.fail(fork.key, failure)
            else:
                servable.append(fork)
        if problem:
            self.fail(sequence.key, problem)
            return
        self.scheduler.add(sequence)
        if servable:
            self.phases.forks[sequence.key] = servable

    def queue_compiled(self) -> None:
        """Queue the sequences whose grammar has compiled since."""
        for sequence, forks in self.grammars.take_ready(
                self.phases.compiling, lambda waiting: waiting[0].request.task.grammar):
            self.queue(sequence, forks)

    def abort_compiling(self, key: RequestKey) -> None:
        """Its other choices (n > 1) go on waiting for the grammar, the first in its place."""
        _, forks = self.phases.compiling.pop(key)
        if forks:
            forks[0].num_cached = 0
            self.phases.compiling[forks[0].key] = (forks[0], forks[1:])

    def _prepare(self, sequence: DecodeSequence) -> str:
        """Its grammar's constraint; why it cannot be served ("" when it can)."""
        grammar = sequence.request.task.grammar
        problem = self.grammars.problem(grammar) if grammar else None
        if problem is not None:
            return problem
        sequence.constraint = self._constraint(sequence)
        if not self.scheduler.fits_at_all(sequence):
            return "the request does not fit the decode KV pool"
        return ""

    def _constraint(self, sequence: DecodeSequence) -> Constraint | None:
        """The task's grammar state after the tokens generated so far; None without one."""
        task = sequence.request.task
        constraint = self.grammars.constraint(task, self.eos_token_ids)
        if constraint is not None:
            for token in sequence.tokens[len(task.prompt_ids):]:
                constraint.advance(token)
        return constraint

    def fail(self, key: RequestKey, reason: str) -> None:
        """The request cannot be served: the gateway fails it."""
        log.warning("request %s: %s", key.request_id, reason, extra=about(key))
        self.control.send(RequestFailed(*key, reason))

    def fail_handoff(self, request: DecodeRequest, reason: str) -> None:
        """Its KV did not arrive whole: not the request's fault, so the gateway may serve
        each of its choices again."""
        retry_elsewhere(self.control, request, reason)
