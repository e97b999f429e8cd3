"""Many workers in one process: a simulated fleet for scale tests of the control plane.

Each `Worker` of a fleet is a complete worker — its own gRPC server and port, worker id,
heartbeat, decode loop and (for a decode worker) KV receiver — so the orchestrator cannot
tell it from a worker process. What they share is what a process would not need many of:
the engine (a `SimEngine` keeps no per-worker state; each worker has its own `SimRunner`,
i.e. its own simulated GPU), the heartbeat's Redis connection (the ``publish`` callback)
and, for prefill workers, one KV sender, so that links are pooled per *receiver* across the
fleet instead of per (prefill worker, receiver) pair: 100 × 100 workers would otherwise
open up to 10,000 connections inside one process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from orchestrator.workers.server import Worker, WorkerSettings
from transport.base import DataPlane, TransportSettings
from transport.security import LinkTls
from transport.sender import KvSender

log = logging.getLogger(__name__)


class SharedSender(KvSender):
    """A KV sender several workers use: only the last of its ``users`` to close it closes it
    (each `Worker` closes its sender when it stops)."""

    def __init__(
        self,
        data_plane: DataPlane,
        settings: TransportSettings,
        users: int,
        tls: LinkTls | None = None,
    ) -> None:
        super().__init__(data_plane, settings, tls)
        self._users = users

    async def close(self) -> None:
        self._users -= 1
        if self._users <= 0:
            await super().close()


def member_settings(base: WorkerSettings, index: int, count: int) -> WorkerSettings:
    """Settings of fleet member ``index``: id ``<base id>-<index>``, and port ``base + index``
    when a base port is given (else any free port)."""
    worker_id = base.worker_id or base.role
    return replace(
        base,
        worker_id=f"{worker_id}-{index}" if count > 1 else worker_id,
        port=base.port + index if base.port else 0,
        kv_port=base.kv_port + index if base.kv_port else 0,
    )


class WorkerFleet:
    """Starts and stops workers together (each drains as it would alone)."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)

    async def start(self) -> None:
        """Start every worker; if one fails, stop those that started and raise."""
        results = await asyncio.gather(*(w.start() for w in self.workers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        log.info("fleet of %d workers serving", len(self.workers))

    async def stop(self) -> None:
        """Stop every worker (concurrently: each drains within its own grace)."""
        results = await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        for worker, result in zip(self.workers, results, strict=True):
            if isinstance(result, Exception):
                log.warning("worker %s did not stop cleanly: %s", worker.worker_id, result)
