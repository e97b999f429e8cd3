"""Many unary calls on one call: the worker's side of ``CallMany``.

A unary gRPC call costs a replica ~200–350 µs of CPU where a message on a call already open
costs ~110–135 (README, "A request's fixed cost"), and every request makes two: its
``Tokenize`` and its ``Prefill``. A replica sends both to this worker as commands on one
``CallMany`` call instead; each runs here as its unary call would — the same servicer body
(`Unary`: validation, then the host), in a task of its own, with a `StreamContext` whose
abort fails that call only — and its reply (the response, or the failure with the status,
details and trailing metadata the unary call would have ended with) goes back in a
`CallBatch` with the other replies ready at that moment.

The commands, their cancels, the call's end and drain are `mux.Many`'s (as ``DecodeMany``):
a cancelled call's task is cancelled and no reply follows; the call ending cancels every
call left on it; a draining worker refuses new calls (UNAVAILABLE) and ends the call once
its last one has. The orchestrator keeps each call's deadline (it cancels the call).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator

import grpc

from orchestrator.api import worker_pb2
from orchestrator.core.idents import shown
from orchestrator.workers.host import Context
from orchestrator.workers.mux import Many, StreamAborted, StreamContext, batches

__all__ = ["CallMany", "Unary"]

log = logging.getLogger(__name__)


class Unary:
    """The unary calls ``CallMany`` carries: the servicers' bodies, given by the worker."""

    def __init__(
        self,
        tokenize: Callable[
            [worker_pb2.TokenizeRequest, Context], Awaitable[worker_pb2.TokenizeResponse]
        ],
        prefill: Callable[
            [worker_pb2.PrefillRequest, Context], Awaitable[worker_pb2.PrefillResponse]
        ],
    ) -> None:
        self.tokenize = tokenize
        self.prefill = prefill


class CallMany(Many[worker_pb2.CallCommand, worker_pb2.CallReply, worker_pb2.CallBatch]):
    """One ``CallMany`` call: its calls' tasks and the batches of their replies."""

    _name = "pdorch-call-many"
    _noun = "call"

    def __init__(self, unary: Unary) -> None:
        super().__init__()
        self._unary = unary

    def _unpack(self, message: worker_pb2.CallCommands) -> Iterable[worker_pb2.CallCommand]:
        return message.commands

    def _parse(self, command: worker_pb2.CallCommand) -> tuple[int, str | None]:
        return command.call, command.WhichOneof("command")

    def _refusal(self, ident: int, refused: StreamAborted) -> worker_pb2.CallReply:
        return worker_pb2.CallReply(call=ident, failure=refused.failure())

    def _pack(self, events: list[worker_pb2.CallReply]) -> Iterator[worker_pb2.CallBatch]:
        return batches(events, _call_batch)

    async def _run(self, cid: int, command: worker_pb2.CallCommand) -> None:
        reply = worker_pb2.CallReply(call=cid)
        try:
            try:
                if command.HasField("prefill"):
                    answer = await self._unary.prefill(command.prefill, StreamContext())
                    reply.prefill.CopyFrom(answer)
                else:
                    said = await self._unary.tokenize(command.tokenize, StreamContext())
                    reply.tokenize.CopyFrom(said)
            except StreamAborted as exc:
                reply = self._refusal(cid, exc)
            except Exception as exc:  # what an unhandled error in a unary call would be
                rid = command.prefill.request_id if command.HasField("prefill") else ""
                log.exception(
                    "a %s call failed%s",
                    command.WhichOneof("command"),
                    f" (request {shown(rid)})" if rid else "",
                )
                failed = StreamAborted(
                    grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}", ()
                )
                reply = self._refusal(cid, failed)
            self._emit(reply)
        except asyncio.CancelledError:
            if self._own(cid):  # the host's own cancel: a unary call would end CANCELLED
                lost = StreamAborted(grpc.StatusCode.CANCELLED, "the call was cancelled", ())
                self._emit(self._refusal(cid, lost))
            raise
        finally:
            self._done(cid)


def _call_batch(replies: list[worker_pb2.CallReply]) -> worker_pb2.CallBatch:
    return worker_pb2.CallBatch(replies=replies)
