"""Structured output: grammars (JSON schemas, any JSON object, regular expressions, EBNF;
compiled by xgrammar) that restrict the tokens a sequence may draw next, shared by the prefill
worker (first token) and the decode worker.

xgrammar and the tokenizer are imported, and the vocabulary's tables built, on a thread of
their own, once the worker has registered (`engine.grammar_tables_at_start`) or when the first
grammar comes: that takes seconds of a CPU (both bring in transformers), which neither holds up
a start nor is spent by a worker told to wait for a grammar that never comes."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from core.messages import GenerationTask, Grammar, RequestKey
from engine.sampling.sampler import History
from engine.sampling.stopping import banned_tokens, stop_tokens
from engine.sampling.thought import ThoughtGate, opening

if TYPE_CHECKING:
    import xgrammar as xgr

Waiting = TypeVar("Waiting")
log = logging.getLogger(__name__)
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar that cannot be compiled."""


class Constraint:
    """One sequence's place in its grammar: which tokens may come next, advanced token by token.

    Stop tokens are allowed only where the grammar can end; once one is taken (kept going by
    ignore_eos), only stop tokens remain allowed. With a `gate`, the grammar waits out the
    model's thought (engine/sampling/thought.py)."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int,
                 forbidden: torch.Tensor | None = None, gate: ThoughtGate | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.forbidden = forbidden  # bool [vocab]: never allowed inside the value
        self.gate = gate
        import xgrammar as xgr  # imported already: `matcher` is one of its objects

        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> torch.Tensor | None:
        """A bool mask `[vocab]` of the tokens allowed next; None while any token is."""
        if self.gate is not None and not self.gate.answering:
            return self.gate.allowed(self._grammar_allows)
        return self._grammar_allows()

    def _grammar_allows(self) -> torch.Tensor:
        if self.matcher.is_terminated():
            return self._only(self.matcher.stop_token_ids)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        mask = unpack_bitmask(self._bitmask[0], self.vocab_size)
        return mask if self.forbidden is None else mask & ~self.forbidden

    def advance(self, token_id: int) -> None:
        """Take `token_id`; one the grammar does not allow is logged and skipped."""
        if self.gate is not None and not self.gate.answering and self.gate.take(token_id):
            if self.gate.answer_begun and not self.matcher.accept_string(self.gate.answer_begun):
                log.warning("the answer after the thought does not match the request's grammar")
            return
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            log.warning("token %d does not match the request's grammar", token_id)

    def _only(self, token_ids: Sequence[int]) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[[t for t in token_ids if 0 <= t < self.vocab_size]] = True
        return mask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask row (bit i of word w: token 32 * w + i) as a bool mask."""
    return ((bitmask.unsqueeze(1) >> _BITS) & 1).bool().flatten()[:vocab_size]


@dataclass(frozen=True)
class _Tables:
    """What every grammar of a vocabulary compiles against."""

    tokenizer_info: xgr.TokenizerInfo
    compiler: xgr.GrammarCompiler
    control_token_ids: tuple[int, ...]
    token_bytes: tuple[bytes, ...]  # each token's text


class Grammars:
    """A worker's grammar compiler, off its loop: a daemon thread builds the vocabulary tables
    when asked to `warm_up` or when the first grammar comes, and one thread of its own compiles
    each grammar `prepare` is given against them (cached by kind and text, LRU), so that a
    loop only ever polls whether a grammar is `ready`. Both run in C++ for the most part; the
    loop (and its heartbeats) go on meanwhile.

    Neither thread runs a torch op: one that fills a vocabulary-sized tensor runs in
    parallel, and an OpenMP team in a second live thread makes libgomp stop spinning for the
    loop's (more threads than CPUs), so every product of a decode step waits on a woken
    thread: one stream's step went from 9.3 to 15.4 ms at AVX2 on two cores."""

    def __init__(self, model_dir: Path, vocab_size: int, cache_size: int = 64) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._tables_built: Future[_Tables] | None = None
        self._compiled: OrderedDict[Grammar, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._control_tokens: torch.Tensor | None = None
        self._openers: dict[bytes, torch.Tensor] = {}

    def warm_up(self) -> None:
        """Build the vocabulary tables now, ahead of the first grammar, at the lowest CPU
        priority: processes starting beside this one, and steps, go first."""
        self._tables(niceness=19)

    def prepare(self, grammar: Grammar) -> Future[xgr.CompiledGrammar]:
        """The compilation of a task's `grammar`, started now unless cached."""
        future = self._compiled.get(grammar)
        if future is None:
            self._tables()  # the compile waits for them
            future = self._thread.submit(self._compile, grammar)
            self._compiled[grammar] = future
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return future

    def ready(self, grammar: Grammar) -> bool:
        """Whether `grammar` has compiled (or failed to); starts it when new."""
        return self.prepare(grammar).done()

    def take_ready(self, waiting: dict[RequestKey, Waiting],
                   grammar_of: Callable[[Waiting], Grammar | None]) -> list[Waiting]:
        """Take out of `waiting` (what waits for its grammar, in order) those whose grammar
        has compiled since."""
        ready = []
        for key, item in list(waiting.items()):
            grammar = grammar_of(item)
            assert grammar is not None, "only a grammar waits to compile"
            if self.ready(grammar):
                ready.append(waiting.pop(key))
        return ready

    def compiled(self, grammar: Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting for it if need be; GrammarError if it has none."""
        try:
            return self.prepare(grammar).result()
        except RuntimeError as exc:  # xgrammar's error for a bad or unsupported grammar
            raise GrammarError(str(exc).strip()) from None

    def problem(self, grammar: Grammar) -> str | None:
        """Why a grammar that is `ready` cannot be used; None when it can."""
        try:
            self.compiled(grammar)
        except GrammarError as exc:
            return f"invalid grammar: {exc}"
        return None

    @property
    def control_tokens(self) -> torch.Tensor:
        """A bool mask `[vocab]` of the tokens holding a control byte, built on the caller's
        thread the first time."""
        if self._control_tokens is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(self._tables().result().control_token_ids)] = True
            self._control_tokens = mask
        return self._control_tokens

    def openers(self, marker: bytes) -> torch.Tensor:
        """A bool mask `[vocab]` of the tokens that begin with the whole `marker`, built on the
        caller's thread the first time."""
        mask = self._openers.get(marker)
        if mask is None:
            mask = opening(self._tables().result().token_bytes, marker, self.vocab_size)
            self._openers[marker] = mask
        return mask

    def close(self) -> None:
        """Stop compiling: queued grammars are dropped, one compiling now finishes."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    def constraint(self, task: GenerationTask, eos_token_ids: tuple[int, ...]
                   ) -> Constraint | None:
        """A fresh constraint for the task's grammar (None without one), advanced over the
        output a resumed request has streamed already. Waits for the grammar unless `ready`."""
        if not task.grammar:
            return None
        import xgrammar as xgr

        stops = list(stop_tokens(task, eos_token_ids) or eos_token_ids) or None
        matcher = xgr.GrammarMatcher(self.compiled(task.grammar), override_stop_tokens=stops)
        forbidden = None
        if task.grammar.kind in ("json_schema", "json_object"):  # JSON holds no control byte
            forbidden = self.control_tokens.clone()
            forbidden[[t for t in (stops or []) if 0 <= t < self.vocab_size]] = False
        gate = None if task.thinking is None else ThoughtGate(
            task.thinking, self._tables().result().token_bytes, self.openers)
        constraint = Constraint(matcher, self.vocab_size, forbidden, gate)
        for token_id in task.prompt_ids[task.prompt_len:]:
            constraint.advance(token_id)
        return constraint

    def _tables(self, niceness: int = 0) -> Future[_Tables]:
        """The vocabulary tables' build, started the first time on a daemon thread (a worker's
        exit does not wait for it) at `niceness`."""
        if self._tables_built is None:
            self._tables_built = Future()
            threading.Thread(target=self._build_tables_into, args=(self._tables_built, niceness),
                             name="grammar-tables", daemon=True).start()
        return self._tables_built

    def _build_tables_into(self, tables: Future[_Tables], niceness: int) -> None:
        if niceness:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)  # this thread
        try:
            tables.set_result(self._build_tables())
        except Exception as exc:  # for the first grammar to meet, as the grammar thread's
            tables.set_exception(exc)

    def _build_tables(self) -> _Tables:
        import xgrammar as xgr

        from engine.weights.tokenizer import load_tokenizer

        started = time.monotonic()
        tokenizer = load_tokenizer(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        token_bytes = tuple(bytes(token) for token in info.decoded_vocab)
        tables = _Tables(info, compiler, _control_token_ids(token_bytes, self.vocab_size),
                         token_bytes)
        log.info("grammar tables ready in %.2f s", time.monotonic() - started)
        return tables

    def _compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        started = time.monotonic()
        compiled = self._tables().result().compiler.compile_grammar(parsed(grammar))
        log.info("%s grammar compiled in %.2f s", grammar.kind, time.monotonic() - started)
        return compiled


def parsed(grammar: Grammar) -> xgr.Grammar:
    """`grammar` as xgrammar reads it; RuntimeError for one it cannot. JSON takes compact
    separators: with free whitespace a model can loop on spaces forever."""
    import xgrammar as xgr

    if grammar.kind == "regex":
        return xgr.Grammar.from_regex(grammar.text)
    if grammar.kind == "ebnf":
        return xgr.Grammar.from_ebnf(grammar.text)
    if grammar.kind == "lark":
        return xgr.Grammar.from_lark(grammar.text)
    schema = ANY_OBJECT_SCHEMA if grammar.kind == "json_object" else grammar.text
    return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)


def _control_token_ids(token_bytes: Sequence[bytes], vocab_size: int) -> tuple[int, ...]:
    """Tokens holding a control byte (below 0x20): JSON allows none unescaped, and with
    compact separators not even as whitespace, yet xgrammar's string rule lets them in."""
    return tuple(token_id for token_id, token in enumerate(token_bytes[:vocab_size])
                 if any(byte < 0x20 for byte in token))


def history_of(task: GenerationTask, tokens: Sequence[int], num_generated: int,
               eos_token_ids: tuple[int, ...], constraint: Constraint | None) -> History:
    """What the next draw looks at: the `tokens` so far (the prompt, then the output), for
    the penalties; EOS and stop tokens banned under min_tokens; the tokens its grammar's
    `constraint` allows."""
    allowed = None if constraint is None else constraint.allowed()
    return History(tokens, task.prompt_len, banned_tokens(task, num_generated, eos_token_ids),
                   allowed)
