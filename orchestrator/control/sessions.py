"""Client sessions: the calls clients make, and how their streams outlive nothing they must.

A `generate` call admits the request (`Intake`), books its first placement (`Failover.book`)
and creates its record placed, then starts its drive as a task of its own
and streams what the drive hands it. The drive outlives the call: a client that disconnects
leaves the request running for ``detach_grace_s`` so it can reconnect — to any replica —
and resume from the journal (`follow`); with no client attached by then it is cancelled.
The drive fans its chunks out to the clients attached here (the call that started it); a
resubmission of a known request, and a client whose request a peer took over, follow the
journal. A client may take its chunks in the step that hands them out — the journal's
writer's, once each is written (`generate`'s ``sink``) — no task of its own woken per chunk:
what a call carrying many requests does (`rpc.many`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Collection, Sequence

from orchestrator import errors
from orchestrator.control.failover import Failover
from orchestrator.control.intake import Intake
from orchestrator.control.ledger import Booking
from orchestrator.control.local import Local
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.idents import check_request_id
from orchestrator.core.records import RequestRecord, WorkerInfo
from orchestrator.core.spec import GenerateInput
from orchestrator.core.state import Edge, State
from orchestrator.store.base import Store

log = logging.getLogger(__name__)

Feed = asyncio.Queue[OutChunk | BaseException | None]
"""One attached client's stream: chunks, then None (done) or the error that ended it."""
Sink = Callable[[OutChunk], None]
"""Takes an attached client's chunks, all but the last, as they are handed out (in the
journal writer's step: it must not block, and what it keeps is its own to bound)."""
DETACH_POLL_S = 0.5
"""How often a detached request checks whether a client came back (capped by the grace)."""
CANCEL_TRIES = 5
"""A Cancel's tries at the request's current epoch (each refused one re-reads it)."""


def _wanted(chunk: OutChunk, resume_from: int) -> bool:
    """Whether a client that has the first ``resume_from`` tokens is owed ``chunk``."""
    return (
        chunk.index + len(chunk.token_ids) > resume_from
        or bool(chunk.finish_reason)
        or bool(chunk.text and not chunk.token_ids and chunk.index >= resume_from)  # held text
        or bool(chunk.prompt_logprobs and not resume_from)
    )


class _Sunk(asyncio.Queue[OutChunk | BaseException | None]):
    """A client fed by its `Sink`: the request's chunks go there as they are handed out; the
    last one, errors and the end queue as for any client. A sink that fails (a bug) ends
    its client with an internal error, never the request's drive or the journal's writer."""

    def __init__(self, rid: str, sink: Sink, resume_from: int) -> None:
        super().__init__()
        self._rid = rid
        self._sink: Sink | None = sink
        self._resume_from = resume_from
        self.have = 0
        """Tokens handed to the sink (its client has them)."""

    def put_nowait(self, item: OutChunk | BaseException | None) -> None:
        if self._sink is None or not isinstance(item, OutChunk) or item.finish_reason:
            super().put_nowait(item)
        elif _wanted(item, self._resume_from):
            try:
                self._sink(item)
            except Exception:
                log.exception("request %s: a client's sink failed", self._rid)
                self._sink = None
                super().put_nowait(errors.UnavailableError("internal error"))
            else:
                self.have = item.index + len(item.token_ids)


class Sessions:
    def __init__(
        self,
        store: Store,
        settings: ControlSettings,
        intake: Intake,
        failover: Failover,
        local: Local,
        metrics: ControlMetrics | None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.intake = intake
        self.failover = failover
        self.local = local
        self.metrics = metrics
        self._inflight = 0
        """Calls in `generate` now (client streams on this replica)."""

    async def generate(
        self, inp: GenerateInput, sink: Sink | None = None
    ) -> AsyncGenerator[OutChunk, None]:
        """Serve one call. ``max_inflight`` bounds the calls in progress from the first
        await on, so a burst is refused at the door (`OverloadedError`, a retry-after)
        instead of queueing inside the replica; a resubmission of a known request is not.
        With ``sink``, the chunks handed out go there (but the last), the rest is yielded
        (the last chunk; a follower's chunks, read from the journal)."""
        limit = self.settings.admission.max_inflight
        if limit and self._inflight >= limit and not await self.intake.known(inp.request_id):
            exc = errors.OverloadedError(
                f"this orchestrator serves {self._inflight} calls (limit {limit})", 1.0
            )
            self.intake.rejected(exc)
            raise exc
        self._inflight += 1
        try:
            async for chunk in self._generate(inp, sink):
                yield chunk
        finally:
            self._inflight -= 1

    async def _generate(
        self, inp: GenerateInput, sink: Sink | None
    ) -> AsyncGenerator[OutChunk, None]:
        started = time.monotonic()
        admitted = await self.intake.admit(inp, len(self.local.tasks))
        # Placed before its record exists, so the record is created placed (a store call
        # less); the booking goes to the drive, or back to the ledger if none starts.
        booking = self.failover.book(admitted.spec, admitted.workers)
        try:
            record, existing = await self.intake.create(admitted.spec, booking)
        except BaseException:
            self.failover.unbook(booking)
            raise
        rid = record.request_id
        if existing is not None:
            self.failover.unbook(booking)
            async for chunk in self.follow(rid, inp.resume_from):
                yield chunk
            return
        run = Run(admitted.spec, record.epoch, started)
        if admitted.ttft_estimate_s is not None:
            run.timings["ttft_estimate_ms"] = admitted.ttft_estimate_s * 1000
        feed: Feed = asyncio.Queue() if sink is None else _Sunk(rid, sink, inp.resume_from)
        clients = {feed}  # the clients attached here; the drive fans its chunks out to them
        # The drive is its own task: a client that disconnects does not stop it, so the
        # client can reconnect (to any replica) and resume; see `_detached`.
        task = asyncio.create_task(
            self._drive_detached(run, admitted.workers, clients, booking),
            name=f"pdorch-drive-{rid}",
        )
        self.local.tasks[rid] = task  # so Cancel can stop it
        task.add_done_callback(lambda t: self._cancelled_unstarted(t, run, clients, booking))
        have = 0  # tokens this client has been given
        try:
            while (item := await feed.get()) is not None:
                if isinstance(item, errors.LeaseLostError):
                    # Another replica took the request over: keep this client's stream going
                    # from the journal the new owner writes, after what the client has (and
                    # nothing more from this drive: a write landing late is in the journal).
                    clients.discard(feed)
                    have = max(have, feed.have if isinstance(feed, _Sunk) else 0)
                    async for chunk in self.follow(rid, max(have, inp.resume_from)):
                        yield chunk
                    return
                if isinstance(item, BaseException):
                    raise item
                if _wanted(item, inp.resume_from):
                    have = item.index + len(item.token_ids)
                    yield item
                if item.finish_reason:
                    return  # the last chunk (a cancelled drive delivers nothing after it)
        finally:
            clients.discard(feed)
            if not task.done() and not clients:
                self._detached(run, task, clients)

    async def _drive_detached(
        self,
        run: Run,
        workers: Sequence[WorkerInfo],
        clients: set[Feed],
        booking: Booking | None,
    ) -> None:
        """Drive the request to its end, handing chunks (and the end) to attached clients
        (``booking``: its first placement, which the drive releases)."""

        def deliver(item: OutChunk | BaseException | None) -> None:
            for client in list(clients):
                client.put_nowait(item)  # bounded: at most one chunk per output token

        run.deliver = deliver  # the chunks, from the journal's writer once written
        try:
            async for chunk in self.failover.drive(run, workers, booking):
                deliver(chunk)
        except asyncio.CancelledError:
            if self.local.stopping:  # handed off: the client resumes on another replica
                deliver(errors.UnavailableError("orchestrator shutting down; resume elsewhere"))
            elif run.stopped is not None:  # failed by the reaper, not cancelled by a client
                deliver(run.stopped)
            else:
                deliver(OutChunk(run.rid, run.sent, [], "", "cancelled", run.timings))
            raise
        except errors.PdorchError as exc:
            deliver(exc)  # the client sees it; the record already says how the request ended
        except Exception:  # a bug: its text (maybe a store's or a peer's words) is logged only
            log.exception("request %s: drive failed", run.rid)
            deliver(errors.UnavailableError(f"request {run.rid} failed: internal error"))
        else:
            deliver(None)
        finally:
            self.local.tasks.pop(run.rid, None)

    def _cancelled_unstarted(
        self, task: asyncio.Task[None], run: Run, clients: set[Feed], booking: Booking | None
    ) -> None:
        """A drive cancelled before its first step never ran a line of `_drive_detached`
        (a Cancel landing between the record's creation and the task's start): give its
        placement back and tell its clients it ended cancelled, or they would wait for
        chunks that never come."""
        if run.rid not in self.local.tasks or self.local.tasks[run.rid] is not task:
            return  # it ran: `_drive_detached` delivered the end and unregistered itself
        del self.local.tasks[run.rid]
        self.failover.unbook(booking)
        if not task.cancelled():
            return
        end: OutChunk | BaseException = OutChunk(run.rid, 0, [], "", "cancelled", run.timings)
        if run.stopped is not None:
            end = run.stopped
        if self.local.stopping:  # shutting down: the record's lease lapses, a peer takes over
            end = errors.UnavailableError("orchestrator shutting down; resume elsewhere")
        log.info("request %s: stopped before it started", run.rid)
        for client in list(clients):
            client.put_nowait(end)

    def _detached(self, run: Run, task: asyncio.Task[None], clients: set[Feed]) -> None:
        """The last local client left: give it ``detach_grace_s`` to come back (here, or on
        another replica — followers mark the request attached in the store), else cancel."""

        async def watch() -> None:
            grace = self.settings.detach_grace_s
            deadline = time.monotonic() + grace
            while not task.done():
                await asyncio.sleep(min(DETACH_POLL_S, grace))  # polling with a deadline
                if clients:
                    return  # cannot happen today (resumes follow the journal), but cheap
                try:
                    attached = await self.store.client_attached(run.rid)
                except errors.UnavailableError:
                    attached = True  # can't tell while Redis is away: keep generating
                if attached:
                    deadline = time.monotonic() + grace
                elif time.monotonic() > deadline:
                    log.info("request %s: no client for %.0fs, cancelling", run.rid, grace)
                    self.local.stop_driving(run.rid)
                    return

        self.local.spawn(watch(), f"pdorch-detached-{run.rid}")

    async def follow(self, rid: str, start: int = 0) -> AsyncGenerator[OutChunk, None]:
        """Stream a request this call does not drive, from its journal (resubmit, resume)."""
        entries_seen = 0
        touched = 0.0
        while True:
            if time.monotonic() - touched > self.settings.attach_refresh_s:
                with contextlib.suppress(errors.UnavailableError):
                    await self.store.touch_client(rid, 3 * self.settings.attach_refresh_s)
                touched = time.monotonic()
            record = await self.store.get(rid)
            if record is None:
                raise errors.NotFoundError(f"no request {rid!r}")
            entries = await self.store.journal(rid, entries_seen)
            for e in entries:
                entries_seen += 1
                end = e.index + len(e.token_ids)
                if end <= start and e.token_ids:
                    continue
                if not (e.token_ids or e.text or e.prompt_logprobs):
                    continue  # an end journalled alone (`JournalEntry.finish`): no chunk
                skip = max(0, start - e.index)
                yield OutChunk(
                    rid,
                    max(e.index, start),
                    list(e.token_ids[skip:]),
                    e.text,
                    logprobs=e.logprobs[skip:],
                    prompt_logprobs=e.prompt_logprobs if start == 0 else (),
                    prompt_tokens=record.prompt_tokens,
                )
            if record.state.terminal and not entries:
                if record.state is State.FAILED:
                    raise errors.RequestFailedError(f"request failed: {record.error or '?'}")
                yield OutChunk(
                    rid,
                    record.output_tokens,
                    [],
                    "",
                    record.finish_reason or str(record.state),
                    record.timings,
                    record,
                )
                return
            if not entries:
                await asyncio.sleep(self.settings.follow_poll_s)

    async def cancel(self, rid: str, tenants: Collection[str] | None = None) -> State:
        """Cancel ``rid``; with ``tenants``, only a request of one of them (else NotFound).

        The CANCEL is taken at the epoch just read; a failover or a takeover moving the
        request on between the read and the transition (one round trip) refuses it as
        stale, or as invalid from the state it left: read again and cancel that, up to
        `CANCEL_TRIES` times — a client's cancel is not lost to a race it cannot see."""
        record = await self.get(rid, tenants)  # validates the id
        if record.state.terminal:
            return record.state
        self.local.stop_driving(rid)  # driven here: cancelling it cancels the worker calls too
        epoch, state = record.epoch, record.state
        for _ in range(CANCEL_TRIES):
            try:
                await self.store.transition(
                    rid, Edge.CANCEL, epoch=epoch, fields={"finish_reason": "cancelled"}
                )
            except (errors.StaleEpochError, errors.InvalidTransitionError):
                pass  # moved on meanwhile: what is it now?
            else:
                return State.CANCELLED
            got = await self.store.get(rid)
            if got is None:
                return State.CANCELLED
            if got.state.terminal:
                return got.state
            epoch, state = got.epoch, got.state
        return state

    async def get(self, rid: str, tenants: Collection[str] | None = None) -> RequestRecord:
        """The record of ``rid``; with ``tenants`` (an authenticated caller's), another
        tenant's request answers exactly as an unknown id does: its existence is not told."""
        check_request_id(rid)  # no such id can exist; and an error may not echo a megabyte
        record = await self.store.get(rid)
        if record is None or (tenants is not None and (record.tenant or "default") not in tenants):
            raise errors.NotFoundError(f"no request {rid!r}")
        return record
