"""Many decode streams on one call: the orchestrator's side of ``DecodeMany``.

A relayed message costs a replica ~100 µs of gRPC's machinery to read whatever it carries
(README, "Where a relayed message's CPU goes"); with one ``Decode`` call per request it
reads one message per stream per window. A `DecodeMux` keeps one ``DecodeMany`` call per
decode worker and hands each batch's events to the streams of the requests placed there:
one read per batch where there was one per stream (the worker aligns its streams' windows so
that a batch carries all of them: `orchestrator.workers.mux`).

A `MuxStream` reads as a ``Decode`` call does: its chunks, then its end. A failure event
raises the `grpc.aio.AioRpcError` that stream's own call would have raised (its code,
details and trailing metadata), so `clients.translated` and failover see no difference.
The call failing fails every stream on it, always with an error failover retries (a killed
worker: UNAVAILABLE; `call_failed`); the next stream opens a new call. Handing events out
never waits for a reader: each stream keeps its chunks until read (at most one per window,
and no more than its ``max_tokens``). A stream closed early (`MuxStream.close`: a stop
string, a failover, a client gone) sends its cancel and the worker stops that decode. A
worker that does not serve ``DecodeMany`` (an older version: UNIMPLEMENTED) fails its
streams with `Unsupported` before any chunk; the caller then opens a ``Decode`` call
(`legs`), and this worker's mux is not tried again for `RETRY_UNSUPPORTED_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import grpc

from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.api.protocol import RETRYABLE_CODES, link_broke

__all__ = [
    "RETRY_UNSUPPORTED_S",
    "DecodeMux",
    "MuxStream",
    "SharedCall",
    "SharedCalls",
    "Tap",
    "Unsupported",
    "call_failed",
    "copy_error",
    "failure_error",
    "status_error",
]

log = logging.getLogger(__name__)

RETRY_UNSUPPORTED_S = 60.0
"""After a worker answered UNIMPLEMENTED, how long its streams use ``Decode`` calls (it may
be upgraded in place)."""


class Unsupported(Exception):
    """The worker does not serve ``DecodeMany``: nothing was streamed; use ``Decode``."""


CommandT = TypeVar("CommandT")
BatchT = TypeVar("BatchT")

_STATUS = {status.value[0]: status for status in grpc.StatusCode}


def status_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
) -> grpc.aio.AioRpcError:
    """The error a ``Decode`` call ending with this status raises."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details, None
    )


def failure_error(failure: worker_pb2.DecodeFailure) -> grpc.aio.AioRpcError:
    """The error the call a worker reports failed (`DecodeFailure`) would have raised."""
    code = _STATUS.get(failure.code, grpc.StatusCode.UNKNOWN)
    return status_error(code, failure.details, tuple(failure.trailing.items()))


def call_failed(exc: grpc.aio.AioRpcError, method: str = "DecodeMany") -> BaseException:
    """What the call's failure means for its streams. Unlike one stream's failure event, it
    says nothing of their requests — the worker or the link failed — so a code failover
    would not retry (an INTERNAL from gRPC's core, say) is read as UNAVAILABLE: the
    requests move to another worker instead of failing."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unsupported(f"the worker does not serve {method}: {details}")
    if code in RETRYABLE_CODES or link_broke(code, details):
        return exc
    failed = f"the worker's {method} call failed: {code.name}: {details}"
    return status_error(grpc.StatusCode.UNAVAILABLE, failed)


def copy_error(error: BaseException) -> BaseException:
    """One exception per stream (a raised exception collects its raiser's traceback)."""
    if isinstance(error, grpc.aio.AioRpcError):
        trailing = tuple(error.trailing_metadata() or ())
        return status_error(error.code(), error.details() or "", trailing)  # type: ignore[arg-type]
    return Unsupported(str(error)) if isinstance(error, Unsupported) else error


class Tap:
    """A decode stream's way past its reader (`MuxStream`): while
    ``take`` is set (by the relay, after the stream's first chunk), a chunk arriving with
    none queued before it is offered to it in the worker call's own step; ``take`` relays it
    and says so (True), or leaves it to the reader (False: an end, a stop string, anything
    the relay must raise). So a plain chunk wakes no task of its request."""

    __slots__ = ("take",)

    def __init__(self) -> None:
        self.take: Callable[[worker_pb2.TokenChunk], bool] | None = None


class MuxStream:
    """One request's decode stream on a shared call: iterate it as a ``Decode`` call."""

    __slots__ = ("_call", "_chunks", "_done", "_error", "_waiter", "progress", "sid", "tap")

    def __init__(self, call: _Call, sid: int) -> None:
        self._call = call
        self.sid = sid
        self._chunks: deque[worker_pb2.TokenChunk] = deque()
        self._done = False
        """No event will come: the stream ended, failed or was closed."""
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.tap: Tap | None = None
        """Where a chunk may go past the reader (`Tap`)."""
        self.progress = time.monotonic()
        """When the last chunk came (`time.monotonic`), tapped or queued: what a watch on
        the stream's silence reads while tapped chunks leave its reader waiting."""

    def __aiter__(self) -> MuxStream:
        return self

    async def __anext__(self) -> worker_pb2.TokenChunk:
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._chunks.popleft()

    def close(self) -> None:
        """Stop the stream (the worker cancels its decode); what was not read is dropped,
        and a read from then on raises `asyncio.CancelledError`, as a cancelled call's."""
        if not self._done:
            self._call.cancel(self.sid)
            self._finish(asyncio.CancelledError("the stream was closed"))
        self._chunks.clear()

    def _deliver(self, chunk: worker_pb2.TokenChunk) -> None:
        """``chunk`` (a view into its batch): tapped, or queued as a copy of its own."""
        self.progress = time.monotonic()
        tap = self.tap
        if tap is not None and tap.take is not None and not self._chunks and not self._done:
            try:
                if tap.take(chunk):
                    return
            except Exception:  # a bug: the reader gets the chunk (and raises what is wrong)
                log.exception("a tapped decode chunk failed")
        own = worker_pb2.TokenChunk()
        own.CopyFrom(chunk)  # not a view keeping the batch alive
        self._chunks.append(own)
        self._wake()

    def _finish(self, error: BaseException | None) -> None:
        self._done, self._error = True, error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class SharedCall(Generic[CommandT, BatchT]):
    """One long-lived bidirectional call to a worker (``DecodeMany``, ``CallMany``): its
    commands queued and handed to gRPC's writer as they come (`_outgoing`), its batches
    read by a task of its own (`_take`); its end, whatever it was, is given to `_ended`
    with the error that fails what was left on it."""

    method = "DecodeMany"

    def __init__(self, open_call: Callable[[AsyncIterator[Any]], Any]) -> None:
        self._commands: asyncio.Queue[CommandT | None] = asyncio.Queue()
        self.closed = False
        self.last_batch = time.monotonic()
        """When the last batch arrived (or the call opened)."""
        self._rpc = open_call(self._outgoing())
        self._reader = asyncio.create_task(self._read(), name=f"pdorch-{self.method}")

    async def close(self) -> None:
        self._rpc.cancel()
        await asyncio.wait({self._reader})  # its end, whatever it was: never re-raised here

    def _send(self, command: CommandT) -> None:
        self._commands.put_nowait(command)

    async def _outgoing(self) -> AsyncIterator[Any]:
        """One message per command (a subclass may pack what is queued together)."""
        while (command := await self._commands.get()) is not None:
            yield command

    def _take(self, batch: BatchT) -> None:
        raise NotImplementedError

    def _ended(self, error: BaseException) -> None:
        raise NotImplementedError

    async def _read(self) -> None:
        error: BaseException = status_error(
            grpc.StatusCode.UNAVAILABLE, f"the worker ended its {self.method} call"
        )
        try:
            async for batch in self._rpc:
                self.last_batch = time.monotonic()
                self._take(batch)
        except grpc.aio.AioRpcError as exc:
            error = call_failed(exc, self.method)
        except asyncio.CancelledError:
            error = status_error(grpc.StatusCode.CANCELLED, "the orchestrator closed the call")
            raise
        except Exception as exc:  # noqa: BLE001 - a batch we cannot read: the call is done
            log.warning("a %s call to a worker failed: %r", self.method, exc)
            failed = f"the {self.method} call failed: {exc!r}"
            error = status_error(grpc.StatusCode.UNAVAILABLE, failed)
        finally:
            self._rpc.cancel()  # ended already, or the worker must stop what it runs for it
            self.closed = True
            self._ended(error)
            self._commands.put_nowait(None)


class _Call(SharedCall[worker_pb2.DecodeCommand, worker_pb2.DecodeBatch]):
    """One ``DecodeMany`` call: the commands it sends, the streams its batches feed."""

    def __init__(self, mux: DecodeMux, stub: worker_pb2_grpc.DecodeServiceAsyncStub) -> None:
        self._mux = mux
        self.streams: dict[int, MuxStream] = {}
        self._next = 0
        super().__init__(stub.DecodeMany)

    def open(self, request: worker_pb2.DecodeRequest) -> MuxStream:
        sid, self._next = self._next, self._next + 1
        stream = self.streams[sid] = MuxStream(self, sid)
        self._send(worker_pb2.DecodeCommand(stream=sid, start=request))
        return stream

    def cancel(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None and not self.closed:
            cancel = worker_pb2.DecodeCancel()
            self._send(worker_pb2.DecodeCommand(stream=sid, cancel=cancel))

    def _ended(self, error: BaseException) -> None:
        self._mux._ended(self, error)
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream._finish(copy_error(error))

    def _take(self, batch: worker_pb2.DecodeBatch) -> None:
        self._hand_out(batch)

    def _hand_out(self, batch: worker_pb2.DecodeBatch) -> None:
        self._mux.batches += 1
        for event in batch.events:
            stream = self.streams.get(event.stream)
            if stream is None:
                continue  # closed meanwhile
            if event.HasField("chunk"):
                stream._deliver(event.chunk)
            if event.HasField("failure"):
                del self.streams[event.stream]
                stream._finish(failure_error(event.failure))
            elif event.ended:
                del self.streams[event.stream]
                stream._finish(None)


CallT = TypeVar("CallT", bound=SharedCall[Any, Any])


class SharedCalls(Generic[CallT]):
    """A worker's shared call as one replica holds it: opened when first needed, forgotten
    when it ends (the next use opens another), and not tried for `RETRY_UNSUPPORTED_S`
    after the worker answered UNIMPLEMENTED (``fallback`` says what is used instead)."""

    def __init__(self, open_call: Callable[[], CallT], fallback: str) -> None:
        self._open_call = open_call
        self._fallback = fallback
        self._call: CallT | None = None
        self._unsupported_until = 0.0

    @property
    def supported(self) -> bool:
        """False for `RETRY_UNSUPPORTED_S` after the worker answered UNIMPLEMENTED."""
        return time.monotonic() >= self._unsupported_until

    async def close(self) -> None:
        """Cancel the call: everything still on it fails (CANCELLED)."""
        if self._call is not None:
            await self._call.close()

    def _current(self) -> CallT:
        if self._call is None:
            self._call = self._open_call()
        return self._call

    def _ended(self, call: CallT, error: BaseException) -> None:
        if self._call is call:
            self._call = None
        if isinstance(error, Unsupported):
            self._unsupported_until = time.monotonic() + RETRY_UNSUPPORTED_S
            log.info("a worker does not serve %s: %s there", call.method, self._fallback)


class DecodeMux(SharedCalls[_Call]):
    """The decode streams this replica runs on one worker, on one call at a time."""

    def __init__(self, stub: worker_pb2_grpc.DecodeServiceAsyncStub) -> None:
        super().__init__(lambda: _Call(self, stub), "one Decode call per stream")
        self.batches = 0
        """Batches read (each one message, whatever the number of streams it fed)."""

    def open(self, request: worker_pb2.DecodeRequest) -> MuxStream:
        """Start ``request``'s decode on the worker's call (opened if none is)."""
        return self._current().open(request)

    async def stalled(self, silence_s: float) -> None:
        """A stream on this worker was given up for silence: if its call has brought no
        batch for ``silence_s`` either, every stream on it is as silent (a wedged call, or
        a connection gone without a reset): close it, so the next stream opens a new one
        rather than wait out the same silence."""
        call = self._call
        if call is not None and time.monotonic() - call.last_batch >= silence_s:
            log.warning("a decode call brought nothing for %.0fs: closing it", silence_s)
            await call.close()
