"""A decode step's forward batch and the rows of its logits. Pure functions, no model.

A step feeds each sequence in its batch one row of tokens: its next token (or a chunk of its
prompt), or, guessing, its last token and its guesses as one-token rows. The forward pass
returns a row of logits for each row's last token, or for every token of a row whose prompt's
logprobs are asked for (`is_scored`).
"""

from __future__ import annotations

import torch

from decode.scheduler import DecodeSequence
from engine.model.batch import ForwardBatch
from engine.sampling.sampler import prompt_logprobs


def forward_batch(batch: list[DecodeSequence], scored: list[bool]) -> ForwardBatch:
    """The step's forward pass. A guessing sequence goes as one row per token, its last and
    its guesses, each at its position over the same blocks: one-token rows, which attend
    together (the paged decode kernel: on the default model, 8 sequences of 3 tokens each
    took 21.8 ms as rows, 35.9 ms as 3-token chunks), each its own row of logits. The
    pass keeps its hidden states where a prompt computed in it asks for its embedding."""
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
    embedding = any(s.request.task.embedding and s.num_generated == 0 for s in batch)
    return ForwardBatch(token_ids, starts, tables, every if any(every) else [], embedding)


def is_scored(sequence: DecodeSequence) -> bool:
    """Whether this step's logits of every new token of the sequence are needed: a prompt
    computed here whose tokens' logprobs the request asked for."""
    return (sequence.request.task.prompt_logprobs is not None and sequence.num_generated == 0
            and sequence.received_kv is None)


def score_prompts(batch: list[DecodeSequence], scored: list[bool],
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


def decode_rows(batch: list[DecodeSequence], scored: list[bool]) -> int:
    """The rows a step that only decodes feeds (each sequence its last token and its
    guesses); 0 for a step with any prompt in it."""
    decoding = not any(scored) and all(
        s.num_generated and s.num_scheduled == 1 + len(s.draft) for s in batch)
    return sum(s.num_scheduled for s in batch) if decoding else 0
