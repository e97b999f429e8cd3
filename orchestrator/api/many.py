"""Many streams on one call: the server's side of a bidirectional "many" call.

A client that runs many streams (or calls) at once starts and cancels them with commands
on one call, and the server answers with batches, each carrying the events of every
stream that had one at that moment: what costs both ends is the messages, not what they
carry. `Many` runs such a call — commands read in a task of their own, each starting a
task; a cancel command cancelling its task; events gathered into batches; drain; the
call's end cancelling whatever is left. Its subclasses say what a command starts and how
events are packed: the workers' ``DecodeMany`` and ``CallMany``
(`orchestrator.workers.mux`, `orchestrator.workers.calls`) and the client API's
``GenerateMany`` (`orchestrator.rpc.many`).

Each task fails alone: a `StreamContext` stands in for its own call's context, whose
abort fails that task (`StreamAborted`: a failure event with the status its own call would
have ended with), not the call it shares. A command protobuf cannot parse fails the whole
call (`BadCommand`: refused INVALID_ARGUMENT by the servicer, `api.undecodable.refuse`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import grpc

from orchestrator.aio import cancel_and_wait
from orchestrator.api import worker_pb2
from orchestrator.api.undecodable import Undecodable, refuse

__all__ = [
    "MAX_BATCH_BYTES",
    "BadCommand",
    "Many",
    "StreamAborted",
    "StreamContext",
    "batches",
    "served",
]

log = logging.getLogger(__name__)

CommandT = TypeVar("CommandT")
EventT = TypeVar("EventT")
BatchT = TypeVar("BatchT")


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

    async def serve(self, commands: AsyncIterator[Any]) -> AsyncGenerator[BatchT, None]:
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
                    self._written()
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
    _draining_details = "worker is draining"
    """A refusal's details while the call drains."""

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

    def _written(self) -> None:
        """The batches of those events were handed to gRPC and written (a subclass lets the
        tasks that waited for them go on)."""

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
            refused = StreamAborted(grpc.StatusCode.UNAVAILABLE, self._draining_details, ())
            self._emit(self._refusal(ident, refused))
        elif ident in self._tasks:
            # ALREADY_EXISTS, not the running one's failure: it goes on, this start is refused.
            taken = StreamAborted(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{self._noun} {ident} is already running: this start is refused, the "
                "running one goes on",
                (),
            )
            self._emit(self._refusal(ident, taken))
        else:
            name = f"{self._name}-{ident}"
            self._tasks[ident] = asyncio.create_task(self._run(ident, command), name=name)


async def served(
    method: str,
    many: Many[Any, Any, BatchT],
    commands: AsyncIterator[Any],
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncGenerator[BatchT, None]:
    """``many``'s batches as a servicer yields them: its tasks cancelled as soon as the call
    is over (whether or not gRPC resumes the generator to run its cleanup), and a command
    protobuf could not parse refusing the call (``INVALID_ARGUMENT``)."""

    def abandon(_context: object) -> None:
        many.abandon()

    done: Any = abandon  # the stubs want their DoneCallback class; any callable does
    context.add_done_callback(done)
    try:
        async for batch in many.serve(commands):
            yield batch
    except BadCommand as exc:
        await refuse(method, exc.request, context)
