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
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import grpc

from orchestrator.aio import cancel_and_wait
from orchestrator.api import worker_pb2
from orchestrator.api.undecodable import Undecodable
from orchestrator.workers.coalesce import coalesced, merge, window_of
from orchestrator.workers.host import Context

__all__ = [
    "BadCommand",
    "DecodeMany",
    "Decoder",
    "Many",
    "StreamAborted",
    "StreamContext",
    "batches",
]

log = logging.getLogger(__name__)

CommandT = TypeVar("CommandT")
EventT = TypeVar("EventT")
BatchT = TypeVar("BatchT")

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

    def failure(self) -> worker_pb2.DecodeFailure:
        return worker_pb2.DecodeFailure(
            code=self.code.value[0], details=self.details, trailing=dict(self.trailing)
        )

    def event(self, stream: int) -> worker_pb2.DecodeEvent:
        return worker_pb2.DecodeEvent(stream=stream, failure=self.failure())


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


class _Sized(Protocol):
    def ByteSize(self) -> int: ...


SizedT = TypeVar("SizedT", bound=_Sized)


def batches(events: list[SizedT], batch_of: Callable[[list[SizedT]], BatchT]) -> Iterator[BatchT]:
    """``events`` in one batch, or in several of at most `MAX_BATCH_BYTES` each (an event
    larger than that alone)."""
    if sum(event.ByteSize() + 8 for event in events) <= MAX_BATCH_BYTES:
        yield batch_of(events)
        return
    part: list[SizedT] = []
    size = 0
    for event in events:
        n = event.ByteSize() + 8  # the field's tag and length
        if part and size + n > MAX_BATCH_BYTES:
            yield batch_of(part)
            part, size = [], 0
        part.append(event)
        size += n
    yield batch_of(part)


def _decode_batch(events: list[worker_pb2.DecodeEvent]) -> worker_pb2.DecodeBatch:
    return worker_pb2.DecodeBatch(events=events)


class Many(Generic[CommandT, EventT, BatchT]):
    """One call carrying many: the tasks its commands started and the batches it sends.

    A subclass says how a command names its task (`_ident`), what a task does (`_run`:
    it `_emit`s its events), how a refusal reads (`_refusal`) and how events are packed
    (`_pack`); this runs the call — commands read in a task of their own, a ``cancel``
    command cancelling its task, events gathered into batches, drain, the call's end."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._events: list[EventT] = []
        self._wake: asyncio.Future[None] | None = None
        self._reading = True
        """The orchestrator may still send commands."""
        self._draining = False
        self._closing = False
        """The call is over: its tasks are being cancelled, not by a command."""
        self._bad: Undecodable | None = None

    def drain(self) -> None:
        """Refuse new commands; end the call once the running ones have ended."""
        self._draining = True
        self._poke()

    async def serve(self, commands: AsyncIterator[Any]) -> AsyncIterator[BatchT]:
        """The call's batches, until the orchestrator closed its side (or the worker
        drained) and no task is left."""
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read(commands), name=f"{self._name}-commands")
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
                    # Tasks due at the same instant wake in this loop turn: let them join.
                    await asyncio.sleep(0)
                if self._events:
                    events, self._events = self._events, []
                    self._sent()
                    for batch in self._pack(events):
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
                    log.exception("%s: a task failed while its call closed", self._name)

    def abandon(self) -> None:
        """The call is over (its context is done): cancel every task now, whether or not
        the batches' generator is ever resumed to run its cleanup."""
        self._closing = True
        for task in self._tasks.values():
            task.cancel()

    _name = "pdorch-many"
    """Its tasks' names start with it."""
    _noun = "task"
    """What a command starts, in a refusal's details."""

    def _unpack(self, message: Any) -> Iterable[CommandT]:
        """The commands one message carries (by default: it is one)."""
        return (message,)

    def _parse(self, command: CommandT) -> tuple[int, str | None]:
        """The task a command names, and which command it is (``"cancel"``, another, or
        None when it holds none)."""
        raise NotImplementedError

    def _run(self, ident: int, command: CommandT) -> Coroutine[Any, Any, None]:
        raise NotImplementedError

    def _refusal(self, ident: int, refused: StreamAborted) -> EventT:
        raise NotImplementedError

    def _pack(self, events: list[EventT]) -> Iterator[BatchT]:
        raise NotImplementedError

    def _sent(self) -> None:
        """The events gathered so far were packed (a subclass forgets what it may join)."""

    def _over(self) -> bool:
        if self._bad is not None:
            return False  # refused at the loop's top
        return not self._tasks and (not self._reading or self._draining)

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _emit(self, event: EventT) -> None:
        self._events.append(event)
        self._poke()

    def _own(self, ident: int) -> bool:
        """Whether the running task is ``ident``'s, not cancelled by a command or the
        call's end (a task cancelled otherwise was the host's own doing)."""
        return not self._closing and self._tasks.get(ident) is asyncio.current_task()

    def _done(self, ident: int) -> None:
        """A task's last step (in its ``finally``)."""
        if self._tasks.get(ident) is asyncio.current_task():
            del self._tasks[ident]
        self._poke()

    def _command(self, command: CommandT) -> None:
        ident, which = self._parse(command)
        if which == "cancel":
            task = self._tasks.pop(ident, None)
            if task is not None:
                task.cancel()
        elif which is None:
            empty = StreamAborted(grpc.StatusCode.INVALID_ARGUMENT, "an empty command", ())
            self._emit(self._refusal(ident, empty))
        else:
            self._start(ident, command)

    async def _read(self, commands: AsyncIterator[Any]) -> None:
        try:
            async for message in commands:
                if isinstance(message, Undecodable):
                    self._bad = message
                    return
                for command in self._unpack(message):
                    self._command(command)
        except Exception as exc:  # noqa: BLE001 - the call broke: serve's cancellation follows
            log.debug("%s: commands ended: %r", self._name, exc)
        finally:
            self._reading = False
            self._poke()

    def _start(self, ident: int, command: CommandT) -> None:
        if self._draining:
            refused = StreamAborted(grpc.StatusCode.UNAVAILABLE, "worker is draining", ())
            self._emit(self._refusal(ident, refused))
        elif ident in self._tasks:
            taken = StreamAborted(
                grpc.StatusCode.INVALID_ARGUMENT, f"{self._noun} {ident} is already running", ()
            )
            self._emit(self._refusal(ident, taken))
        else:
            name = f"{self._name}-{ident}"
            self._tasks[ident] = asyncio.create_task(self._run(ident, command), name=name)


class DecodeMany(Many[worker_pb2.DecodeCommand, worker_pb2.DecodeEvent, worker_pb2.DecodeBatch]):
    """One ``DecodeMany`` call: its streams' tasks and the batches it sends."""

    _name = "pdorch-decode-many"
    _noun = "stream"

    def __init__(self, decode: Decoder, count: Count) -> None:
        super().__init__()
        self._decode = decode
        self._count = count
        self._unsent: dict[int, worker_pb2.DecodeEvent] = {}
        """Each stream's chunk event not yet in a batch, which a later chunk joins."""

    def _parse(self, command: worker_pb2.DecodeCommand) -> tuple[int, str | None]:
        return command.stream, command.WhichOneof("command")

    def _refusal(self, ident: int, refused: StreamAborted) -> worker_pb2.DecodeEvent:
        return refused.event(ident)

    def _pack(self, events: list[worker_pb2.DecodeEvent]) -> Iterator[worker_pb2.DecodeBatch]:
        return batches(events, _decode_batch)

    def _sent(self) -> None:
        self._unsent.clear()

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

    async def _run(self, sid: int, command: worker_pb2.DecodeCommand) -> None:
        request = command.start
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
            if self._own(sid):
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
            self._done(sid)
