"""The journal writer: every relayed chunk is journalled (epoch-checked) before the client
sees it — or, while the store is unreachable, buffered and journalled when it is back.

The journal is what makes a request survive its replica: a follower (a resubmission, a
client resuming on another replica) and a replica taking the request over read it. Two ways
it and its writer disagree are repaired here (`unjournalled_after`): the store lost its last
writes (Redis restarted inside its fsync window), or a write landed whose reply was lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator import errors
from orchestrator.control.run import Run
from orchestrator.core.records import JournalEntry, unjournalled_after
from orchestrator.store.base import Store

log = logging.getLogger(__name__)

SETTLE_FIRST_DELAY_S = 0.05
SETTLE_MAX_DELAY_S = 1.0


class JournalWriter:
    def __init__(self, store: Store, outage_s: float) -> None:
        self.store = store
        self.outage_s = outage_s
        """How long `settle` waits for an unreachable store."""

    async def journal(self, run: Run, entry: JournalEntry) -> None:
        """Journal a chunk before the client sees it — or, while Redis is unreachable, keep it
        to journal later and let the stream go on (the worker does not need Redis)."""
        buf = run.journal
        buf.entries.append(entry)
        buf.unjournalled += 1
        try:
            await self.flush(run)
        except errors.UnavailableError as exc:
            if buf.unjournalled == 1:
                log.warning("request %s: journal unreachable, buffering: %s", run.rid, exc)

    async def flush(self, run: Run) -> None:
        buf = run.journal
        while buf.unjournalled:
            entry = buf.entries[-buf.unjournalled]
            try:
                await self.store.append(run.rid, run.epoch, entry)
            except errors.JournalGapError as gap:
                # Redis came back without its last writes (AOF fsync window), or a write
                # landed whose reply we never saw (cancelled mid-call): resync from the
                # journal's end, writing again only what it lacks.
                pending = unjournalled_after(buf.entries, gap.journal_end)
                if pending is None:
                    raise
                if gap.journal_end < entry.index:
                    log.warning(
                        "request %s: re-journalling %d chunks lost by the store", run.rid, pending
                    )
                buf.unjournalled = pending
                continue
            buf.unjournalled -= 1

    async def settle(self, run: Run) -> None:
        """Before a final transition: wait (bounded) for the store and flush the journal."""
        deadline = time.monotonic() + self.outage_s
        delay = SETTLE_FIRST_DELAY_S
        while True:
            try:
                await self.flush(run)
            except errors.UnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)  # backoff while the store is down
                delay = min(delay * 2, SETTLE_MAX_DELAY_S)
            else:
                return
