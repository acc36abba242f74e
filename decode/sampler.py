"""A decode worker's draws: what each step's logits become, and the guesses it feeds.

After a step's forward pass, each sequence whose KV the step completed draws its next token
(a prompt computed here first forks the choices waiting on its KV, which draw theirs from the
same row), then its guesses' rows while they hold; each token drawn advances its sequence and
ends it where it finishes. Before a step, each decoding sequence guesses its next tokens
(decode/drafts.py) as far as decode/guessing.py finds they pay.
"""

from __future__ import annotations

import logging
import time

import torch

from core.channels import ControlClient
from core.config import DecodeConfig
from core.logs import about
from core.messages import PromptLogprobs, RequestKey, StageTime, TokenEvent
from core.tracing import Tracer
from decode.drafts import propose
from decode.guessing import Guessing
from decode.phases import Phase, Phases
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.pooling import embedding_bytes
from engine.runner import Runner
from engine.sampling.grammar import history_of
from engine.sampling.sampler import Draw, History, draw, seed_at
from engine.sampling.stopping import finish_reason

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, scheduler: DecodeScheduler, phases: Phases, runner: Runner,
                 control: ControlClient, tracer: Tracer | None, config: DecodeConfig) -> None:
        self.scheduler = scheduler
        self.phases = phases
        self.runner = runner
        self.control = control
        self.tracer = tracer
        # Guessing is measured on CPUs only (docs/scheduling.md): off on a GPU until it is.
        on_cpu = runner.device.type == "cpu"
        self.speculative_tokens = config.speculative_tokens if on_cpu else 0
        self.speculative_max_running = config.speculative_max_running
        self.guessing = Guessing(self.speculative_tokens)
        self.guessed_tokens = self.kept_guesses = 0  # since start

    def draw_next(self, batch: list[DecodeSequence], logits: torch.Tensor, rows: list[int],
                  ) -> list[TokenEvent]:
        """Each sequence whose KV the step completed draws its next token from its row of
        `logits`, and its guessed tokens' after it while they hold."""
        for sequence in batch:
            sequence.num_cached += sequence.num_scheduled - len(sequence.draft)
        ready = [i for i, s in enumerate(batch) if s.num_cached == len(s.tokens)]
        ready_rows = [rows[i] for i in ready]
        embeddings = self._embeddings([batch[i] for i in ready], ready_rows)
        events = self._sample([batch[i] for i in ready], logits[ready_rows], embeddings)
        return events + self._check_guesses([(batch[i], logits[rows[i] + 1:rows[i] + 1 + len(
            batch[i].draft)]) for i in ready if batch[i].draft])

    def guess_next_tokens(self) -> None:
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

    def _embeddings(self, ready: list[DecodeSequence], rows: list[int]
                    ) -> dict[RequestKey, bytes]:
        """The embedding of each prompt prefilled here just now that asked for one, from the
        step's hidden states (the batch kept them: decode/batch.py)."""
        asking = [(s.key, row) for s, row in zip(ready, rows, strict=True)
                  if s.request.task.embedding and s.num_generated == 0]
        if not asking:
            return {}
        keys, rows_asked = zip(*asking, strict=True)
        vectors = embedding_bytes(self.runner.hidden[list(rows_asked)])
        return dict(zip(keys, vectors, strict=True))

    def _sample(self, ready: list[DecodeSequence], logits: torch.Tensor,
                embeddings: dict[RequestKey, bytes]) -> list[TokenEvent]:
        """Draw the next token of each sequence whose KV is complete (with its prompt's
        `embeddings` where asked for), and the first token of each choice forked from a
        prompt prefilled here just now."""
        drawing: list[DecodeSequence] = []
        rows: list[int] = []
        for row, sequence in enumerate(ready):
            forked = self.fork(sequence, drawing=True) if sequence.num_generated == 0 else []
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
        return [self._advance(s, d, embeddings.get(s.key, b""))
                for s, d in zip(drawing, draws, strict=True)]

    def fork(self, parent: DecodeSequence, drawing: bool) -> list[DecodeSequence]:
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
        return history_of(sequence.request.task, sequence.tokens, sequence.num_generated,
                          self.runner.spec.eos_token_ids, sequence.constraint)

    def _advance(self, sequence: DecodeSequence, token: Draw, embedding: bytes = b""
                 ) -> TokenEvent:
        sequence.tokens.append(token.token_id)
        sequence.num_generated += 1
        task = sequence.request.task
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
            self.trace_end(sequence, reason)
        cached = sequence.num_reused if sequence.num_generated == 1 else 0
        return TokenEvent(*sequence.key, sequence.num_generated - 1, token.token_id, reason,
                          token.logprob, token.top, stages, cached, embedding)

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

    def trace_end(self, sequence: DecodeSequence, outcome: str) -> None:
        """The request ended here (finished or aborted): its spans on this worker."""
        if self.tracer is None:
            return
        request = sequence.request
        self.tracer.stages(request.traceparent, sequence.timeline, {
            "raging.request_id": request.request_id, "raging.epoch": request.epoch,
            "raging.prompt_tokens": len(request.task.prompt_ids),
        }, ended=time.monotonic(), outcome={"raging.output_tokens": sequence.num_generated,
                                            "raging.finish_reason": outcome})


def _generator(sequence: DecodeSequence) -> torch.Generator:
    """The sequence's generator, seeded for its next output token if the request has a seed
    (engine.sampling.sampler.seed_at)."""
    generator = sequence.generator
    assert generator is not None, "every sequence this worker made has its generator"
    task = sequence.request.task
    seed = seed_at(task.sampling.seed, task.output_before + sequence.num_generated)
    if seed is not None:
        generator.manual_seed(seed)
    return generator
