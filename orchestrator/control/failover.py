"""Failover: the drive loop that runs a request to its end across worker failures.

What happens when a worker dies mid-request:

1. Its leg fails: the call errors (translated to `WorkerError`, phased ``prefill``,
   ``decode`` or ``generate``), its heartbeat disappears (``heartbeat``), its stream goes
   silent (``silence``) or misbehaves (``stream``) — see `orchestrator.control.legs`.
2. `_attempt` records the failure: the worker is excluded from this request's next
   placements, its breaker opens (placement skips it for everyone for a while), and
   ``pdorch_failovers_total{cause=<phase>}`` counts it.
3. `RETRY` decides by the error's type and phase whether another attempt may succeed. A
   store outage is not an attempt's failure: its store calls wait it out (up to
   ``StoreSettings.outage_s``, `orchestrator.store.outage`), and fail the request after.
4. `_reassign` fences the failed attempt off: ``requeue`` (epoch + 1) — the store, the
   decode worker's KV inbox and the journal refuse the old epoch, so a zombie's late KV or
   tokens are never used.
5. The next attempt places the request again and re-prefills prompt + the tokens already
   relayed; decoding continues at the next index, so the client sees contiguous indices.

A request's first attempt may come placed (`book`, before the record was created: the
record is created with its placement edge taken, a store call less); every later attempt,
and a first one whose placement had to wait, places itself.

After ``max_attempts`` in a row that made no progress (more than the one token a prefill
samples) over at least ``STREAK_SPAN`` × ``retry_max_s``, ``ATTEMPTS_IN_ALL`` ×
``max_attempts`` in all, or a non-retryable error, the request fails (``fail``); a request
every live worker has failed tries them all again (`Failover._place`). A request
this replica lost to a peer (lease lost, or its writes fenced with a stale epoch) is not a
failure: the new owner continues it. A cancelled run records ``cancel`` — or, when the
replica is shutting down, hands the request off to a peer; a run whose record was cancelled
under it (its next transition refused) ends with a ``cancelled`` chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from functools import partial

from orchestrator import errors
from orchestrator.control.dispatch import Dispatch
from orchestrator.control.leases import LeaseKeeper
from orchestrator.control.ledger import Booking, Ledger
from orchestrator.control.local import Local
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.relay import Relay, ended_elsewhere
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.backoff import exponential_jitter
from orchestrator.core.records import WorkerInfo
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge, State
from orchestrator.store.base import Store
from orchestrator.store.outage import outlasting

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    RETRY = "retry"
    FAIL = "fail"
    BY_STATUS = "by-status"
    """As the worker's status code says (`orchestrator.api.protocol.RETRYABLE_CODES`)."""


CALL_PHASES = frozenset({"prefill", "decode", "generate", "tokenize"})
"""Phases of a worker call that failed with a status code."""
WATCH_PHASES = frozenset({"heartbeat", "silence", "stream"})
"""Phases where the orchestrator itself gave up on a worker: always worth another try."""
CAUSES = CALL_PHASES | WATCH_PHASES | {"other"}
"""The bounded label set of ``pdorch_failovers_total{cause}``."""

RETRY: tuple[tuple[type[BaseException], frozenset[str] | None, Verdict], ...] = (
    (errors.WorkerError, WATCH_PHASES, Verdict.RETRY),
    (errors.WorkerError, None, Verdict.BY_STATUS),
    # The store stayed unreachable through its whole outage window (the calls that raise it
    # here have waited it out, `orchestrator.store.outage`): another attempt cannot help.
    (errors.StoreUnavailableError, None, Verdict.FAIL),
    (errors.UnavailableError, None, Verdict.RETRY),  # no worker placeable now
    (errors.OverloadedError, None, Verdict.RETRY),  # no KV room now
    (BaseException, None, Verdict.FAIL),
)
"""Whether another attempt may succeed, by the error's type and phase (None: any phase).
First match wins. Fencing (stale epoch, lease lost) and a request ended elsewhere are
never retried: they are not this attempt's failure."""


def phase_of(exc: BaseException) -> str:
    """The phase ``exc`` failed in ("" when it carries none)."""
    return exc.phase if isinstance(exc, errors.WorkerError) else ""


def verdict(exc: BaseException) -> Verdict:
    phase = phase_of(exc)
    for cls, phases, v in RETRY:
        if isinstance(exc, cls) and (phases is None or phase in phases):
            return v
    return Verdict.FAIL


def retryable(exc: BaseException) -> bool:
    v = verdict(exc)
    if v is Verdict.BY_STATUS:
        return isinstance(exc, errors.WorkerError) and exc.retryable_instance
    return v is Verdict.RETRY


ATTEMPTS_IN_ALL = 4
"""A request's attempts in all, in units of ``max_attempts``: attempts that moved the
request on (`_tries`) do not count against ``max_attempts``, and this bounds them."""
STREAK_SPAN = 2.0
"""A run of attempts that made no progress ends the request only once it has lasted this
many ``retry_max_s`` (its pauses are short at first): a fault that breaks every link for
a second is outlasted, not met by every retry at once."""
RETRY_JITTER_S = 1.0
"""Spread over every pause between attempts (tenacity's default, which the drive used)."""


def _pause(tries: int, s: ControlSettings) -> float:
    """The pause after the ``tries``-th failed attempt (`orchestrator.core.backoff`)."""
    return exponential_jitter(tries, s.retry_initial_s, s.retry_max_s, RETRY_JITTER_S)


def cause(exc: errors.WorkerError) -> str:
    """A bounded label for what failed: the error's phase."""
    return exc.phase if exc.phase in CAUSES else "other"


class Failover:
    def __init__(
        self,
        store: Store,
        settings: ControlSettings,
        ledger: Ledger,
        dispatch: Dispatch,
        relay: Relay,
        leases: LeaseKeeper,
        local: Local,
        metrics: ControlMetrics | None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.ledger = ledger
        self.dispatch = dispatch
        self.relay = relay
        self.leases = leases
        self.local = local
        self.metrics = metrics

    def book(self, spec: RequestSpec, workers: Sequence[WorkerInfo]) -> Booking | None:
        """The first attempt's placement, booked before the request's record is created (so
        the record is created placed: `orchestrator.control.ledger.placed`); None when
        nothing can be placed now — the record is then created queued and the drive places
        it, waiting and retrying as any attempt. The caller hands the booking to `drive`, or
        gives it back (`unbook`) when no drive starts."""
        if not workers:
            return None
        try:
            return self.ledger.place(
                workers,
                need=len(spec.prompt) + spec.max_tokens,
                prefill_tokens=len(spec.prompt),
                excluded=set(),
                now=time.monotonic(),
                tokens=spec.prompt,
            )
        except (errors.UnavailableError, errors.OverloadedError):
            return None

    def unbook(self, booking: Booking | None) -> None:
        """A booking from `book` whose drive never started: its load leaves the ledger."""
        if booking is not None:
            self.ledger.release(booking)

    async def drive(
        self, run: Run, workers: Sequence[WorkerInfo], booked: Booking | None = None
    ) -> AsyncIterator[OutChunk]:
        """Run the request to its end, failing over to other workers on retryable errors;
        ``booked``: the first attempt's placement, recorded by the record's creation
        (`book`), released by this drive whatever happens."""
        self.leases.hold(run)
        try:
            tries = self._tries(run, workers, booked)
            async with contextlib.aclosing(tries):
                async for chunk in tries:
                    yield chunk
        except asyncio.CancelledError:
            if self.local.stopping and not run.lease_lost:
                # Shutting down (drain): hand the request off — another replica takes it
                # over at once (epoch + 1) and its clients resume there.
                await self.leases.hand_off(run)
            elif not run.lease_lost:
                await self.relay.finish(run, Edge.CANCEL, "cancelled", "")
            raise
        except errors.LeaseLostError:
            raise  # the new owner records the end
        except errors.RequestFailedError:
            raise  # failed elsewhere (a peer's deadline reaper): its end is recorded
        except errors.StaleEpochError as exc:
            # Our writes are fenced off: another replica took the request over (our lease
            # lapsed while Redis stalled, say). Not a failure: the new owner continues it
            # and this client follows the journal it writes.
            run.lease_lost = True
            raise errors.LeaseLostError(f"request {run.rid!r} taken over: {exc}") from exc
        except errors.PdorchError as exc:
            if isinstance(exc, errors.InvalidTransitionError) and await self._cancelled(run):
                # A Cancel (here, or through another replica) landed while a transition
                # was under way: the client's stream ends as a cancel's does. (Failed
                # there — a peer's deadline reaper —, `RequestFailedError` is raised.)
                yield OutChunk(run.rid, run.sent, [], "", "cancelled", run.timings)
                return
            if run.lease_lost:
                # This replica lost the request (its lease lapsed and a peer takes it over):
                # what failed here is not the request's fate; the new owner continues it.
                raise errors.LeaseLostError(f"request {run.rid!r} taken over: {exc}") from exc
            await self.relay.finish(run, Edge.FAIL, "error", str(exc))
            raise
        finally:
            self.leases.drop(run)

    async def _tries(
        self, run: Run, workers: Sequence[WorkerInfo], booked: Booking | None
    ) -> AsyncGenerator[OutChunk, None]:
        """Attempt after attempt (the first ``booked``) until one ends the request, or one
        fails in a way another cannot mend (`retryable`), or ``max_attempts`` in a row,
        over at least ``STREAK_SPAN`` × ``retry_max_s``, have moved the request on by no
        token of their own, or ``ATTEMPTS_IN_ALL`` times that were made — that one's error
        is raised — pausing between them (`orchestrator.core.backoff`). An attempt that
        relayed more than the one token its prefill samples (its decode worked) starts the
        count again: a fault that breaks
        every link for a moment (the `grpc-link-faults` chaos scenario) no longer spends
        the budget of requests that keep making progress between its hits. A plain loop: a
        request's only attempt, nearly always, costs nothing more."""
        s = self.settings
        tries = 1  # attempts in a row that moved the request on by at most one token
        made = 1
        streak_since = time.monotonic()
        try:
            while True:
                relayed = len(run.output)
                try:
                    if tries > 1:
                        await self._reassign(run)
                        workers = await outlasting(
                            self.store.settings.outage_s, "list workers", self.store.workers
                        )
                    first, booked = booked, None
                    async for chunk in self._attempt(run, workers, first):
                        yield chunk
                except BaseException as exc:
                    now = time.monotonic()
                    if len(run.output) - relayed > 1:
                        tries, streak_since = 1, now  # it moved the request on: afresh
                    lasted = now - streak_since >= STREAK_SPAN * s.retry_max_s
                    spent = (tries >= s.max_attempts and lasted) or (
                        made >= ATTEMPTS_IN_ALL * s.max_attempts
                    )
                    if spent or not retryable(exc):
                        raise
                else:
                    return
                await asyncio.sleep(_pause(tries, s))
                tries += 1
                made += 1
        finally:
            self.unbook(booked)  # ended before its first attempt started

    async def _cancelled(self, run: Run) -> bool:
        """Whether the request's record says it was cancelled (the store away: whether it
        was here); `RequestFailedError` if it says it failed (`ended_elsewhere`)."""
        state = await ended_elsewhere(self.store, run.rid)
        return run.cancelled if state is None else state is State.CANCELLED

    async def _reassign(self, run: Run) -> None:
        """Fence the failed attempt off: epoch + 1, back to queued (waiting out a store
        outage: `orchestrator.store.outage`) — once the failed attempt's chunks still being
        journalled are written (written later, at the old epoch, they would be refused as
        stale: a takeover that never happened). The requeue is fenced by the run's own
        epoch: a replica whose request was taken over meanwhile (its lease lapsed while it
        stalled, or while the store was away) is refused (`StaleEpochError`: the drive
        stops and its clients follow the new owner), never moves the new owner's epoch."""
        with contextlib.suppress(errors.UnavailableError):  # buffered: written at the new one
            await self.relay.writer.flush(run)
        run.check()
        record = await outlasting(
            self.store.settings.outage_s, "get", lambda: self.store.get(run.rid)
        )
        if record is None:
            raise errors.NotFoundError(f"request {run.rid!r} vanished")
        if record.state.terminal:
            raise errors.RequestEndedError(f"request {run.rid!r} is {record.state}")
        tried = run.attempts
        new_epoch = await self.store.transition(
            run.rid, Edge.REQUEUE, epoch=run.epoch, fields={"failovers": tried.failovers}
        )
        log.warning(
            "request %s: failover %d after %s; epoch %d -> %d, resuming at token %d",
            run.rid, tried.failovers, tried.last_error, run.epoch, new_epoch, len(run.output),
        )  # fmt: skip
        run.epoch = new_epoch

    def _place(self, run: Run, workers: Sequence[WorkerInfo]) -> Booking:
        """Place an attempt away from the workers that failed this request. When every
        live worker has (a fault that hit every link at once — the `grpc-link-faults`
        chaos scenario — not every worker's death: the dead are not listed), it starts
        over with all of them; their breakers still place the ones that failed last, and
        the attempt budget (`_tries`) bounds it."""
        spec, tried = run.spec, run.attempts
        for _ in range(2):
            try:
                return self.ledger.place(
                    workers,
                    need=len(spec.prompt) + spec.max_tokens,
                    prefill_tokens=len(spec.prompt) + len(run.output),
                    excluded=tried.excluded,
                    now=time.monotonic(),
                    tokens=[*spec.prompt, *run.output],
                )
            except errors.UnavailableError:
                if not tried.excluded:
                    raise
                log.info(
                    "request %s: every live worker failed it (%s): trying them again",
                    run.rid, ", ".join(sorted(tried.excluded)),
                )  # fmt: skip
                tried.excluded.clear()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _attempt(
        self, run: Run, workers: Sequence[WorkerInfo], booked: Booking | None
    ) -> AsyncIterator[OutChunk]:
        """Place the request (unless ``booked``: placed, and recorded, at its creation), run
        the attempt's legs and relay their tokens; on a worker's failure, remember to avoid
        it (here and, by its breaker, for everyone)."""
        if booked is not None:
            booking = booked  # nothing awaited before the `try` that releases it
        else:
            if not workers:
                raise errors.UnavailableError("no workers registered")
            spec = run.spec
            if len(run.output) >= spec.max_tokens:
                # Every token is out: what failed after the last one only cost the finish.
                yield await self.relay.complete(run, "length")
                return
            booking = self._place(run, workers)
        if self.metrics is not None:
            self.metrics.placements.labels(str(booking.placement.mode)).inc()
        try:
            run.timings.setdefault("queue_ms", (time.monotonic() - run.started) * 1000)
            stream = self.dispatch.stream(run, booking, recorded=booked is not None)
            # Its workers answered (the first chunk): a half-open breaker's probe is over
            # then, not when the stream ends (the worker must not be starved).
            relayed = self.relay.relay(run, stream, partial(self.ledger.succeeded, booking))
            async with contextlib.aclosing(relayed):
                async for chunk in relayed:
                    yield chunk
        except errors.WorkerError as exc:
            tried = run.attempts
            tried.failovers += 1
            tried.last_error = str(exc)
            if self.metrics is not None:
                self.metrics.failovers.labels(cause(exc)).inc()
            tried.excluded.add(exc.worker)
            self.ledger.failed(booking, exc.worker, time.monotonic())
            raise
        finally:
            self.ledger.release(booking)
        self.ledger.succeeded(booking)
