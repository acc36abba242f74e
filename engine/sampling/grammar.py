"""Structured output: JSON grammars (through xgrammar) that restrict the tokens a sequence may
draw next, shared by the prefill worker (first token) and the decode worker."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import xgrammar as xgr

from core.messages import JSON_OBJECT, GenerationTask
from engine.sampling.stopping import stop_tokens
from engine.weights.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar that cannot be compiled."""


class Constraint:
    """One sequence's place in its grammar: which tokens may come next, advanced token by token.

    Stop tokens are allowed only where the grammar can end; once one is taken (kept going by
    ignore_eos), only stop tokens remain allowed."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int,
                 forbidden: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.forbidden = forbidden  # bool [vocab]: never allowed inside the value
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> torch.Tensor:
        """A bool mask `[vocab]` of the tokens the grammar allows next."""
        if self.matcher.is_terminated():
            return self._only(self.matcher.stop_token_ids)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        mask = unpack_bitmask(self._bitmask[0], self.vocab_size)
        return mask if self.forbidden is None else mask & ~self.forbidden

    def advance(self, token_id: int) -> None:
        """Take `token_id`; one the grammar does not allow is logged and skipped."""
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


class Grammars:
    """A worker's grammar compiler: the tokenizer's vocabulary is read from the model folder
    once, at the first grammar; compiled grammars are kept by their text (LRU)."""

    def __init__(self, model_dir: Path, vocab_size: int, cache_size: int = 64) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self._compiled = functools.lru_cache(maxsize=cache_size)(self._compile)

    @functools.cached_property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        tokenizer = load_tokenizer(self.model_dir)
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)

    @functools.cached_property
    def compiler(self) -> xgr.GrammarCompiler:
        return xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    @functools.cached_property
    def control_tokens(self) -> torch.Tensor:
        """Tokens holding a control byte (below 0x20): JSON allows none unescaped, and with
        compact separators not even as whitespace, yet xgrammar's string rule lets them in."""
        vocab = self.tokenizer_info.decoded_vocab
        has_control = [any(byte < 0x20 for byte in token) for token in vocab]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[:len(has_control)] = torch.tensor(has_control[:self.vocab_size])
        return mask

    def compiled(self, grammar: str) -> xgr.CompiledGrammar:
        """The compiled grammar of a task's `grammar` text; GrammarError if it has none."""
        try:
            return self._compiled(grammar)
        except RuntimeError as exc:  # xgrammar's error for a bad or unsupported schema
            raise GrammarError(str(exc).strip()) from None

    def constraint(self, task: GenerationTask, eos_token_ids: tuple[int, ...]
                   ) -> Constraint | None:
        """A fresh constraint for the task's grammar (None without one), advanced over the
        output a resumed request has streamed already."""
        if not task.grammar:
            return None
        stops = list(stop_tokens(task, eos_token_ids) or eos_token_ids) or None
        matcher = xgr.GrammarMatcher(self.compiled(task.grammar), override_stop_tokens=stops)
        forbidden = self.control_tokens.clone()
        forbidden[[t for t in (stops or []) if 0 <= t < self.vocab_size]] = False
        constraint = Constraint(matcher, self.vocab_size, forbidden)
        for token_id in task.prompt_ids[task.prompt_len:]:
            constraint.advance(token_id)
        return constraint

    def _compile(self, grammar: str) -> xgr.CompiledGrammar:
        # Compact separators: with free whitespace a model can loop on spaces forever.
        schema = ANY_OBJECT_SCHEMA if grammar == JSON_OBJECT else grammar
        return self.compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
