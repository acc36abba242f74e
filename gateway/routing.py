"""Routing: the workers each request goes to, picked from the pools gateway/registry.py says
serve.

Conditional disaggregation (a prefill worker, or the decode worker prefilling the prompt
itself), a cached prefix followed or pulled from another worker, and packing onto workers that
share CPUs (gateway/packing.py). `Router` reads the registry, never changes who is a member,
and counts its own decisions.
"""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from core.config import HistoryRouting, PullMode, Role
from engine.kv.block_hash import block_hashes
from gateway.packing import PACK, Packing, Unit, alone, pack, units
from gateway.registry import Registry, WorkerInfo

T = TypeVar("T")

# Who prefills a request: a prefill worker, or its decode worker itself (and why).
RoutePath = Literal["disaggregated", "local_short", "local_saturated", "local_no_prefill",
                    "local_cached", "local_prompt_logprobs"]
ROUTE_PATHS: tuple[RoutePath, ...] = typing.get_args(RoutePath)
# A decode worker's prefill time per prompt token, assumed until its steps have measured it.
_UNMEASURED_S_PER_TOKEN = 1e-3
_MEASURED_BYTES = 1 << 20  # sends that say enough about a worker's transfer rate


@dataclass(frozen=True)
class PullPlan:
    """The KV of a prompt's first `tokens` tokens, to be pulled from `source`'s prefix cache by
    the decode worker prefilling the rest; it costs about as long as computing `cost_tokens`
    prompt tokens there."""

    source: WorkerInfo
    tokens: int
    cost_tokens: float


@dataclass(frozen=True)
class Route:
    """Where a request goes: the worker that prefills it (a prefill worker, or the decode
    worker itself) and the decode worker, with why (`Router.route`); and the cached prefix
    the decode worker pulls first, if any."""

    prefill: WorkerInfo
    decode: WorkerInfo
    path: RoutePath
    pull: PullPlan | None = None


@dataclass(frozen=True)
class Pulling:
    """Where a prompt with a cached prefix goes (`gateway.history_routing`), and whether a
    decode worker pulls a prefix cached elsewhere (`gateway.pull_prefixes`): when the cache
    holds `min_tokens` more than it does, and (`auto`) sending them (at the holder's measured
    rate, else `bytes_per_s`) takes less time than computing them (at its own measured pace),
    or `always`."""

    history: HistoryRouting = "follow"
    mode: PullMode = "auto"
    min_tokens: int = 64
    bytes_per_s: float = 500e6


@dataclass(frozen=True)
class LocalPrefill:
    """When a decode worker prefills a prompt itself rather than a prefill worker: prompts of
    at most `max_tokens` (0: none); and prompts of at most `saturated_max_tokens` while every
    prefill worker holds at least `saturated_tokens` (0: never) and the decode worker has
    headroom. A longer prompt would stall decode's running sequences for several chunks: it
    waits for a prefill worker however long its queue."""

    max_tokens: int = 0
    saturated_tokens: int = 0
    saturated_max_tokens: int = 256


class Router:
    """Picks each request's workers (`route`) among those `registry` says serve, by the
    policies given: when a decode worker prefills a prompt itself (`local`), how work packs
    onto workers sharing CPUs (`packing`), and where a prompt with a cached prefix goes and
    whether a prefix is pulled (`pulling`)."""

    def __init__(self, registry: Registry, local: LocalPrefill = LocalPrefill(),
                 packing: Packing = PACK, pulling: Pulling = Pulling()) -> None:
        self.registry = registry
        self.local = local
        self.packing = packing
        self.pulling = pulling
        self.pulls: Counter[Role] = Counter()  # prefixes pulled, by the holder's role
        self.decisions: Counter[RoutePath] = Counter()  # routes taken, by path
        # While a route is being picked: pools and units as they are then (none change
        # meanwhile), found once rather than by each of its steps.
        self._memo: dict[str, Any] | None = None

    def serving(self, role: Role) -> list[WorkerInfo]:
        """`Registry.serving`: the workers of `role` routed to, found once per route."""
        return self._remembered(role, lambda: self.registry.serving(role))

    def _remembered(self, key: str, find: Callable[[], T]) -> T:
        """`find()`, found once per route."""
        if self._memo is None:
            return find()
        if key not in self._memo:
            self._memo[key] = find()
        found: T = self._memo[key]
        return found

    def pick_prefill(self, prompt: Sequence[int] = (), salt: str = "") -> WorkerInfo | None:
        """The prefill worker that would get through `prompt` first: the fewest tokens to
        compute on its CPUs per worker they run at once, those already waiting there plus the
        prompt's own less the prefix it probably has cached (`spread`: on the worker alone).
        Ties among workers sharing CPUs go to one with room for the prompt's KV, then to the
        busiest, so that prompts batch in one worker's steps rather than take turns on the
        core; then to the fewest requests. The one picked learns the prompt's prefix."""
        return self._pick_prefill(Chains(prompt, salt))

    def _pick_prefill(self, chain: Chains) -> WorkerInfo | None:
        best = self._best_prefill(chain)
        if best is not None and best[0].prefix_caching:
            best[0].prefixes.add(chain.of(best[0]))
        return None if best is None else best[0]

    def _best_prefill(self, chain: Chains) -> tuple[WorkerInfo, float] | None:
        """The prefill worker `pick_prefill` picks, with its work per slot (in tokens)."""
        unit_of = {w.worker_id: unit for unit in self._prefill_units() for w in unit.workers}

        def cost(worker: WorkerInfo) -> tuple[float, bool, int, int, str]:
            return _prefill_cost(worker, unit_of[worker.worker_id], len(chain.prompt),
                                 chain.cached(worker))

        best = min(self.serving("prefill"), key=cost, default=None)
        return None if best is None else (best, cost(best)[0])

    def route(self, prompt: Sequence[int], salt: str = "",
              prompt_logprobs: bool = False) -> Route | None:
        """Pick the workers for a prompt (None while no decode worker serves). Conditional
        disaggregation: the decode worker prefills it itself when the prompt is short, when
        the prefill pool is saturated and it has headroom, or when there is no prefill pool
        (colocated mode, or every prefill worker gone); otherwise a prefill worker does.
        Either way a decode worker that holds the prompt's prefix (a chat's earlier turns),
        or can pull it, takes it, and computes only the rest, when that is less work
        (`_cached_decode`). A prompt whose tokens' logprobs are asked for is computed whole
        by the decode worker (no cache: each token's logits are needed)."""
        self._memo = {}
        try:
            chain = Chains(prompt, salt)
            if prompt_logprobs:
                return self._scored(chain)
            chain.look_for(self.registry.workers.values())
            return self._route(chain)
        finally:
            self._memo = None

    def _scored(self, chain: Chains) -> Route | None:
        decode = self.pick_decode(len(chain.prompt))
        if decode is None:
            return None
        self.decisions["local_prompt_logprobs"] += 1
        return Route(decode, decode, "local_prompt_logprobs")

    def _route(self, chain: Chains) -> Route | None:
        prompt = chain.prompt
        avoid = self._avoided(chain)
        decode = self.pick_decode(len(prompt), avoid)
        if decode is None:
            return None
        path = self._local_path(len(prompt), decode)
        pull = None
        cached = self._cached_decode(chain, path is not None, avoid)
        if cached is not None:
            (decode, pull), path = cached, "local_cached"
            if pull is not None:
                self.pulls[pull.source.role] += 1
        prefill = decode if path else self._pick_prefill(chain)
        assert prefill is not None
        route = Route(prefill, decode, path or "disaggregated", pull)
        self.decisions[route.path] += 1
        return route

    def _avoided(self, chain: Chains) -> set[str]:
        """`history_routing: spread`: the decode workers holding the longest cached prefix of
        the prompt, which get it only when no other has room. Any prefix counts, a system
        prompt that many share as much as a chat's history (the one it lands on may pull it)."""
        if self.pulling.history == "follow":
            return set()
        cached = {w.worker_id: chain.cached(w) for w in self.serving("decode")}
        longest = max(cached.values(), default=0)
        return {worker_id for worker_id, n in cached.items() if n == longest > 0}

    def _cached_decode(self, chain: Chains, local: bool, avoid: set[str]
                       ) -> tuple[WorkerInfo, PullPlan | None] | None:
        """The decode worker that should prefill the prompt from a cached prefix, its own or
        one it pulls, with that pull; None when none holds or can pull any, or (unless the
        prompt is to be prefilled on a decode worker anyway, `local`) a prefill worker would
        get through it as soon (a tie keeps decode's streams free of the prompt). A decode
        worker's work: the prompt tokens it has queued to prefill, plus this prompt's rest
        beyond the prefix, plus the pull's cost in tokens; a prefill worker's: as
        `pick_prefill` counts it, per slot (its KV's transfer to decode, not counted, only adds
        to that path). Only workers with room for the sequence, and of those, the ones not to
        `avoid` if any."""
        if chain.nowhere:
            return None
        serving = [w for w in self.serving("decode")
                   if not w.unreachable and self._room_for(len(chain.prompt))(w)]
        serving = [w for w in serving if w.worker_id not in avoid] or serving
        source = self._pull_source(chain)
        best: tuple[tuple[float, int, int, str], WorkerInfo, PullPlan | None] | None = None
        for worker in serving:
            pull = self._pull(source, worker, chain)
            cached = pull.tokens if pull is not None else chain.cached(worker)
            if not cached:
                continue
            queued = worker.load.queued_tokens if worker.load is not None else 0
            work = queued + len(chain.prompt) - cached + (pull.cost_tokens if pull else 0)
            rank = (work, -chain.cached(worker), len(worker.active), worker.worker_id)
            if best is None or rank < best[0]:
                best = rank, worker, pull
        if best is None:
            return None
        prefill = None if local else self._best_prefill(chain)
        return None if prefill is not None and best[0][0] >= prefill[1] else (best[1], best[2])

    def _pull_source(self, chain: Chains) -> WorkerInfo | None:
        """The serving worker, of either pool, that caches the most of the prompt."""
        if self.pulling.mode == "never":
            return None
        holders = [w for w in self.registry.workers.values()
                   if not w.stalled and not w.draining and chain.cached(w)]
        return max(holders, key=lambda w: (chain.cached(w), -len(w.active)), default=None)

    def _pull(self, source: WorkerInfo | None, target: WorkerInfo, chain: Chains
              ) -> PullPlan | None:
        """What `target` would pull of `source`'s cached prefix: None when it holds nearly as
        much itself, or pulling it would take longer than computing what it lacks (pulling:
        the bytes at the source's send rate, or the target's pulls' mean time if longer)."""
        if source is None or source is target:
            return None
        tokens = chain.cached(source) // source.block_size * source.block_size  # whole blocks
        missing = tokens - chain.cached(target)
        if missing < self.pulling.min_tokens:
            return None
        s_per_token = (target.load.prefill_s_per_token if target.load is not None else 0.0) \
            or _UNMEASURED_S_PER_TOKEN
        seconds = max(tokens * source.kv_bytes_per_token / self._send_rate(source),
                      _pull_latency(target))
        if seconds >= missing * s_per_token and self.pulling.mode == "auto":
            return None
        return PullPlan(source, tokens, seconds / s_per_token)

    def _send_rate(self, worker: WorkerInfo) -> float:
        """Bytes per second the worker's KV sends have taken, else the assumed rate."""
        sent = [t for t in (worker.load.transfers if worker.load is not None else [])
                if t.direction == "send"]
        nbytes, seconds = sum(t.bytes for t in sent), sum(t.seconds for t in sent)
        if nbytes < _MEASURED_BYTES or seconds <= 0:
            return self.pulling.bytes_per_s
        return nbytes / seconds

    def _local_path(self, prompt_len: int, decode: WorkerInfo) -> RoutePath | None:
        """Why the decode worker should prefill the prompt itself; None when it should not."""
        pool = self.serving("prefill")
        if not pool:
            return "local_no_prefill"
        if prompt_len <= self.local.max_tokens:
            return "local_short"
        saturated = (self.local.saturated_tokens > 0 and
                     prompt_len <= self.local.saturated_max_tokens and
                     all(unit.held_tokens >= self.local.saturated_tokens * unit.slots
                         for unit in self._prefill_units()))
        return "local_saturated" if saturated and _has_headroom(decode) else None

    def pick_decode(self, prompt_len: int = 0, avoid: set[str] | None = None
                    ) -> WorkerInfo | None:
        """The decode worker with the most free KV capacity, then the fewest sequences (one
        found unreachable only if every one was). `pack`: of the workers sharing CPUs, only
        the busiest with room for another sequence of `prompt_len` tokens, as many as the
        CPUs run at once (gateway/packing.py); every worker again when none has room. Workers
        to `avoid` only when there is no other."""
        serving = self.serving("decode")
        if avoid:
            serving = [w for w in serving if w.worker_id not in avoid] or serving
        pool = [w for w in serving if not w.unreachable] or serving
        if self.packing.decode == "pack":
            pool = pack(pool, self._room_for(prompt_len), lambda w: len(w.active)) or pool
        return max(pool, key=_free_then_fewest, default=None)

    def _room_for(self, prompt_len: int) -> Callable[[WorkerInfo], bool]:
        """Whether a packed decode worker has room for one more sequence of `prompt_len`
        tokens: in its batch, and in its KV up to `pack_kv_fraction` of it."""
        fraction = self.packing.kv_fraction

        def takes(decode: WorkerInfo) -> bool:
            batch_full = 0 < decode.max_running <= len(decode.active)
            kv_after = decode.active.tokens + prompt_len
            return not batch_full and kv_after <= decode.num_blocks * decode.block_size * fraction
        return takes

    def _prefill_units(self) -> list[Unit[WorkerInfo]]:
        """The serving prefill workers grouped as `prefill_routing` sees them."""
        pool = self.serving("prefill")
        group = units if self.packing.prefill == "pack" else alone
        return self._remembered("prefill units", lambda: group(pool))


class Chains:
    """A prompt's block hashes for each block size asked for, hashed once; and how much of
    the prompt a worker probably has cached."""

    def __init__(self, prompt: Sequence[int], salt: str) -> None:
        self.prompt = prompt
        self.salt = salt
        self._by_size: dict[int, list[bytes]] = {}
        self._cached: dict[str, int] = {}  # by worker id: routing asks several times
        self.nowhere = False  # no worker holds any of it (`look_for`)

    def of(self, worker: WorkerInfo) -> list[bytes]:
        size = worker.block_size
        if size not in self._by_size:
            self._by_size[size] = block_hashes(self.prompt, size, self.salt)
        return self._by_size[size]

    def look_for(self, workers: Iterable[WorkerInfo]) -> None:
        """Note whether any of `workers` (routing's candidates) has the prompt's first block:
        most prompts are new, and then no worker holds any of them."""
        first: dict[int, bytes] = {}  # by block size
        for worker in workers:
            if worker.prefix_caching:
                if worker.block_size not in first:
                    hashes = self.of(worker)
                    first[worker.block_size] = hashes[0] if hashes else b""  # none: no block
                if first[worker.block_size] in worker.prefixes:
                    self.nowhere = False
                    return
        self.nowhere = True

    def cached(self, worker: WorkerInfo) -> int:
        """Prompt tokens the worker probably has cached: its leading blocks it was sent or
        finished with (never the last token, which must be computed)."""
        if self.nowhere:
            return 0
        if worker.worker_id not in self._cached:
            matched = (worker.prefixes.matched(self.of(worker)) * worker.block_size
                       if worker.prefix_caching else 0)
            self._cached[worker.worker_id] = min(matched, max(len(self.prompt) - 1, 0))
        return self._cached[worker.worker_id]


def _prefill_cost(worker: WorkerInfo, unit: Unit[WorkerInfo], prompt_len: int,
                  cached: int) -> tuple[float, bool, int, int, str]:
    """A prompt's cost on a prefill worker of `unit`, least first: the tokens its CPUs have to
    compute per slot; then, among workers sharing them, whether its KV is full, and the
    busiest first; then the fewest requests; then the id, so that a tie does not depend on
    which worker registered first."""
    if len(unit.workers) == 1:  # alone on its CPUs (or a GPU's): its own queue is the work
        work = float(worker.active.tokens + prompt_len - cached)
        return work, False, 0, len(worker.active), worker.worker_id
    work = (unit.held_tokens + prompt_len - cached) / unit.slots
    full = worker.held_tokens + prompt_len > worker.capacity_tokens
    return work, full, -worker.held_tokens, len(worker.active), worker.worker_id


def _free_then_fewest(decode: WorkerInfo) -> tuple[int, int]:
    """A decode worker's rank: the most free KV, then the fewest sequences."""
    return decode.num_blocks * decode.block_size - decode.active.tokens, -len(decode.active)


def _pull_latency(decode: WorkerInfo) -> float:
    """The mean time a decode worker's pulls took, from asking to holding the whole prefix (its
    holders' loops answer between their steps); 0 before its first."""
    pulls = decode.load.pulls if decode.load is not None else None
    return pulls.seconds / pulls.pulls if pulls is not None and pulls.pulls else 0.0


def _has_headroom(decode: WorkerInfo) -> bool:
    """Room to prefill a prompt among its sequences: no prompt of its own waiting, and at
    least half its KV free."""
    queued = decode.load.queued_tokens if decode.load is not None else 0
    return queued == 0 and decode.held_tokens * 2 <= decode.capacity_tokens
