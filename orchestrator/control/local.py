"""What this replica drives right now: runs, their tasks, and its background tasks.

The one registry the other control modules share, so none of them reaches into another's
attributes: client sessions add drive tasks, failover adds runs (their leases are refreshed
together), ownership adds resumes. `stop_driving` is how anything — a Cancel, a client gone
for good, the deadline reaper — stops a run driven here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from orchestrator import errors
from orchestrator.control.run import Run


class Local:
    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}
        """Requests this replica drives, whose leases `LeaseKeeper` refreshes together."""
        self.tasks: dict[str, asyncio.Task[None]] = {}
        """Drive tasks started for a client's call (so Cancel can stop them)."""
        self.resuming: set[str] = set()
        """Requests taken over from another replica and being resumed here."""
        self.background: set[asyncio.Task[None]] = set()
        """Resumes and detach watchers: named, held, cancelled on shutdown."""
        self.stopping = False
        """Shutting down: runs cancelled now are handed off, not cancelled for good."""

    def busy(self, rid: str) -> bool:
        """Whether this replica already drives (or resumes) ``rid``."""
        return rid in self.tasks or rid in self.resuming

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start a background task, held until it ends (and cancelled by `stop`)."""
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def stop_driving(self, rid: str, why: errors.PdorchError | None = None) -> None:
        """Cancel the run driven here, if any: its task, and the flag its checkpoints read;
        ``why``: the request failed elsewhere (what its clients are told, `Run.stopped`).

        The cancel alone can be lost (see ``orchestrator.aio.cancel_and_wait``: redis-py's
        sends under Python 3.11); cancelling again could interrupt the handler recording the
        end, so the flag ends the run instead, at its next chunk or watch step."""
        run = self.runs.get(rid)
        if run is not None:
            run.cancelled = True
            run.stopped = run.stopped or why
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        """Cancel every run and background task here and wait for them to end."""
        self.stopping = True
        for run in self.runs.values():
            run.cancelled = True  # in case a task's cancel below is lost (see stop_driving)
        tasks = [*self.background, *self.tasks.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
