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

import grpc

from orchestrator.api import worker_pb2
from orchestrator.api.many import BadCommand, Many, StreamAborted, StreamContext, batches
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

Decoder = Callable[[worker_pb2.DecodeRequest, Context], AsyncIterator[worker_pb2.TokenChunk]]
"""A host's decode (`host.EngineHost.decode`)."""
Count = Callable[[worker_pb2.TokenChunk], worker_pb2.TokenChunk]
"""The worker's count of what a chunk carries (returns the chunk)."""


def _decode_batch(events: list[worker_pb2.DecodeEvent]) -> worker_pb2.DecodeBatch:
    return worker_pb2.DecodeBatch(events=events)


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
