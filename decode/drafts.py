"""Draft tokens for speculative decoding by n-gram lookup ("prompt lookup"): where the last few
tokens of a sequence occurred before, in its prompt or its output, the tokens that followed
them then are a guess at what follows now. Pure bookkeeping, no model.

The decode worker feeds the guesses with the sequence's last token in one forward pass and
draws each position's token in order as a step of its own would, keeping guesses while they
equal the draws (decode/sampler.py): the output is the one decoding without guesses gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 3) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` that occurred before, `max_n` down to `min_n` tokens long; [] where none did.
    (One token is too little to go on: on the default model, guessing from single tokens
    too streamed 32 chats one at a time at 152 against 164 output tokens/s.)"""
    assert 1 <= min_n <= max_n
    if k <= 0 or len(tokens) <= min_n:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    end = len(ids)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        # Windows ids[s:s+n] that equal the suffix and have a token after them (s + n < end).
        match = np.ones(end - n, dtype=bool)
        for offset in range(n):
            match &= ids[offset:end - n + offset] == ids[end - n + offset]
        starts = np.flatnonzero(match)
        if len(starts):
            follows = int(starts[-1]) + n
            return ids[follows:follows + k].tolist()
    return []
