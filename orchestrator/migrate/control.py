"""The proxy's live control: mode and share (kept in step with Redis), each path's window,
the rollback, and the background writer of samples.

Samples go to Redis from one named task through a bounded queue, so a slow or missing Redis
never delays an answer: when the queue is full a sample is dropped (logged, counted). The
rollback is decided here, in memory, on the sample that breaks the limits — the share drops
to 0 at once for the next request — and then written with `MigrationState.rollback`. While
that write is pending, the periodic refresh from Redis does not bring the old share back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from orchestrator import errors
from orchestrator.core.idents import shown
from orchestrator.migrate.policy import Sample, Window, WindowStats, breach
from orchestrator.migrate.settings import MigrationSettings
from orchestrator.migrate.state import MigrationState

log = logging.getLogger(__name__)

QUEUE_SIZE = 10_000
BATCH = 200


class Control:
    def __init__(self, settings: MigrationSettings, state: MigrationState) -> None:
        self.settings = settings
        self.state = state
        self.mode = settings.mode
        self.percent = settings.percent if settings.mode == "canary" else 0.0
        self.sample_share = settings.sample if settings.mode == "shadow" else 0.0
        self.windows = {path: Window(settings.limits.window) for path in ("existing", "pdorch")}
        self.rollbacks = 0
        self.dropped = 0
        self._skipped = 0
        self._queue: asyncio.Queue[Sample] = asyncio.Queue(QUEUE_SIZE)
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.state.start(self.settings)
        name = self.settings.name
        self._tasks = [
            asyncio.create_task(self._writer(), name=f"pdorch-migrate-{name}-writer"),
            asyncio.create_task(self._refresher(), name=f"pdorch-migrate-{name}-refresh"),
        ]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Finish pending rollbacks, flush what is queued (within ``grace_s``), stop."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=grace_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._queue.join()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    # ---------------------------------------------------------------------- samples

    def skipped_shadow(self) -> None:
        self._skipped += 1

    def observe(self, sample: Sample) -> None:
        """Count one answer: its window, the rollback rule, and the queue to Redis."""
        stats = self.windows[sample.path].add(sample)
        if (
            self.mode == "canary"
            and sample.path == "pdorch"
            and sample.role == "answer"
            and self.percent > 0
        ):
            reason = breach(stats, self.settings.limits)
            if reason is not None:
                self._roll_back(reason, stats)
        try:
            self._queue.put_nowait(sample)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning(
                "sample of request %s dropped: the Redis queue is full", shown(sample.request_id)
            )

    def _roll_back(self, reason: str, stats: WindowStats) -> None:
        before, self.percent = self.percent, 0.0
        self.rollbacks += 1
        self.windows["pdorch"].clear()
        log.warning(
            "migration %s: rolled back from %.1f%% to 0%%: %s",
            self.settings.name, before, reason,
        )  # fmt: skip
        task = asyncio.create_task(
            self._write_rollback(reason, before, stats),
            name=f"pdorch-migrate-{self.settings.name}-rollback",
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write_rollback(self, reason: str, before: float, stats: WindowStats) -> None:
        for attempt in range(10):
            try:
                await self.state.rollback(reason, before, stats)
            except errors.UnavailableError as exc:
                log.warning("rollback not recorded yet (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.5 * (attempt + 1))  # backoff while Redis is away
            else:
                return
        log.error("migration %s: rollback never recorded in Redis", self.settings.name)

    # ---------------------------------------------------------------------- tasks

    async def _writer(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            skipped, self._skipped = self._skipped, 0
            windows = {path: w.stats() for path, w in self.windows.items()}
            try:
                await self.state.record(batch, windows, self.settings.max_samples, skipped)
            except errors.UnavailableError as exc:
                self.dropped += len(batch)
                log.warning("%d samples not recorded: %s", len(batch), exc)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)  # periodic re-read, by design
            if self._pending:
                continue  # a rollback is being written: Redis still has the old share
            try:
                mode, percent, sample = await self.state.current()
            except errors.PdorchError as exc:
                log.warning(
                    "migration %s: could not re-read its state: %s", self.settings.name, exc
                )
                continue
            if percent != self.percent:
                log.info(
                    "migration %s: share %.1f%% -> %.1f%% (from Redis)",
                    self.settings.name, self.percent, percent,
                )  # fmt: skip
                if self.percent == 0:
                    self.windows["pdorch"].clear()  # re-armed: judge it afresh
            self.mode, self.percent, self.sample_share = mode, percent, sample
