"""Many decode streams on one call: the worker's side of ``DecodeMany``.

A replica that places several requests on this worker reads all their tokens from one call
instead of one ``Decode`` call each: what costs it is the messages, not the tokens
(`coalesce`), and here one message — a `DecodeBatch` — carries the chunks of every stream
that had one at that moment. The streams' windows are aligned on the clock
(`coalesce.coalesced(aligned=True)`), so the streams with the same window send at the same
instants and their chunks leave together.

Each stream runs as its own ``Decode`` call would, in a task of its own: the host's decode
(`host.EngineHost.decode`), coalesced, with a `StreamContext` for a context, whose abort
fails that stream only (a failure event with the status the call would have ended with).
The orchestrator's commands start and cancel streams; a cancelled stream's decode is
cancelled as a cancelled call's would be, and no event follows. The call ending (the
orchestrator gone, or the worker stopping) cancels every stream left on it, and so does a
command protobuf cannot parse (`BadCommand`: the call is refused INVALID_ARGUMENT). Draining
(`drain`), a call refuses new streams (UNAVAILABLE, retryable) and ends once its last
stream has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn

import grpc

from orchestrator.aio import cancel_and_wait
from orchestrator.api import worker_pb2
from orchestrator.api.undecodable import Undecodable
from orchestrator.workers.coalesce import coalesced, merge, window_of
from orchestrator.workers.host import Context

__all__ = ["BadCommand", "DecodeMany", "Decoder", "StreamAborted", "StreamContext"]

log = logging.getLogger(__name__)

Decoder = Callable[[worker_pb2.DecodeRequest, Context], AsyncIterator[worker_pb2.TokenChunk]]
"""A host's decode (`host.EngineHost.decode`)."""
Count = Callable[[worker_pb2.TokenChunk], worker_pb2.TokenChunk]
"""The worker's count of what a chunk carries (returns the chunk)."""


class StreamAborted(Exception):
    """A host failed one stream: the status its own call would have ended with."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing: tuple[tuple[str, str], ...] = tuple(
            (str(key), value) for key, value in trailing if isinstance(value, str)
        )  # pdorch's trailing metadata is text (`api.protocol.BLAME_KEY`)

    def event(self, stream: int) -> worker_pb2.DecodeEvent:
        failure = worker_pb2.DecodeFailure(
            code=self.code.value[0], details=self.details, trailing=dict(self.trailing)
        )
        return worker_pb2.DecodeEvent(stream=stream, failure=failure)


class BadCommand(Exception):
    """A command protobuf could not parse (`api.undecodable`): the call is refused."""

    def __init__(self, request: Undecodable) -> None:
        super().__init__(request.reason)
        self.request = request


class StreamContext:
    """One stream's `Context`: aborting fails this stream, not the call it shares."""

    def __init__(self) -> None:
        self._trailing: Any = ()

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise StreamAborted(code, details, trailing_metadata or self._trailing)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self._trailing = trailing_metadata


MAX_BATCH_BYTES = 1 << 20
"""A batch larger than this is split (a gRPC message is refused above 4 MiB by default)."""


def _batches(events: list[worker_pb2.DecodeEvent]) -> Iterator[worker_pb2.DecodeBatch]:
    """``events`` in one batch, or in several of at most `MAX_BATCH_BYTES` each (an event
    larger than that alone)."""
    batch = worker_pb2.DecodeBatch(events=events)
    if batch.ByteSize() <= MAX_BATCH_BYTES:
        yield batch
        return
    part: list[worker_pb2.DecodeEvent] = []
    size = 0
    for event in events:
        n = event.ByteSize() + 8  # the field's tag and length
        if part and size + n > MAX_BATCH_BYTES:
            yield worker_pb2.DecodeBatch(events=part)
            part, size = [], 0
        part.append(event)
        size += n
    yield worker_pb2.DecodeBatch(events=part)


class DecodeMany:
    """One ``DecodeMany`` call: its streams' tasks and the batches it sends."""

    def __init__(self, decode: Decoder, count: Count) -> None:
        self._decode = decode
        self._count = count
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._events: list[worker_pb2.DecodeEvent] = []
        self._wake: asyncio.Future[None] | None = None
        self._reading = True
        """The orchestrator may still send commands."""
        self._draining = False
        self._closing = False
        """The call is over: its streams are being cancelled, not by a command."""
        self._bad: Undecodable | None = None
        self._unsent: dict[int, worker_pb2.DecodeEvent] = {}
        """Each stream's chunk event not yet in a batch, which a later chunk joins."""

    def drain(self) -> None:
        """Refuse new streams; end the call once the running ones have ended."""
        self._draining = True
        self._poke()

    async def serve(
        self, commands: AsyncIterator[worker_pb2.DecodeCommand | Undecodable]
    ) -> AsyncIterator[worker_pb2.DecodeBatch]:
        """The call's batches, until the orchestrator closed its side (or the worker
        drained) and no stream is left."""
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read(commands), name="pdorch-decode-many-commands")
        try:
            while True:
                if self._bad is not None:
                    raise BadCommand(self._bad)
                if not self._events:
                    if self._over():
                        return
                    self._wake = loop.create_future()
                    try:
                        await self._wake
                    finally:
                        self._wake = None
                    # Streams due at the same instant wake in this loop turn: let them join.
                    await asyncio.sleep(0)
                if self._events:
                    events, self._events = self._events, []
                    self._unsent.clear()
                    for batch in _batches(events):
                        yield batch
        finally:
            self._closing = True
            tasks = [reader, *self._tasks.values()]
            self._tasks.clear()
            for task in tasks:  # all at once, then wait for each
                task.cancel()
            for task in tasks:
                try:
                    await cancel_and_wait(task)
                except Exception:
                    log.exception("a decode stream failed while its call closed")

    def abandon(self) -> None:
        """The call is over (its context is done): cancel every stream now, whether or not
        the batches' generator is ever resumed to run its cleanup."""
        self._closing = True
        for task in self._tasks.values():
            task.cancel()

    def _over(self) -> bool:
        if self._bad is not None:
            return False  # refused at the loop's top
        return not self._tasks and (not self._reading or self._draining)

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _emit(self, event: worker_pb2.DecodeEvent) -> None:
        self._events.append(event)
        self._poke()

    def _emit_chunk(
        self, sid: int, chunk: worker_pb2.TokenChunk | None, ended: bool, *, first: bool
    ) -> None:
        """A stream's chunk, or its end (``None``): joined to its chunk still unsent, if any
        (an orchestrator slow to read gets one merged chunk per stream, as a blocked
        ``Decode`` call's coalescer would send, not a backlog of them) — but for the
        stream's first chunk, which always goes alone (`coalesce`)."""
        unsent = self._unsent.get(sid)
        if unsent is not None and not unsent.ended:
            if chunk is not None:
                merge(unsent.chunk, chunk)
            unsent.ended = ended
            return
        event = worker_pb2.DecodeEvent(stream=sid, ended=ended)
        if chunk is not None:
            event.chunk.CopyFrom(chunk)
            if not first:
                self._unsent[sid] = event
        self._emit(event)

    async def _read(self, commands: AsyncIterator[worker_pb2.DecodeCommand | Undecodable]) -> None:
        try:
            async for command in commands:
                if isinstance(command, Undecodable):
                    self._bad = command
                    return
                sid = command.stream
                which = command.WhichOneof("command")
                if which == "start":
                    self._start(sid, command.start)
                elif which == "cancel":
                    task = self._tasks.pop(sid, None)
                    if task is not None:
                        task.cancel()
        except Exception as exc:  # noqa: BLE001 - the call broke: serve's cancellation follows
            log.debug("decode call's commands ended: %r", exc)
        finally:
            self._reading = False
            self._poke()

    def _start(self, sid: int, request: worker_pb2.DecodeRequest) -> None:
        if self._draining:
            refused = StreamAborted(grpc.StatusCode.UNAVAILABLE, "worker is draining", ())
            self._emit(refused.event(sid))
        elif sid in self._tasks:
            taken = StreamAborted(
                grpc.StatusCode.INVALID_ARGUMENT, f"stream {sid} is already running", ()
            )
            self._emit(taken.event(sid))
        else:
            name = f"pdorch-decode-{request.request_id}"
            self._tasks[sid] = asyncio.create_task(self._run(sid, request), name=name)

    async def _run(self, sid: int, request: worker_pb2.DecodeRequest) -> None:
        chunks = coalesced(
            self._decode(request, StreamContext()), window_of(request.flush_ms), aligned=True
        )
        ended, first = False, True
        try:
            async for chunk in chunks:
                ended = bool(chunk.finish_reason)
                self._emit_chunk(sid, self._count(chunk), ended, first=first)
                first = False
            if not ended:
                self._emit_chunk(sid, None, True, first=False)
        except StreamAborted as exc:
            self._emit(exc.event(sid))
        except asyncio.CancelledError:
            if not self._closing and self._tasks.get(sid) is asyncio.current_task():
                # Not the orchestrator's cancel nor the call's end: the host's own. A
                # cancelled Decode call would end CANCELLED: say so rather than go silent.
                lost = StreamAborted(grpc.StatusCode.CANCELLED, "the decode was cancelled", ())
                self._emit(lost.event(sid))
            raise
        except Exception as exc:  # what an unhandled error in a Decode call would be
            log.exception("decode of %s failed", request.request_id)
            failed = StreamAborted(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}", ())
            self._emit(failed.event(sid))
        finally:
            if self._tasks.get(sid) is asyncio.current_task():
                del self._tasks[sid]
            self._poke()
