"""Leases on the requests this replica drives, refreshed together.

A replica owns a request while it holds the request's lease (TTL ``lease_ttl_s`` in the
store). One task refreshes every lease this replica holds in one round trip per third of
the TTL. A lease found lost (this replica stalled and a peer took the request over, epoch
+ 1) marks its run ``lease_lost``: the driver stops at its next checkpoint and its clients
follow the journal the new owner writes.
"""

from __future__ import annotations

import asyncio
import logging

from orchestrator import errors
from orchestrator.aio import cancel_and_wait
from orchestrator.control.local import Local
from orchestrator.control.run import Run
from orchestrator.store.base import Store

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, store: Store, local: Local, owner: str) -> None:
        self.store = store
        self.local = local
        self.owner = owner
        self._task: asyncio.Task[None] | None = None

    def hold(self, run: Run) -> None:
        """Keep ``run``'s lease from now on (the refresher starts with the first run)."""
        self.local.runs[run.rid] = run
        if self._task is None:
            self._task = asyncio.create_task(self._keep(), name="pdorch-leases")

    def drop(self, run: Run) -> None:
        if self.local.runs.get(run.rid) is run:
            del self.local.runs[run.rid]

    async def hand_off(self, run: Run) -> None:
        """Shutting down: give ``run``'s lease back, so a peer takes it over at once."""
        run.lease_lost = True  # the refresher must not retake it meanwhile
        try:
            await self.store.release_lease(run.rid, self.owner)
        except errors.PdorchError as exc:
            log.warning("request %s: lease not released: %s", run.rid, exc)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _keep(self) -> None:
        """Refresh this replica's lease on every request it drives, all in one round trip
        per interval. A request whose lease is lost (this replica stalled and another took
        over) is told to stop: the new owner continues it."""
        interval = self.store.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            runs = [r for r in self.local.runs.values() if not r.lease_lost]
            try:
                held = await self.store.refresh_leases(
                    [(r.rid, r.epoch) for r in runs], self.owner, retake=not self.local.stopping
                )
            except errors.UnavailableError:
                continue  # the store is down: keep generating, journal writes will tell
            except Exception:
                log.exception("lease refresh failed")  # one bad round must not stop them all
                continue
            for run, ok in zip(runs, held, strict=True):
                if not ok and self.local.runs.get(run.rid) is run:
                    log.warning("request %s: lease lost to another replica; stopping", run.rid)
                    run.lease_lost = True  # the driver notices within a watch interval
