"""The leak check: after a run's quiet period, every worker holds nothing again. Pure.

Read from the workers' heartbeats (`WorkerInfo`), two snapshots per run: a *baseline* before
the workload starts and the *final* one once every request has ended. A worker whose gauges
do not return is leaking:

- **leaked blocks** — an engine with its own KV block pool (vLLM) has fewer free blocks than
  at the baseline: blocks a killed transfer, a failed load or an aborted request never
  returned to the pool (vLLM counts cached blocks nobody references as free, so a warm
  prefix cache is not a leak). A worker that restarted during the run is compared with its
  new pool's size, all free.
- **KV in use** — ``kv_used_bytes`` above 0: KV held for decoding or received and never
  claimed (the reference engine's exact gauge; vLLM's is its used blocks plus what its
  connector's receiver holds).
- **active** — sequences still decoding.

The runner polls until the check passes or its deadline (a received KV nobody claims is
freed by its hold lease, by design): `LeakReport.settle_s` is how long that took.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.records import WorkerInfo


@dataclass(frozen=True, slots=True)
class Gauges:
    """One worker's KV gauges, as its heartbeat published them."""

    active: int = 0
    kv_used_bytes: int = 0
    kv_blocks: int = 0
    """0: the engine has no block pool of its own."""
    kv_free_blocks: int = 0

    @classmethod
    def of(cls, info: WorkerInfo) -> Gauges:
        return cls(info.active, info.kv_used_bytes, info.kv_blocks, info.kv_free_blocks)


@dataclass(slots=True)
class LeakReport:
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    """Worker -> free blocks below its baseline (only workers that leak)."""
    kv_in_use: dict[str, int] = field(default_factory=dict)
    """Worker -> KV bytes still in use."""
    active: dict[str, int] = field(default_factory=dict)
    """Worker -> sequences still active."""
    workers: int = 0
    """Workers checked."""
    pool_blocks: int = 0
    """Blocks in the block pools checked (0: no worker had one, e.g. the reference engine)."""
    settle_s: float | None = None
    """Seconds after the quiet period until the check passed (None: it never did)."""

    @property
    def clean(self) -> bool:
        return not (self.leaked_blocks or self.kv_in_use or self.active)

    def to_json(self) -> dict[str, Any]:
        return {
            "leaked_blocks": sum(self.leaked_blocks.values()),
            "kv_in_use_bytes": sum(self.kv_in_use.values()),
            "active_after_quiet": sum(self.active.values()),
            "workers_checked": self.workers,
            "pool_blocks_checked": self.pool_blocks,
            "settle_s": self.settle_s,
            "by_worker": {
                "leaked_blocks": dict(sorted(self.leaked_blocks.items())),
                "kv_in_use_bytes": dict(sorted(self.kv_in_use.items())),
                "active": dict(sorted(self.active.items())),
            },
        }


def check_leaks(
    baseline: Mapping[str, Gauges],
    final: Mapping[str, Gauges],
    settle_s: float | None = None,
) -> LeakReport:
    """Compare the ``final`` gauges of the workers alive at the end with their ``baseline``
    (a worker absent from it, or whose pool changed size, restarted: its baseline is its
    whole new pool)."""
    report = LeakReport(
        workers=len(final), pool_blocks=sum(g.kv_blocks for g in final.values()), settle_s=settle_s
    )
    for name, now in sorted(final.items()):
        before = baseline.get(name)
        free_before = (
            before.kv_free_blocks
            if before is not None and before.kv_blocks == now.kv_blocks
            else now.kv_blocks
        )
        if (leaked := free_before - now.kv_free_blocks) > 0:
            report.leaked_blocks[name] = leaked
        if now.kv_used_bytes > 0:
            report.kv_in_use[name] = now.kv_used_bytes
        if now.active > 0:
            report.active[name] = now.active
    return report
