"""The decode worker: receive KV into the paged pool, run continuous batching, stream tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import zmq

from core.codec import MalformedMessage
from core.config import Config
from core.logs import about
from core.messages import (
    Abort,
    DecodeRequest,
    DropCount,
    FirstToken,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
    PromptLogprobs,
    RequestFailed,
    RequestKey,
    SharedPrefix,
    SharePrefix,
    StageTime,
    TokenBatch,
    TokenEvent,
    TransferTotals,
    choice_keys,
    decode,
)
from core.worker import Worker, WorkerIdentity
from decode.drafts import propose
from decode.guessing import Guessing
from decode.incoming import IncomingKV, IncomingTable
from decode.phases import Phase, Phases
from decode.pulls import Pulls
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.kv.prefix_cache import capacity
from engine.model.batch import ForwardBatch
from engine.runner import Runner
from engine.sampling.grammar import Constraint, Grammars
from engine.sampling.sampler import Draw, History, draw, make_generator, prompt_logprobs
from engine.sampling.stopping import banned_tokens, finish_reason
from kvtransfer import KVItem, KVNotice, KVRejected, make_receiver, make_sender
from kvtransfer.share import share_prefix
from kvtransfer.wire import dtype_name

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: Runner) -> None:
        identity = WorkerIdentity(worker_id, "decode", runner.kv_fingerprint,
                                  runner.block_size, runner.allocator.num_total,
                                  torch.get_num_threads(), config.decode.max_running,
                                  isa=runner.kernel_isa,
                                  prefix_caching=config.decode.prefix_caching,
                                  kv_bytes_per_token=runner.cache.bytes_per_token,
                                  cache_blocks=capacity(runner.allocator.num_total,
                                                        config.decode.prefix_cache_share))
        super().__init__(identity, config)
        self.runner = runner
        self.scheduler = DecodeScheduler(runner.allocator, runner.block_size,
                                         config.decode.max_running, config.decode.chunk_tokens,
                                         runner.chunk_cost, config.decode.prefix_caching,
                                         config.decode.prefix_cache_share,
                                         runner.spec.sliding_window)
        self.receiver = make_receiver(self.context, config.decode.kv_bind, self.keys)
        self.kv_address = self.receiver.address
        self.poller.register(self.receiver.fileno_socket(), zmq.POLLIN)
        spec = runner.spec
        self.incoming = IncomingTable(spec.num_layers, (spec.num_kv_heads, spec.head_dim),
                                      dtype_name(runner.cache.dtype), identity.fingerprint,
                                      config.kv_transfer.lease_s)
        self.phases = Phases(self.incoming, self.scheduler)
        self.sender = make_sender(self.context, config.kv_transfer, self.keys, runner.device)
        self.sender.while_waiting = self.maybe_heartbeat  # a dead receiver's connect wait
        self.chunk_bytes = int(config.kv_transfer.chunk_mb * 2**20)
        self.pulls = Pulls()
        self.pull_lease_s = config.kv_transfer.pull_lease_s
        self.rejected_requests = 0
        self.ttft_s_per_token = config.decode.ttft_ms_per_token / 1000
        self.grammars = Grammars(runner.model_dir, spec.vocab_size)
        # Guessing is measured on CPUs only (docs/scheduling.md): off on a GPU until it is.
        on_cpu = runner.device.type == "cpu"
        self.speculative_tokens = config.decode.speculative_tokens if on_cpu else 0
        self.speculative_max_running = config.decode.speculative_max_running
        self.guessing = Guessing(self.speculative_tokens)
        self.guessed_tokens = self.kept_guesses = 0  # since start

    def handle(self, message: Message) -> None:
        if isinstance(message, Abort):
            self._abort(message.key)
        elif isinstance(message, PrefillRequest):
            self._prefill_here(message)
        elif isinstance(message, SharePrefix):
            self._share(message)
        elif isinstance(message, SharedPrefix):
            self._on_shared(message)  # from the gateway: the holder is gone
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:
        if self.receiver.fileno_socket() in ready:
            self.receiver.drain(self._on_kv)

    def step(self) -> bool:
        self._queue_compiled()
        self._guess_next_tokens()
        admitted, running = self.scheduler.schedule()
        for sequence in admitted:
            if sequence.received_kv is not None:
                self._write_received_kv(sequence)
                # a choice with no first token yet draws it from its prompt's last token
                sequence.num_cached = min(sequence.num_cached, len(sequence.tokens) - 1)
                if sequence.num_generated:  # else (a pulled prefix) the rest is computed first
                    self._fork(sequence, drawing=False)
        batch = self.scheduler.chunk(running)
        if not batch:
            return False
        now = time.monotonic()
        prompt_tokens = 0
        for sequence in batch:
            if sequence.num_generated == 0:  # its prompt is computed here
                sequence.timeline.start(now)
                prompt_tokens += sequence.num_scheduled
        scored = [_scored(s) for s in batch]
        decode_rows = _decode_rows(batch, scored)  # before the step clears the drafts
        with self.turns:
            started = time.monotonic()
            logits = self.runner.forward(_forward_batch(batch, scored),
                                         layer_hook=self.between_layers)
        self.pulls.pace.observe(prompt_tokens, time.monotonic() - now)
        events = self._draw(batch, logits, _score_prompts(batch, scored, logits))
        if decode_rows:  # what the step cost, but its wait for its turn
            self.guessing.costs.observe(decode_rows, time.monotonic() - started)
        if events:
            self.control.send(TokenBatch(events))
        return True

    def _draw(self, batch: list[DecodeSequence], logits: torch.Tensor, rows: list[int],
              ) -> list[TokenEvent]:
        """Each sequence whose KV the step completed draws its next token from its row of
        `logits`, and its guessed tokens' after it while they hold."""
        for sequence in batch:
            sequence.num_cached += sequence.num_scheduled - len(sequence.draft)
        ready = [i for i, s in enumerate(batch) if s.num_cached == len(s.tokens)]
        events = self._sample([batch[i] for i in ready], logits[[rows[i] for i in ready]])
        return events + self._check_guesses([(batch[i], logits[rows[i] + 1:rows[i] + 1 + len(
            batch[i].draft)]) for i in ready if batch[i].draft])

    def _guess_next_tokens(self) -> None:
        """Each decoding sequence's draft for this step: as many guesses as pay for the rows
        they add to the step's products and attention (decode/guessing.py)."""
        running = self.scheduler.running
        if not self.speculative_tokens or len(running) > self.speculative_max_running:
            return  # drafts are empty between steps: _check_guesses clears each one it feeds
        for sequence in running:
            assert not sequence.draft, "a step feeds each draft and clears it"
            if not sequence.num_generated or len(sequence.tokens) - sequence.num_cached != 1:
                continue  # not decoding: its prompt (or a choice's first token) comes first
            left = sequence.request.task.max_tokens - sequence.num_generated - 1
            allowed = min(self.guessing.allowance(sequence.guesses, len(running)), left)
            if allowed > 0:
                sequence.draft = propose(sequence.tokens, allowed)
            if not sequence.draft:
                self.guessing.skip(sequence.guesses)

    def _check_guesses(self, guessed: list[tuple[DecodeSequence, torch.Tensor]],
                       ) -> list[TokenEvent]:
        """Each guessing sequence has drawn its next token from its last token's row. Where
        that token is its first guess, the KV the step computed for the guess holds, and the
        guess's row gives the next draw, made as a step of its own would make it (its own
        generator, penalties, grammar): so on, until a draw differs from its guess or the
        sequence ends. The output is the one decoding without guesses gives."""
        events = []
        for sequence, rows in guessed:
            kept = tries = 0
            for guess, row in zip(sequence.draft, rows, strict=True):
                if self.scheduler.find(sequence.key) is None:
                    break  # it ended: the guesses after are never drawn
                tries += 1
                if sequence.tokens[-1] != guess:
                    break
                kept += 1
                sequence.num_cached += 1
                (token,) = draw(row[None], [sequence.request.task.sampling],
                                [_generator(sequence)], [self._history(sequence)])
                events.append(self._advance(sequence, token))
            self.guessing.record(sequence.guesses, tries, kept)
            self.guessed_tokens += len(sequence.draft)
            self.kept_guesses += kept
            sequence.draft = []
        return events

    def _sample(self, ready: list[DecodeSequence], logits: torch.Tensor) -> list[TokenEvent]:
        """Draw the next token of each sequence whose KV is complete, and the first token of
        each choice forked from a prompt prefilled here just now."""
        drawing: list[DecodeSequence] = []
        rows: list[int] = []
        for row, sequence in enumerate(ready):
            forked = self._fork(sequence, drawing=True) if sequence.num_generated == 0 else []
            drawing += [sequence, *forked]
            rows += [row] * (1 + len(forked))
            if sequence.prompt_scores:  # before their first tokens: every choice echoes them
                for choice in (sequence, *forked):
                    self.control.send(PromptLogprobs(*choice.key, sequence.prompt_scores))
                sequence.prompt_scores = []
        if not drawing:
            return []  # only prompt chunks this step
        draws = draw(logits[rows], [s.request.task.sampling for s in drawing],
                     [_generator(s) for s in drawing], [self._history(s) for s in drawing])
        return [self._advance(s, d) for s, d in zip(drawing, draws, strict=True)]

    def _fork(self, parent: DecodeSequence, drawing: bool) -> list[DecodeSequence]:
        """Start the choices waiting on `parent`'s prompt KV (n > 1) on a copy-on-write fork
        of it. `drawing`: they draw their first token from the parent's logits of this step;
        else they feed their last token next step. Returns the forks now running."""
        running = []
        for child in self.phases.forks.pop(parent.key, []):
            if self.phases.of(child.key) is Phase.ENDED:
                continue  # aborted meanwhile
            child.num_cached = len(child.tokens) - (0 if drawing else 1)
            child.timeline.kv_ready = time.monotonic()
            copy = self.scheduler.fork(parent, child)
            if copy is not None:
                self.runner.cache.copy_block(*copy)
            if child.blocks:
                running.append(child)
        return running

    def _history(self, sequence: DecodeSequence) -> History:
        """Its tokens, for the penalties; EOS and stop tokens banned under min_tokens; the
        tokens its grammar allows."""
        task = sequence.request.task
        banned = banned_tokens(task, sequence.num_generated, self.runner.spec.eos_token_ids)
        constraint = sequence.constraint
        allowed = None if constraint is None else constraint.allowed()
        return History(sequence.tokens, task.prompt_len, banned, allowed)

    def _advance(self, sequence: DecodeSequence, token: Draw) -> TokenEvent:
        sequence.tokens.append(token.token_id)
        sequence.num_generated += 1
        task = sequence.request.task
        if sequence.num_generated == 1:  # prefilled here: the rest draws as decode would
            sequence.generator = make_generator(_decode_seed(task.sampling.seed),
                                                self.runner.device)
        if sequence.constraint is not None:
            sequence.constraint.advance(token.token_id)
        eos = self.runner.spec.eos_token_ids
        reason = finish_reason(task, token.token_id, sequence.num_generated, eos)
        stages = self._stages_done(sequence)
        if reason is not None:
            log.info("request %s: finished (%s), %d tokens", sequence.key.request_id, reason,
                     sequence.num_generated, extra=about(sequence.key))
            self.scheduler.remove(sequence)
            self.phases.end(sequence.key, time.monotonic())
            self._trace_end(sequence, reason)
        cached = sequence.num_reused if sequence.num_generated == 1 else 0
        return TokenEvent(*sequence.key, sequence.num_generated - 1, token.token_id, reason,
                          token.logprob, token.top, stages, cached)

    def _stages_done(self, sequence: DecodeSequence) -> list[StageTime]:
        """The stages the token just drawn ends: its prompt's, when prefilled here (token 0);
        else, on its first decode step's token, kv_transfer and first_decode."""
        timeline, now = sequence.timeline, time.monotonic()
        if sequence.num_generated == 1 and timeline.started is not None:
            timeline.computed = timeline.kv_ready = now
            return timeline.prefill_stages()
        if timeline.first_decoded is None and timeline.kv_ready is not None:
            timeline.first_decoded = now
            return timeline.decode_stages()
        return []

    def _trace_end(self, sequence: DecodeSequence, outcome: str) -> None:
        """The request ended here (finished or aborted): its spans on this worker."""
        if self.tracer is None:
            return
        request = sequence.request
        self.tracer.stages(request.traceparent, sequence.timeline, {
            "raging.request_id": request.request_id, "raging.epoch": request.epoch,
            "raging.prompt_tokens": len(request.task.prompt_ids),
        }, ended=time.monotonic(), outcome={"raging.output_tokens": sequence.num_generated,
                                            "raging.finish_reason": outcome})

    def _on_kv(self, item: KVItem) -> None:
        key = item.key
        if isinstance(item, KVNotice):
            self._on_notice(key, item.meta)
        elif key in self.pulls.pending:
            self._on_pulled_kv(item)
        elif isinstance(item, KVRejected):
            entry = self.incoming.take(key)
            if entry is not None:
                self._fail_handoff(entry.request, item.reason)
        else:
            entry = self.incoming.pending.get(key)
            failure = self.incoming.add(item, time.monotonic())
            if failure is not None:
                assert entry is not None, "only a request expected can fail"
                self._fail_handoff(entry.request, failure)

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
            self._on_shared(message)
            return
        if isinstance(message, DecodeRequest):
            phase = self.phases.of(key)
            if phase in (Phase.WAITING, Phase.RUNNING, Phase.COMPILING):
                self.incoming.dropped["duplicate request"] += 1  # a repeated hand-off
            elif phase is not Phase.ENDED:
                problem = self.incoming.expect(message, time.monotonic())
                if problem is not None:
                    self._fail(key, problem)
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
            self._fail_handoff(request, ended)
            return
        choices = self._choices(request, [first_token])
        if first_finished:  # as prefill found: the request's own choice ends there
            choices = [c for c in choices if c.key != request.key]
        if choices:
            choices[0].received_kv = entry.layers
            choices[0].timeline = entry.timeline
            choices[0].timeline.kv_ready = time.monotonic()
            self._queue(choices[0], choices[1:])

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
                generator=make_generator(task.sampling.seed if first is None
                                         else _decode_seed(task.sampling.seed),
                                         self.runner.device),
                deadline=time.monotonic() + self.ttft_s_per_token * len(task.prompt_ids)))
        return choices

    def _prefill_here(self, message: PrefillRequest) -> None:
        """Conditional disaggregation: the gateway sent the prompt to this worker, which
        prefills it in chunks inside its decode batches and draws its first token itself
        (and with n > 1, each choice's, from the same logits)."""
        if self.phases.of(message.key) is not None:
            return  # a repeat, or already aborted
        request = DecodeRequest(*message.key, message.task, self.identity.fingerprint,
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
            self._queue(choices[0], choices[1:])

    def _share(self, asked: SharePrefix) -> None:
        share_prefix(asked, self.scheduler.cache, self.runner.cache, self.sender,
                     self.identity.fingerprint, self.chunk_bytes, self.host)

    def _on_shared(self, notice: SharedPrefix) -> None:
        """The holder says how much of a pulled prefix follows: none, and it is computed here."""
        entry = self.incoming.pending.get(notice.key)
        if entry is None or notice.key not in self.pulls.pending:
            self.incoming.dropped["unknown request"] += 1
        elif (notice.num_tokens == 0 or notice.fingerprint != self.identity.fingerprint
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
            self._queue(pull.choices[0], pull.choices[1:])

    def _fall_back(self, key: RequestKey, why: str) -> None:
        """A pulled prefix did not come: compute the prompt here instead."""
        self.incoming.take(key)
        pull = self.pulls.take(key)
        if pull is not None:
            log.warning("request %s: its pulled prefix did not come (%s): computing it",
                        key.request_id, why, extra=about(key))
            self.pulls.fell_back()
            self._queue(pull.choices[0], pull.choices[1:])

    def _queue(self, sequence: DecodeSequence, forks: list[DecodeSequence]) -> None:
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
                self._fail(fork.key, failure)
            else:
                servable.append(fork)
        if problem:
            self._fail(sequence.key, problem)
            return
        self.scheduler.add(sequence)
        if servable:
            self.phases.forks[sequence.key] = servable

    def _queue_compiled(self) -> None:
        """Queue the sequences whose grammar has compiled since."""
        for key, (sequence, forks) in list(self.phases.compiling.items()):
            grammar = sequence.request.task.grammar
            assert grammar is not None, "only a grammar waits to compile"
            if self.grammars.ready(grammar):
                del self.phases.compiling[key]
                self._queue(sequence, forks)

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
        constraint = self.grammars.constraint(task, self.runner.spec.eos_token_ids)
        if constraint is not None:
            for token in sequence.tokens[len(task.prompt_ids):]:
                constraint.advance(token)
        return constraint

    def _fail(self, key: RequestKey, reason: str) -> None:
        log.warning("request %s: %s", key.request_id, reason, extra=about(key))
        self.rejected_requests += 1
        self.control.send(RequestFailed(*key, reason))

    def _fail_handoff(self, request: DecodeRequest, reason: str) -> None:
        """Its KV did not arrive whole: not the request's fault, so the gateway may serve
        each of its choices again."""
        for key in choice_keys(request):
            log.warning("request %s: %s", key.request_id, reason, extra=about(key))
            self.rejected_requests += 1
            self.control.send(RequestFailed(*key, reason, retry=True))

    def _write_received_kv(self, sequence: DecodeSequence) -> None:
        if sequence.received_kv is None:
            return  # resumed after preemption: recomputed in the step
        for part in sequence.received_kv:
            self.runner.cache.write(sequence.blocks, part.token_start, part.k, part.v,
                                    part.layer_start)
        sequence.num_cached = max(p.token_start + p.k.shape[1] for p in sequence.received_kv)
        if sequence.num_generated == 0:  # a pulled prefix: the rest is computed here
            sequence.num_reused = sequence.num_cached
        sequence.received_kv = None

    def _abort(self, key: RequestKey) -> None:
        sequence = self.scheduler.find(key)
        if sequence is not None:
            self.scheduler.remove(sequence)
            self._trace_end(sequence, "abort")
        elif key in self.phases.compiling:
            self._abort_compiling(key)
        else:
            self.incoming.take(key)
            self.pulls.take(key)
        for fork in self.phases.forks.pop(key, []):  # the others go on, computing the prompt
            fork.num_cached = 0
            self.scheduler.add(fork)
        self.phases.end(key, time.monotonic())

    def _abort_compiling(self, key: RequestKey) -> None:
        """Its other choices (n > 1) go on waiting for the grammar, the first in its place."""
        _, forks = self.phases.compiling.pop(key)
        if forks:
            forks[0].num_cached = 0
            self.phases.compiling[forks[0].key] = (forks[0], forks[1:])

    def heartbeat(self) -> Heartbeat:
        now = time.monotonic()
        self.phases.forget_ended(now)
        for entry in self.incoming.expire(now):
            if entry.request.key in self.pulls.pending:
                self._fall_back(entry.request.key, "the lease ran out")
            else:
                self._fail_handoff(entry.request, "the KV did not arrive in time")
        dropped = self.receiver.dropped + self.incoming.dropped
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.prompt_tokens_pending,
            free_blocks=self.scheduler.cache.num_available, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), preemptions=self.scheduler.preemptions,
            guessed_tokens=self.guessed_tokens, kept_guesses=self.kept_guesses,
            transfers=[TransferTotals("any", "receive", **vars(self.receiver.counters)),
                       *(TransferTotals(backend, "send", **vars(counters))
                         for backend, counters in self.sender.totals())],
            dropped_chunks=[DropCount(reason, n) for reason, n in sorted(dropped.items())],
            in_transfer=len(self.incoming.pending), leases_expired=self.incoming.expired,
            progress=self.progress, holding=self.holding(),
            rejected_peers=self.receiver.rejected_peers,
            pulls=self.pulls.totals, prefill_s_per_token=self.pulls.pace.s_per_token,
        )

    def holding(self) -> list[Held]:
        return [Held(*key) for key in self.phases.held()]

    def drained(self) -> bool:
        return super().drained() and self.sender.staged == 0

    def close(self) -> None:
        self.grammars.close()
        self.receiver.close()
        self.sender.close()
        super().close()


def _forward_batch(batch: list[DecodeSequence], scored: list[bool]) -> ForwardBatch:
    """The step's forward pass. A guessing sequence goes as one row per token, its last and
    its guesses, each at its position over the same blocks: one-token rows, which attend
    together (the paged decode kernel: on the default model, 8 sequences of 3 tokens each
    took 21.8 ms as rows, 35.9 ms as 3-token chunks), each its own row of logits."""
    token_ids: list[list[int]] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    every: list[bool] = []
    for sequence, score in zip(batch, scored, strict=True):
        tokens, start = sequence.step_tokens, sequence.num_cached
        if sequence.draft:
            token_ids += [[token] for token in tokens]
            starts += range(start, start + len(tokens))
            tables += [sequence.block_table] * len(tokens)
            every += [False] * len(tokens)
        else:
            token_ids.append(tokens)
            starts.append(start)
            tables.append(sequence.block_table)
            every.append(score)
    return ForwardBatch(token_ids, starts, tables, every if any(every) else [])


def _scored(sequence: DecodeSequence) -> bool:
    """Whether this step's logits of every new token of the sequence are needed: a prompt
    computed here whose tokens' logprobs the request asked for."""
    return (sequence.request.task.prompt_logprobs is not None and sequence.num_generated == 0
            and sequence.received_kv is None)


def _score_prompts(batch: list[DecodeSequence], scored: list[bool],
                   logits: torch.Tensor) -> list[int]:
    """Add the logprobs of the prompt tokens this step's rows predict to each scored
    sequence (`prompt_scores`, from position 0 again when it starts over); return the row of
    each sequence's last new token in `logits` (its last token's, before any guesses)."""
    if not any(scored) and not any(s.draft for s in batch):  # one row each
        return list(range(len(batch)))
    last_rows: list[int] = []
    row = 0
    for sequence, score in zip(batch, scored, strict=True):
        count = sequence.num_scheduled if score or sequence.draft else 1
        if score:
            start, prompt = sequence.num_cached, sequence.request.task.prompt_ids
            targets = prompt[start + 1:start + count + 1]  # the last prompt row predicts output
            if start == 0:
                sequence.prompt_scores = []
            sequence.prompt_scores += prompt_logprobs(
                logits[row:row + len(targets)], targets,
                sequence.request.task.prompt_logprobs or 0)
        row += count
        last_rows.append(row - 1 - len(sequence.draft))
    return last_rows


def _decode_rows(batch: list[DecodeSequence], scored: list[bool]) -> int:
    """The rows a step that only decodes feeds (each sequence its last token and its
    guesses); 0 for a step with any prompt in it."""
    decoding = not any(scored) and all(
        s.num_generated and s.num_scheduled == 1 + len(s.draft) for s in batch)
    return sum(s.num_scheduled for s in batch) if decoding else 0


def _generator(sequence: DecodeSequence) -> torch.Generator:
    assert sequence.generator is not None, "every sequence this worker made has its generator"
    return sequence.generator


def _decode_seed(seed: int | None) -> int | None:
    """Decode's draws must not replay the draw prefill used for the first token."""
    return None if seed is None else (seed + 1) % 2**63
