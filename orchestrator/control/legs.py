"""The calls to workers, each watched so a dead worker is noticed in seconds.

A *leg* is one call of a request's attempt: tokenize, prefill (which pushes the KV to the
decode worker), the decode stream, the aggregated stream, the release of unadopted KV. Every
wait is bounded twice: by the call's own timeout, and by the worker's heartbeat, checked
every ``watch_interval_s`` — a worker that died mid-call (its heartbeat key expired) fails
the leg with a retryable `WorkerError` of phase ``heartbeat``; a stream silent for
``token_timeout_s`` fails it with phase ``silence``. Errors are translated to `WorkerError`
here (`translated`), phased by the leg, so failover reads types and phases, never messages.

This module knows nothing of the store: whether a worker is alive is a callable it is
given, and the run's own checkpoint (taken over? cancelled?) is another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import grpc

from orchestrator import errors
from orchestrator.api import worker_pb2
from orchestrator.control.calls import Pending
from orchestrator.control.clients import WorkerClients, translated
from orchestrator.control.mux import Tap, Unsupported
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo

log = logging.getLogger(__name__)

Alive = Callable[[WorkerInfo], Awaitable[bool]]
"""Whether a worker's heartbeat is still there."""
Checkpoint = Callable[[], None]
"""Raises when the run must stop (taken over, cancelled); called at every watch step."""

TOKENIZE_TIMEOUT_S = 30.0
RELEASE_TIMEOUT_S = 2.0
"""Releasing unadopted KV is a courtesy (the decode worker also times it out)."""


def heartbeat_lost(worker: WorkerInfo) -> errors.WorkerError:
    return errors.WorkerError(
        worker.worker_id, "missed its heartbeats", retryable=True, phase="heartbeat"
    )


class _Watch:
    """One worker stream being read, as the replica's watchdog sees it."""

    __slots__ = ("check", "logged", "reader", "reading", "since", "stream", "trouble", "worker")

    def __init__(
        self, reader: asyncio.Task[Any], stream: Any, worker: WorkerInfo, check: Checkpoint
    ) -> None:
        self.reader = reader
        self.stream = stream
        self.worker = worker
        self.check = check
        self.reading = False
        """The reader waits on the stream (else it is busy elsewhere: no silence of the
        worker's)."""
        self.since = time.monotonic()
        """When the current read began: silence is time spent waiting for the worker."""
        self.trouble: BaseException | None = None
        self.logged = False
        """Its checkpoint's failure was logged (once a stream, not every step)."""

    def quiet(self) -> float:
        return time.monotonic() - max(self.since, getattr(self.stream, "progress", self.since))

    def failed(self) -> BaseException | None:
        """What the watchdog interrupted the read for (None: nothing)."""
        return self.trouble

    def interrupt(self, problem: BaseException) -> None:
        """Fail the read waiting now with ``problem`` (once; none waiting: nothing)."""
        if self.reading and self.trouble is None:
            self.trouble = problem
            self.reader.cancel()


class Watchdogs:
    """Every watched stream of a replica checked every ``step`` seconds by one task — not a
    task and a timer per stream, which cost a loop wake-up per stream and step whatever the
    stream does. A step checks each stream's run (its checkpoint) and silence, then, for the
    streams quiet for a step or more, their workers' heartbeats — asked once per worker, not
    once per stream, each in a task of its own (one in flight per worker): a slow store
    (the heartbeat's answer) never holds back the next step's checks of the runs' flags and
    silence. Started with the first stream, ended with the last."""

    def __init__(
        self,
        step: float,
        problem: Callable[[Checkpoint, WorkerInfo, float], BaseException | None],
        alive: Alive,
    ) -> None:
        self.step = step
        self._problem = problem
        self._alive = alive
        self._watches: set[_Watch] = set()
        self._task: asyncio.Task[None] | None = None
        self._asking: dict[str, asyncio.Task[None]] = {}
        """The heartbeat checks in flight, by worker."""

    def add(self, watch: _Watch) -> None:
        self._watches.add(watch)
        task = self._task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._task = asyncio.create_task(self._run(), name="pdorch-stream-watchdog")

    def discard(self, watch: _Watch) -> None:
        self._watches.discard(watch)

    async def _run(self) -> None:
        while self._watches:
            await asyncio.sleep(self.step)
            try:
                self._step()
            except Exception:  # a bug (logged): the next step still runs
                log.exception("the stream watchdog's step failed")

    def _step(self) -> None:
        quiet: dict[str, tuple[WorkerInfo, list[_Watch]]] = {}
        for watch in list(self._watches):
            if not watch.reading:
                continue  # the reader is busy elsewhere: not the worker's silence
            silent = watch.quiet()
            try:
                problem = self._problem(watch.check, watch.worker, silent)
            except Exception:  # a bug in the run's checkpoint: silence is still judged
                if not watch.logged:
                    watch.logged = True
                    log.exception("a stream's checkpoint failed")
                problem = self._problem(_nothing, watch.worker, silent)
            if problem is not None:
                watch.interrupt(problem)
            elif silent >= self.step:
                quiet.setdefault(watch.worker.worker_id, (watch.worker, []))[1].append(watch)
        loop = asyncio.get_running_loop()
        for wid, (worker, watches) in quiet.items():
            asking = self._asking.get(wid)
            if asking is None or asking.get_loop() is not loop:  # else: it answers for these
                task = asyncio.create_task(
                    self._heartbeat(worker, watches), name="pdorch-heartbeat-check"
                )
                self._asking[wid] = task
                task.add_done_callback(partial(self._asked, wid))

    def _asked(self, wid: str, _: asyncio.Task[None]) -> None:
        self._asking.pop(wid, None)

    async def _heartbeat(self, worker: WorkerInfo, watches: list[_Watch]) -> None:
        try:
            alive = await self._alive(worker)
        except Exception:  # a bug: logged; the streams are asked about again next step
            log.exception("the heartbeat check of %s failed", worker.worker_id)
            return
        if not alive:
            for watch in watches:
                if watch.quiet() >= self.step:  # still waiting on the worker
                    watch.interrupt(heartbeat_lost(worker))


def _nothing() -> None:
    """A checkpoint that finds nothing wrong."""


class WorkerLegs:
    def __init__(self, clients: WorkerClients, settings: ControlSettings, alive: Alive) -> None:
        self.clients = clients
        self.settings = settings
        self._alive = alive
        self._watchdogs = Watchdogs(settings.watch_interval_s, self._problem, alive)

    async def tokenize(
        self, req: worker_pb2.TokenizeRequest, workers: Sequence[WorkerInfo]
    ) -> worker_pb2.TokenizeResponse:
        """Tokenize on the least-loaded worker that answers (a dead one is skipped)."""
        last: errors.WorkerError | None = None
        for worker in sorted(workers, key=lambda w: (w.active, w.worker_id)):
            try:
                async with translated(worker.worker_id, "tokenize"):
                    return await self._tokenize(worker, req)
            except errors.WorkerError as exc:
                if not exc.retryable_instance:
                    raise
                last = exc
        raise errors.UnavailableError(f"no worker could tokenize: {last}")

    async def prefill(
        self,
        prefill: WorkerInfo,
        decode: WorkerInfo,
        req: worker_pb2.PrefillRequest,
        check: Checkpoint,
    ) -> worker_pb2.PrefillResponse:
        """Prefill on ``prefill``, which sends the KV to ``decode`` (blamed for its failures)."""
        stubs = self.clients.get(prefill.address)
        timeout_s = self.settings.prefill_timeout_s
        async with translated(prefill.worker_id, "prefill", kv_target=decode.worker_id):
            if self.settings.call_mux and stubs.calls.supported:
                try:
                    shared: worker_pb2.PrefillResponse = await self._watch(
                        stubs.calls.prefill(req, timeout_s), prefill, check
                    )
                except Unsupported:
                    pass  # refused before it ran: a call of its own, below
                else:
                    return shared
            call = stubs.prefill.Prefill(req, timeout=timeout_s)
            resp: worker_pb2.PrefillResponse = await self._watch(call, prefill, check)
        return resp

    async def _tokenize(
        self, worker: WorkerInfo, req: worker_pb2.TokenizeRequest
    ) -> worker_pb2.TokenizeResponse:
        """On the call this replica shares with the worker's other calls (`calls`), or on a
        call of its own (``call_mux`` off, or a worker without ``CallMany``)."""
        stubs = self.clients.get(worker.address)
        if self.settings.call_mux and stubs.calls.supported:
            try:
                return await stubs.calls.tokenize(req, TOKENIZE_TIMEOUT_S)
            except Unsupported:
                pass  # refused before it ran: a call of its own, below
        return await stubs.general.Tokenize(req, timeout=TOKENIZE_TIMEOUT_S)

    async def decode(
        self,
        decode: WorkerInfo,
        req: worker_pb2.DecodeRequest,
        check: Checkpoint,
        tap: Tap | None = None,
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        """The decode worker's token stream (it adopts the KV before the first chunk): on
        the call this replica shares with the worker's other streams (`mux`; ``tap``: the
        relay's way past this reader, `Tap`), or on a call of its own (``decode_mux`` off,
        or a worker without ``DecodeMany``)."""
        stubs = self.clients.get(decode.address)
        if self.settings.decode_mux and stubs.mux.supported:
            shared = stubs.mux.open(req)
            shared.tap = tap
            streamed = False
            try:
                async with translated(decode.worker_id, "decode"):
                    async for chunk in self._watched(shared, decode, check):
                        streamed = True
                        yield chunk
            except Unsupported as exc:
                if streamed:  # cannot happen (refused before any batch), but never resend
                    raise errors.WorkerError(
                        decode.worker_id, str(exc), retryable=True, phase="decode"
                    ) from exc
                # nothing was streamed: on a call of its own, below
            except errors.WorkerError as exc:
                if exc.phase == "silence":
                    await stubs.mux.stalled(self.settings.token_timeout_s)
                raise
            else:
                return
            finally:
                shared.close()  # a stop string, a failover or a cancelled client ends it early
        stream = stubs.decode.Decode(req)
        try:
            async with translated(decode.worker_id, "decode"):
                async for chunk in self._watched(stream, decode, check):
                    yield chunk
        finally:
            stream.cancel()  # a stop string, a failover or a cancelled client ends it early

    async def generate(
        self, worker: WorkerInfo, req: worker_pb2.AggregatedRequest, check: Checkpoint
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        """One worker runs the whole request (aggregated) and streams its tokens."""
        stream = self.clients.get(worker.address).general.Generate(req)
        try:
            async with translated(worker.worker_id, "generate"):
                async for chunk in self._watched(stream, worker, check):
                    yield chunk
        finally:
            stream.cancel()

    async def release(self, decode: WorkerInfo, rid: str, epoch: int) -> None:
        """Tell ``decode`` to drop KV it may hold for (rid, epoch) and never adopted."""
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await asyncio.shield(
                self.clients.get(decode.address).decode.Release(
                    worker_pb2.ReleaseRequest(request_id=rid, epoch=epoch),
                    timeout=RELEASE_TIMEOUT_S,
                )
            )

    async def _watch(self, call: Any, worker: WorkerInfo, check: Checkpoint) -> Any:
        """Await a unary call (its own, or a `calls.Pending`), failing fast when the worker's
        heartbeat disappears."""
        task = call.future if isinstance(call, Pending) else asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.watch_interval_s)
                if done:
                    return task.result()
                check()
                if not await self._alive(worker):
                    raise heartbeat_lost(worker)
        finally:
            if not task.done():
                call.cancel()

    def _problem(
        self, check: Checkpoint, worker: WorkerInfo, silent: float
    ) -> BaseException | None:
        """What the run's flags (`Checkpoint`) or the stream's silence say is wrong."""
        try:
            check()
        except (errors.PdorchError, asyncio.CancelledError) as exc:  # raised by the flags
            return exc
        if silent >= self.settings.token_timeout_s:
            return errors.WorkerError(
                worker.worker_id, f"no token for {silent:.0f}s", retryable=True, phase="silence"
            )
        return None

    async def _watched(
        self, stream: Any, worker: WorkerInfo, check: Checkpoint
    ) -> AsyncIterator[Any]:
        """Iterate a worker's token stream; a worker whose heartbeat expired, or a stream
        silent for ``token_timeout_s``, raises a retryable WorkerError.

        The reads are plain awaits (no task per chunk: this is the per-message path); the
        replica's watchdog (`Watchdogs`, one task for every stream) checks the stream every
        ``watch_interval_s`` and, on trouble, interrupts the read it finds waiting
        (cancelling the reading task, which the read answers as `asyncio.timeout` does: only
        that cancellation is turned into the watchdog's error; any other is re-raised). A
        stream whose chunks can go past this reader (`MuxStream`'s tap) says when its last
        one came (``progress``): the read waits on, the stream is not silent."""
        reader = asyncio.current_task()
        assert reader is not None
        it = aiter(stream)
        watch = _Watch(reader, stream, worker, check)
        self._watchdogs.add(watch)
        try:
            while True:
                if (trouble := watch.failed()) is not None:
                    raise trouble
                watch.reading, watch.since = True, time.monotonic()
                try:
                    chunk = await anext(it)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if (trouble := watch.failed()) is not None and reader.uncancel() == 0:
                        raise trouble from None
                    raise
                finally:
                    watch.reading = False
                yield chunk
        finally:
            self._watchdogs.discard(watch)
