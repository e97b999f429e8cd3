"""The live workers as this replica last listed them: for admission, and for the watch on
every call to a worker.

Admission needs the fleet's listing for every request, and every wait on a worker (a
prefill, a decode stream) asks every ``watch_interval_s`` whether that worker's heartbeat
is still there. Asked of the store each time, that is two round trips per request and one
per watched call per interval — under load, more store calls than the token path makes. So
one listing serves them all for ``workers_cache_s``:

* `listing` returns the last listing while it is younger than that, else lists again; calls
  that arrive while a listing is in flight wait for that one (one store call, not one per
  waiter).
* `alive` answers *yes* from a listing that young which holds the worker, and otherwise
  asks the store about that worker alone. So a *no* is always the store's answer of now, and
  a worker's death is noticed at most ``workers_cache_s`` later than without the cache — the
  watch's own interval is longer. A store that cannot answer counts as alive: the store is
  down, not the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator import errors
from orchestrator.core.records import WorkerInfo
from orchestrator.store.base import Store


class WorkerDirectory:
    def __init__(
        self, store: Store, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.max_age_s = max_age_s
        """How long a listing is reused (0: never)."""
        self._clock = clock
        self._listed: tuple[float, list[WorkerInfo], frozenset[str]] | None = None
        """(when, workers, their ids) of the last listing."""
        self._listing: asyncio.Task[list[WorkerInfo]] | None = None
        """The last listing task: the one in flight, which later callers wait for."""

    async def listing(self) -> list[WorkerInfo]:
        """The live workers, as listed at most ``max_age_s`` ago."""
        fresh = self._fresh()
        if fresh is not None:
            return fresh[1]
        if self._listing is None or self._listing.done():
            self._listing = asyncio.create_task(self._list(), name="pdorch-list-workers")
            self._listing.add_done_callback(_retrieved)
        # Shielded: a caller that gives up does not cancel the listing the others wait for.
        return await asyncio.shield(self._listing)

    async def _list(self) -> list[WorkerInfo]:
        workers = await self.store.workers()
        if self.max_age_s > 0:
            self._listed = (self._clock(), workers, frozenset(w.worker_id for w in workers))
        return workers

    async def alive(self, worker: WorkerInfo) -> bool:
        """Whether ``worker``'s heartbeat is there: yes from a young listing that holds
        it; otherwise the store's answer about that worker (yes when it cannot answer)."""
        fresh = self._fresh()
        if fresh is None and self.max_age_s > 0:
            try:
                await self.listing()
            except errors.UnavailableError:
                return True  # the store is down, not the worker: keep going
            fresh = self._fresh()
        if fresh is not None and worker.worker_id in fresh[2]:
            return True
        try:
            return await self.store.worker_alive(worker.worker_id)
        except errors.UnavailableError:
            return True

    def _fresh(self) -> tuple[float, list[WorkerInfo], frozenset[str]] | None:
        listed = self._listed
        if listed is None or self._clock() - listed[0] >= self.max_age_s:
            return None
        return listed


def _retrieved(task: asyncio.Task[list[WorkerInfo]]) -> None:
    """A listing whose callers all gave up leaves no "exception never retrieved"."""
    if not task.cancelled():
        task.exception()
