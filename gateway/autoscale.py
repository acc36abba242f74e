"""How many workers each pool wants, from what the gateway sees now, with no offline profile:
`raging_pool_desired_workers{role}`, which an autoscaler (Kubernetes' HPA on the external
metric, launch.sh --autoscale) makes each pool's size.

The rule (docs/scaling.md, "Autoscaling"), each time it is asked:
- prefill: enough workers that none has more than `prefill_queue_tokens` prompt tokens
  waiting; one more than serve now while the recent TTFT is over its SLO;
- decode: enough workers that none uses more than `decode_kv_fraction` of its KV blocks or
  fills more than `decode_batch_fraction` of its batch; one more than serve now while the
  recent TPOT is over its SLO;
- each pool at least one worker (prefill: where it has any, or expects any);
- a pool grows at once, and shrinks by one worker only after it has wanted fewer for
  `scale_down_s` without missing its SLO (so a lull between bursts does not shed capacity);
  the wish to shrink stays until the pool has shrunk, and the next waits `scale_down_s` again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from core.config import AutoscaleConfig, Role
from gateway.recent import RecentLatency
from gateway.registry import Registry, WorkerInfo

RECENT_S = 60.0  # the latency an SLO is checked against: the last minute's mean


class Autoscaler:
    def __init__(self, config: AutoscaleConfig, registry: Registry, recent: RecentLatency,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.registry = registry
        self.recent = recent
        self.clock = clock
        self.fewer_since: dict[Role, float | None] = {"prefill": None, "decode": None}
        # A step down, once decided, until the pool has made it: every reader of the metric
        # (Prometheus, launch.sh --autoscale) sees the same wish, however often it asks.
        self.shrink_to: dict[Role, int | None] = {"prefill": None, "decode": None}

    def desired(self, role: Role) -> int:
        """The workers `role`'s pool wants now."""
        serving = len(self.registry.serving(role))
        load, missed = (self._prefill() if role == "prefill" else self._decode())
        wanted = max(load, serving + 1 if missed else 0, self._floor(role, serving))
        if wanted >= serving or missed:
            self.fewer_since[role] = self.shrink_to[role] = None
            return wanted
        shrink_to = self.shrink_to[role]
        if shrink_to is not None:
            if serving > shrink_to:
                return shrink_to
            self.shrink_to[role] = None
            self.fewer_since[role] = self.clock()  # made: the next step waits from now
        since = self.fewer_since[role]
        if since is None:
            self.fewer_since[role] = since = self.clock()
        if self.clock() - since < self.config.scale_down_s:
            return serving
        self.shrink_to[role] = serving - 1
        return serving - 1

    def _prefill(self) -> tuple[int, bool]:
        """(workers the queued prompts need, whether TTFT misses its SLO)."""
        queued = self.registry.queued_prompt_tokens()
        return (math.ceil(queued / self.config.prefill_queue_tokens),
                self._missed("ttft", self.config.ttft_slo_ms))

    def _decode(self) -> tuple[int, bool]:
        """(workers the running sequences' KV and batches need, whether TPOT misses its SLO)."""
        pool = self.registry.alive("decode")
        used = sum(_blocks_used(w) for w in pool)
        sequences = sum(len(w.active) for w in pool)
        blocks = max((w.num_blocks for w in pool), default=0)
        batch = max((w.max_running for w in pool), default=0)
        by_kv = math.ceil(used / (blocks * self.config.decode_kv_fraction)) if blocks else 0
        by_batch = (math.ceil(sequences / (batch * self.config.decode_batch_fraction))
                    if batch else 0)
        return max(by_kv, by_batch), self._missed("tpot", self.config.tpot_slo_ms)

    def _missed(self, series: str, slo_ms: float) -> bool:
        mean = self.recent.mean_s(series, RECENT_S)
        return mean is not None and mean * 1000 > slo_ms

    def _floor(self, role: Role, serving: int) -> int:
        if role == "decode":
            return 1
        return 1 if serving or self.registry.expected["prefill"] else 0


def _blocks_used(worker: WorkerInfo) -> int:
    return 0 if worker.load is None else worker.num_blocks - worker.load.free_blocks
