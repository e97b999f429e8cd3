"""Many unary calls on one call: the orchestrator's side of ``CallMany``.

Every request makes two unary calls to workers — ``Tokenize`` and ``Prefill`` — and a unary
gRPC call costs a replica ~200–350 µs of CPU where a message on a call already open costs
~110–135 (README, "A request's fixed cost"). A `CallMux` keeps one ``CallMany`` call per
worker and sends each call as a command on it; the worker answers each with one reply,
batched with the others ready at the same moment (`orchestrator.workers.calls`).

A `Pending` reads as the unary call does: awaited, it returns the response or raises the
`grpc.aio.AioRpcError` that call would have raised (code, details, trailing metadata — so
`clients.translated` and failover see no difference), ``DEADLINE_EXCEEDED`` once its
deadline passed (kept here: the worker is told to stop). Cancelled (`Pending.cancel`, or
the task awaiting it cancelled), the worker stops that call. The call failing fails every
call on it with an error failover retries (`mux.call_failed`: a killed worker is
UNAVAILABLE); the next call opens a new one. A worker that does not serve ``CallMany`` (an
older version: UNIMPLEMENTED, before anything ran) fails its calls with `mux.Unsupported`;
the caller then makes the unary call (`legs`), and that worker's mux is not tried again for
`mux.RETRY_UNSUPPORTED_S`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Generator
from typing import Any, Generic, TypeVar

import grpc

from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.control.mux import (
    SharedCall,
    SharedCalls,
    copy_error,
    failure_error,
    status_error,
)

__all__ = ["CallMux", "Pending"]

log = logging.getLogger(__name__)

ResponseT = TypeVar("ResponseT")


class Pending(Generic[ResponseT]):
    """One unary call on a shared ``CallMany``: await it as the call itself."""

    __slots__ = ("_call", "_kind", "_timer", "cid", "future")

    def __init__(self, call: _Call, cid: int, kind: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._call = call
        self.cid = cid
        self._kind = kind
        self.future: asyncio.Future[ResponseT] = loop.create_future()
        self._timer = loop.call_later(timeout_s, self._expire)
        self.future.add_done_callback(self._settled)

    def __await__(self) -> Generator[Any, None, ResponseT]:
        return self.future.__await__()

    def cancel(self) -> None:
        """Stop the call: the worker cancels it, and awaiting it raises CancelledError."""
        self.future.cancel()

    def _settled(self, future: asyncio.Future[ResponseT]) -> None:
        self._timer.cancel()
        if future.cancelled():
            self._call.cancel(self.cid)

    def _expire(self) -> None:
        if not self.future.done():
            self._call.cancel(self.cid)
            self.future.set_exception(
                status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            )

    def _reply(self, reply: worker_pb2.CallReply) -> None:
        if self.future.done():
            return
        which = reply.WhichOneof("reply")
        if which == "failure":
            self.future.set_exception(failure_error(reply.failure))
        elif which == self._kind:
            self.future.set_result(getattr(reply, which))
        else:  # a worker answering another kind is broken: as a call it could not read
            wrong = f"the worker answered a {self._kind} call with {which or 'nothing'}"
            self.future.set_exception(status_error(grpc.StatusCode.INTERNAL, wrong))

    def _fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class _Call(SharedCall[worker_pb2.CallCommand, worker_pb2.CallBatch]):
    """One ``CallMany`` call: the commands it sends, the calls its replies settle."""

    method = "CallMany"

    def __init__(self, mux: CallMux, stub: worker_pb2_grpc.WorkerServiceAsyncStub) -> None:
        self._mux = mux
        self.pending: dict[int, Pending[Any]] = {}
        self._next = 0
        super().__init__(stub.CallMany)

    def send(self, kind: str, command: worker_pb2.CallCommand, timeout_s: float) -> Pending[Any]:
        cid, self._next = self._next, self._next + 1
        command.call = cid
        pending: Pending[Any] = Pending(self, cid, kind, timeout_s)
        self.pending[cid] = pending
        self._send(command)
        return pending

    def cancel(self, cid: int) -> None:
        if self.pending.pop(cid, None) is not None and not self.closed:
            cancel = worker_pb2.CallCancel()
            self._send(worker_pb2.CallCommand(call=cid, cancel=cancel))

    async def _outgoing(self) -> AsyncIterator[worker_pb2.CallCommands]:
        """Every command queued at one moment in one message (a burst's calls share it)."""
        while (command := await self._commands.get()) is not None:
            message = worker_pb2.CallCommands(commands=[command])
            last = False
            while not last and not self._commands.empty():
                if (more := self._commands.get_nowait()) is None:
                    last = True
                else:
                    message.commands.append(more)
            self._mux.messages_sent += 1
            yield message
            if last:
                return

    def _take(self, batch: worker_pb2.CallBatch) -> None:
        self._mux.batches += 1
        for reply in batch.replies:
            pending = self.pending.pop(reply.call, None)
            if pending is not None:  # else: cancelled or expired meanwhile
                pending._reply(reply)

    def _ended(self, error: BaseException) -> None:
        self._mux._ended(self, error)
        left, self.pending = list(self.pending.values()), {}
        for call in left:
            call._fail(copy_error(error))


class CallMux(SharedCalls[_Call]):
    """The unary calls this replica makes to one worker, on one ``CallMany`` at a time."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceAsyncStub) -> None:
        super().__init__(lambda: _Call(self, stub), "unary calls")
        self.messages_sent = 0
        """Messages of commands sent (each carrying every command queued at that moment)."""
        self.batches = 0
        """Batches of replies read."""

    def tokenize(
        self, request: worker_pb2.TokenizeRequest, timeout_s: float
    ) -> Pending[worker_pb2.TokenizeResponse]:
        command = worker_pb2.CallCommand(tokenize=request)
        return self._current().send("tokenize", command, timeout_s)

    def prefill(
        self, request: worker_pb2.PrefillRequest, timeout_s: float
    ) -> Pending[worker_pb2.PrefillResponse]:
        command = worker_pb2.CallCommand(prefill=request)
        return self._current().send("prefill", command, timeout_s)
