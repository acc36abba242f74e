"""`SimRunner`: what a worker of a simulated model runs in place of `ModelRunner`. The cache,
its allocator and everything around them are the real ones; a forward pass writes the token
chain's states into the cache (engine.sim.tokens), sleeps the profile's step time, and
returns logits whose top token is the chain's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kv.allocator import BlockAllocator
from engine.kv.cache import PagedKVCache
from engine.model.batch import ForwardBatch
from engine.model.chunk_cost import ChunkCost
from engine.sim.folder import folder_profile, scaled_kv
from engine.sim.tokens import SEED, STATE_BYTES, choice, states
from engine.weights.spec import ModelSpec, kv_fingerprint, load_spec

# Logits: the chain's token, the letter drawn when that is banned, and the rest, far enough
# apart that no temperature (at most 2) or penalty ever draws another.
CHOSEN, FALLBACK, OTHERS = 0.0, -50.0, -1e4


class StateRows:
    """The states kept in a KV cache tensor `[layers, slots, heads, head_dim]`: each
    position's in the first `STATE_BYTES` values of its K row, in every layer (each layer's
    KV travels on its own); read back from the last layer, the last to arrive."""

    def __init__(self, k: torch.Tensor) -> None:
        layers, slots = k.shape[:2]
        assert k[0, 0].numel() >= STATE_BYTES, "a KV row holds a state"
        self.rows = k.view(layers, slots, -1)
        self._shifts = torch.arange(STATE_BYTES) * 8

    def read(self, slots: list[int]) -> list[int]:
        """The states at `slots`."""
        held = self.rows[-1, slots, :STATE_BYTES].to(torch.int64)
        return (held << self._shifts).sum(dim=1).tolist()

    def write(self, slots: list[int], values: list[int]) -> None:
        """Keep `values` at `slots`, in every layer."""
        packed = (torch.tensor(values, dtype=torch.int64)[:, None] >> self._shifts) & 0xFF
        self.rows[:, slots, :STATE_BYTES] = packed.to(self.rows.dtype)


class SimRunner:
    """A runner of the simulated model in `model_dir` (engine.sim.folder) with a `num_blocks`
    x `block_size` cache. Step times are the profile's, times `time_scale`."""

    kernel_isa = "sim"

    def __init__(self, model_dir: Path, num_blocks: int, block_size: int, kv_bytes: float = 1.0,
                 time_scale: float = 1.0) -> None:
        self.model_dir = Path(model_dir)
        self.profile = folder_profile(self.model_dir)
        full = load_spec(self.model_dir)
        self.spec = scaled_kv(full, kv_bytes)
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.cache = PagedKVCache(self.spec, num_blocks, block_size,
                                  getattr(torch, self.profile.dtype))
        self.allocator = BlockAllocator(num_blocks)
        self.chunk_cost = self._chunk_cost(full)
        self.time_scale = time_scale
        self._states = StateRows(self.cache.k)
        self.hidden = torch.empty(0, self.spec.hidden_size)

    @property
    def kv_fingerprint(self) -> str:
        return kv_fingerprint(self.spec, self.profile.dtype)

    def forward(self, batch: ForwardBatch,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits picking each sequence's next token (one row per new token where the batch
        asks for all), after the profile's time for this step (a share of it before each
        layer's hook)."""
        began = time.monotonic()
        logit_states = self._advance(batch)
        if batch.hidden:
            self.hidden = self._hidden(logit_states)
        duration = self.profile.latency.step_s(batch) * self.time_scale
        layers = self.spec.num_layers if layer_hook is not None else 1
        for layer in range(layers):
            _sleep_until(began + duration * (layer + 1) / layers)
            if layer_hook is not None:
                layer_hook(layer)
        return self._logits(logit_states)

    def _advance(self, batch: ForwardBatch) -> list[int]:
        """The state after each row whose logits the batch asks for (each sequence's last new
        token, or all its new tokens); every new position's kept in the cache. A row may
        follow one of the same pass over the same blocks (a decode worker's guesses), as the
        model's attention sees the KV written before it."""
        starts, tables = batch.start_positions, batch.block_tables
        before = self._states.read([self._slot(table, start - 1) for table, start
                                    in zip(tables, starts, strict=True) if start > 0])
        written: dict[int, int] = {}  # slot -> state, of this pass
        rows: list[int] = []
        earlier = iter(before)
        for index, (tokens, start, table) in enumerate(zip(batch.token_ids, starts, tables,
                                                           strict=True)):
            previous = SEED
            if start > 0:
                previous = written.get(self._slot(table, start - 1), next(earlier))
            chain = states(tokens, start, previous)
            slots = [self._slot(table, p) for p in range(start, start + len(tokens))]
            written.update(zip(slots, chain, strict=True))
            rows += chain[-batch.logit_rows(index):]
        self._states.write(list(written), list(written.values()))
        return rows

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _logits(self, row_states: list[int]) -> torch.Tensor:
        logits = torch.full((len(row_states), self.spec.vocab_size), OTHERS)
        for row, state in enumerate(row_states):
            picked = choice(state, self.profile.mean_output_tokens)
            logits[row, picked.letter] = FALLBACK
            logits[row, picked.token] = CHOSEN
        return logits

    def _hidden(self, row_states: list[int]) -> torch.Tensor:
        """A made-up hidden state for each row, drawn from its state: the same tokens after the
        same prefix give the same one."""
        return torch.stack([torch.randn(self.spec.hidden_size,
                                        generator=torch.Generator().manual_seed(state % 2**63))
                            for state in row_states])

    def _chunk_cost(self, spec: ModelSpec) -> ChunkCost:
        """Keys per token as the profile prices them; the shape's estimate where it prices no
        keys."""
        latency = self.profile.latency
        if latency.prefill_ms_per_token > 0 and latency.prefill_ms_per_token_context > 0:
            return ChunkCost(latency.prefill_ms_per_token / latency.prefill_ms_per_token_context)
        return ChunkCost.of(spec)


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)
