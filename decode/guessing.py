"""How many tokens a decoding sequence guesses in a step: as many as pay for themselves.
Pure bookkeeping, no model.

A guess is a row more of the step's products and attention. A step of B sequences makes B
tokens in `fixed + B * per_row` seconds; its j-th guess for a sequence is kept with probability
p**j (p: that sequence's rate of guesses kept, drawn towards the worker's), and adds a token
where it is. So the j-th guess pays while p**j, the token it is expected to add, is worth at
least the row it costs at the rate the step makes tokens anyway:

    p**j >= per_row * B / (fixed + B * per_row)

A lone stream guesses while p**j >= ~0.14 on the default model; eight streams each only
while p**j >= ~0.5. Both costs are learned from the worker's own steps (StepCosts), so the
threshold follows the CPU and the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SEQUENCE_MEMORY = 0.8  # each step, a sequence's earlier guesses weigh this much less
WORKER_MEMORY = 0.98  # each guessing sequence's step, the worker's earlier guesses
PRIOR_WEIGHT = 2.0  # the worker's rate weighs as much as this many of a sequence's guesses
COST_MEMORY = 0.9  # each step of a row count, that count's earlier steps weigh this much less
FIXED_IN_ROWS = 6.0  # with one row count seen: a step's fixed part, in rows (7 measured)


@dataclass
class Tally:
    """Guesses tried and kept, older ones fading. A try is a guess whose draw was made: the
    kept ones and the first miss (the guesses after a miss are never drawn)."""
    tries: float = 0.0
    kept: float = 0.0

    def add(self, tries: int, kept: int, memory: float) -> None:
        assert 0 <= kept <= tries
        self.tries = self.tries * memory + tries
        self.kept = self.kept * memory + kept

    def fade(self, memory: float) -> None:
        self.tries *= memory
        self.kept *= memory


class StepCosts:
    """Seconds a decode step takes by its rows, learned from steps that only decode: a
    fixed part and a part per row, a line through each row count's recent mean."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # row count: its steps' recent mean
        self.steps: dict[int, int] = {}  # row count: steps seen, up to 20 (its weight)
        self._line: tuple[float, float] | None = None  # fitted since the last step, if asked

    def observe(self, rows: int, seconds: float) -> None:
        assert rows > 0 and seconds >= 0
        seen = self.steps.get(rows, 0)
        mean = self.seconds.get(rows, seconds)
        self.seconds[rows] = mean * COST_MEMORY + seconds * (1 - COST_MEMORY) if seen else seconds
        self.steps[rows] = min(seen + 1, 20)
        self._line = None

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, both at least 0; None before any step. Fitted once per
        step, however many sequences ask."""
        if self._line is None and self.seconds:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if len(self.seconds) == 1:
            ((rows, seconds),) = self.seconds.items()
            per_row = seconds / (rows + FIXED_IN_ROWS)
            return per_row * FIXED_IN_ROWS, per_row
        weight = sum(self.steps.values())
        mean_rows = sum(r * n for r, n in self.steps.items()) / weight
        mean_seconds = sum(self.seconds[r] * n for r, n in self.steps.items()) / weight
        spread = sum(n * (r - mean_rows) ** 2 for r, n in self.steps.items())
        slope = sum(n * (r - mean_rows) * (self.seconds[r] - mean_seconds)
                    for r, n in self.steps.items()) / spread
        per_row = max(slope, 0.0)
        return max(mean_seconds - per_row * mean_rows, 0.0), per_row


class Guessing:
    """The worker's guessing policy: each step, how many tokens each sequence guesses."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.costs = StepCosts()
        self.worker = Tally()

    def rate(self, own: Tally) -> float:
        """A sequence's chance that a guess is kept: its own record, drawn towards the
        worker's. The worker's starts at 3/4, hopeful, so that streams try guessing at
        first even where many run, and learn whether it pays."""
        worker = (self.worker.kept + 3) / (self.worker.tries + 4)
        return (own.kept + PRIOR_WEIGHT * worker) / (own.tries + PRIOR_WEIGHT)

    def allowance(self, own: Tally, running: int) -> int:
        """How many tokens a sequence may guess this step, `running` sequences decoding."""
        line = self.costs.line()
        if line is None:
            return 0
        fixed, per_row = line
        step = fixed + running * per_row
        threshold = per_row * running / step if step > 0 else 0.0
        chance = self.rate(own)
        if threshold <= 0 or chance >= 1:
            return self.max_tokens
        if chance <= 0 or threshold >= 1:
            return 0
        return min(self.max_tokens, math.floor(math.log(threshold) / math.log(chance)))

    def record(self, own: Tally, tries: int, kept: int) -> None:
        """A sequence's step with guesses: `tries` of them drawn, `kept` kept."""
        own.add(tries, kept, SEQUENCE_MEMORY)
        self.worker.add(tries, kept, WORKER_MEMORY)

    def skip(self, own: Tally) -> None:
        """A sequence's step without guesses: its own record fades, so one that stopped
        guessing comes back to the worker's rate and tries again once that pays."""
        own.fade(SEQUENCE_MEMORY)
