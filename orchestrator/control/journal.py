"""The journal writer: every relayed chunk is journalled (epoch-checked) before the client
sees it — or, while the store is unreachable, buffered and journalled when it is back.

The journal is what makes a request survive its replica: a follower (a resubmission, a
client resuming on another replica) and a replica taking the request over read it. Two ways
it and its writer disagree are repaired here (`unjournalled_after`): the store lost its last
writes (Redis restarted inside its fsync window), or a write landed whose reply was lost.

**Group commit.** One writer task per replica (``pdorch-journal-writer``, started on demand,
ending when idle) writes for every request: a run that has chunks to journal queues itself
and waits; the writer takes everything queued, writes it in one `Store.append_many` round
trip (one script call per chunk, each on its own request's keys), tells each run how its
writes went, and starts again with whatever queued meanwhile. So while one round trip is
in flight the next batch gathers: under load one write carries the chunks of every stream,
and an idle replica pays no wait. Under load a round trip is short next to the time between
a stream's chunks, so batches stay small and the write — a store call whatever it carries —
costs per chunk again: so a write that follows the previous one within ``gather_s`` waits
until ``gather_s`` after it, gathering meanwhile. That bounds the writes to one per
``gather_s`` and delays a chunk at most that long, and only when the replica is busy (an
idle replica's first write goes at once). **A request's first chunk never waits for the
gather**: it is its client's time to first token, not a stream's pace, so a run whose
first chunk queues (`journal`'s ``first``) cuts the wait short and the batch gathered so
far goes at once — writes are then bounded by one per ``gather_s`` plus one per request
started. Every write of a run goes through the writer, in order,
so a run's buffer (`JournalBuffer`) has one writer. A refusal (stale epoch, request ended,
a gap that cannot be resynced) is that run's alone; an unreachable store fails the batch's
runs, whose chunks stay unjournalled (never counted as written) until a later write.

**The writer hands the chunks out.** The relay does not wait for a chunk's write: it
`submit`s the chunk with its client's copy and goes on reading the worker; when the write
lands, the writer hands the client's chunk to the run's clients itself (`JournalBuffer.hand`,
in the write's step), in order — so a relayed chunk wakes the request's drive once, not
twice. A refused write hands nothing out and leaves its refusal for the relay to raise at
its next chunk (`refusal`) or its end (`flush`); a write the store could not take hands
its chunks out unjournalled, as `journal` lets them go on (the outage's buffering), but for
the replica stopping: a chunk that may never be journalled is never handed to a client.
"""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator import errors
from orchestrator.control.run import JournalBuffer, OutChunk, Run
from orchestrator.core.records import JournalEntry, unjournalled_after
from orchestrator.core.state import Edge
from orchestrator.store.base import Store

log = logging.getLogger(__name__)

SETTLE_FIRST_DELAY_S = 0.05
SETTLE_MAX_DELAY_S = 1.0
MAX_RESYNCS = 8
"""Gap resyncs in a row (without a write landing) before a run's write fails: the journal's
end keeps moving under it, which only another writer can cause."""

_Waiting = tuple[Run, "asyncio.Future[None]"]


class JournalWriter:
    def __init__(self, store: Store, outage_s: float, gather_s: float = 0.0) -> None:
        self.store = store
        self.outage_s = outage_s
        """How long `settle` waits for an unreachable store."""
        self.gather_s = gather_s
        """Least time between the starts of two writes (0: write whenever one is due)."""
        self._last_write = -float("inf")
        """When the last write started (the loop's clock)."""
        self._queued: dict[int, _Waiting] = {}
        """Runs waiting for the next batch, by ``id(run)``: one future each."""
        self._first = False
        """A first chunk is queued: the next write goes without gathering."""
        self._gathering: asyncio.Future[None] | None = None
        """The writer's wait for the gather (resolved early by a first chunk)."""
        self._resyncs: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def journal(self, run: Run, entry: JournalEntry, *, first: bool = False) -> None:
        """Journal a chunk and wait for it — or, while Redis is unreachable, keep it to
        journal later and let the stream go on (the worker does not need Redis).
        ``first``: the chunk is the request's first token (its client waits on it): it is
        written without waiting for the gather (module docstring)."""
        self.submit(run, entry, first=first)
        try:
            await self.flush(run)
        except errors.UnavailableError as exc:
            self._buffering(run, exc)

    def submit(
        self,
        run: Run,
        entry: JournalEntry,
        handed: OutChunk | None = None,
        *,
        first: bool = False,
    ) -> None:
        """Queue a chunk for the next write, without waiting for it; ``handed``: its
        clients' chunk, handed out when the write lands (module docstring)."""
        buf = run.journal
        buf.entries.append(entry)
        buf.unjournalled += 1
        if handed is not None:
            buf.handing.append(handed)
        if first:
            self._hurry()
        if id(run) not in self._queued:
            self._queued[id(run)] = (run, asyncio.get_running_loop().create_future())
        self._start()

    @staticmethod
    def refusal(run: Run) -> errors.PdorchError | None:
        """The refusal of one of the run's writes not raised yet (taken: raised once)."""
        refused, run.journal.refused = run.journal.refused, None
        return refused

    @staticmethod
    def _buffering(run: Run, exc: errors.UnavailableError) -> None:
        if run.journal.unjournalled == 1:
            log.warning("request %s: journal unreachable, buffering: %s", run.rid, exc)

    async def flush(self, run: Run) -> None:
        """Write the run's unjournalled chunks (with the next batch); raises what refused
        them: `UnavailableError`, `StaleEpochError`, `RequestEndedError`, `JournalGapError`."""
        if not run.journal.unjournalled:
            return
        waiting = self._queued.get(id(run))
        if waiting is None or waiting[1].done():
            # (done: cancelled under a run that stopped waiting — its chunks stay queued.)
            waiting = self._queued[id(run)] = (run, asyncio.get_running_loop().create_future())
        self._start()
        # Not shielded (a shield costs a future and a callback per chunk): a run cancelled
        # while waiting cancels its own future, which the writer skips (`_fail`, `_write`
        # answer only futures not done); its chunks are still written, and the run's next
        # write waits on a new future (above) and resyncs if need be.
        try:
            await waiting[1]
        except errors.PdorchError as exc:
            if run.journal.refused is exc:
                run.journal.refused = None  # raised here: not again at the next chunk
            raise

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_loop(), name="pdorch-journal-writer")

    def _hurry(self) -> None:
        """The next write goes without gathering; one gathering now goes at once."""
        self._first = True
        if self._gathering is not None and not self._gathering.done():
            self._gathering.set_result(None)

    async def _gather(self, wait: float) -> None:
        """Wait ``wait`` seconds, or less if a first chunk queues meanwhile (`_hurry`)."""
        loop = asyncio.get_running_loop()
        self._gathering = gathering = loop.create_future()
        timer = loop.call_later(wait, _resolve, gathering)
        try:
            await gathering
        finally:
            timer.cancel()
            self._gathering = None

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

    async def close(self) -> None:
        """Stop the writer (shutdown); runs still waiting are told the store is gone."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        stopping = errors.UnavailableError("orchestrator stopping")
        self._fail(list(self._queued.values()), stopping, hand=False)
        self._queued.clear()

    # ---------------------------------------------------------------------- the writer

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queued:
            wait = self._last_write + self.gather_s - loop.time()
            if wait > 0 and not self._first:
                await self._gather(wait)  # busy: let the batch gather (module docstring)
            self._first = False
            self._last_write = loop.time()
            batch = list(self._queued.values())
            self._queued = {}
            try:
                await self._write(batch)
            except Exception as exc:  # noqa: BLE001 - an outage, or a bug: each run raises it
                self._fail(batch, exc)
            except asyncio.CancelledError:  # shutdown: no run waits forever
                stopping = errors.UnavailableError("orchestrator stopping")
                self._fail(batch, stopping, hand=False)
                raise

    async def _write(self, batch: list[_Waiting]) -> None:
        items: list[tuple[str, int, JournalEntry]] = []
        edges: dict[int, Edge] = {}
        spans: list[tuple[Run, asyncio.Future[None], int]] = []
        for run, done in batch:
            buf = run.journal
            pending = buf.entries[len(buf.entries) - buf.unjournalled :]
            if buf.adopt is not None and pending:
                edges[len(items)] = buf.adopt  # taken with the run's first chunk here
            items += [(run.rid, run.epoch, e) for e in pending]
            spans.append((run, done, len(pending)))
        results = await self.store.append_many(items, edges=edges) if items else []
        at = 0
        for run, done, n in spans:
            if n and run.journal.adopt is not None and not isinstance(results[at], Exception):
                run.journal.adopt = None  # its write landed, and the edge with it
            again, refusal = self._settled(run, results[at : at + n])
            at += n
            _hand_written(run)
            if again:
                self._queued.setdefault(id(run), (run, done))
                continue
            self._resyncs.pop(id(run), None)
            if refusal is not None:
                self._fail([(run, done)], refusal)
            elif not done.done():
                done.set_result(None)

    def _settled(
        self, run: Run, results: list[int | errors.PdorchError]
    ) -> tuple[bool, errors.PdorchError | None]:
        """Apply one run's results to its buffer: (True, None) when a gap was resynced and
        it must write again; else (False, the refusal or None when all went in)."""
        buf: JournalBuffer = run.journal
        first = len(buf.entries) - buf.unjournalled
        for k, result in enumerate(results):
            if not isinstance(result, errors.PdorchError):
                buf.unjournalled -= 1
                self._resyncs.pop(id(run), None)
                continue
            if not isinstance(result, errors.JournalGapError):
                return False, result
            # Redis came back without its last writes (AOF fsync window), or a write
            # landed whose reply we never saw (cancelled mid-call): resync from the
            # journal's end, writing again only what it lacks.
            pending = unjournalled_after(buf.entries, result.journal_end)
            tries = self._resyncs.get(id(run), 0) + 1
            if pending is None or tries > MAX_RESYNCS:
                return False, result
            self._resyncs[id(run)] = tries
            if result.journal_end < buf.entries[first + k].index:
                log.warning(
                    "request %s: re-journalling %d chunks lost by the store", run.rid, pending
                )
            buf.unjournalled = pending
            return pending > 0, None
        return False, None

    @classmethod
    def _fail(cls, batch: list[_Waiting], exc: BaseException, *, hand: bool = True) -> None:
        """The batch's writes failed with ``exc``: an outage hands their chunks out
        unjournalled (but when ``hand`` is off: the replica stopping); a refusal, or a bug,
        is left for the run's relay to raise."""
        for run, done in batch:
            if isinstance(exc, errors.UnavailableError):
                if hand and run.journal.handing:
                    cls._buffering(run, exc)
                    _hand_all(run)
            elif isinstance(exc, errors.PdorchError):
                run.journal.refused = exc
            else:  # a bug: the run fails over (or fails), the trace is logged
                log.error("request %s: journal write failed", run.rid, exc_info=exc)
                run.journal.refused = errors.UnavailableError(f"journal write failed: {exc!r}")
            if not done.done():
                done.set_exception(exc)
                done.exception()  # retrieved: a run that stopped waiting leaves no warning


def _hand_written(run: Run) -> None:
    """Hand out the clients' chunks whose entries are written now (the oldest ones)."""
    buf = run.journal
    for _ in range(len(buf.handing) - buf.unjournalled):
        buf.hand(buf.handing.popleft())


def _hand_all(run: Run) -> None:
    buf = run.journal
    while buf.handing:
        buf.hand(buf.handing.popleft())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
