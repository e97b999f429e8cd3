"""Many requests on one call: the orchestrator's side of ``GenerateMany``.

A client that runs many requests at once (a gateway, a router, a batch driver) pays the
orchestrator per *message*: each relayed chunk of a ``Generate`` call is one gRPC write,
~90 µs of a replica's CPU whatever it carries. On a ``GenerateMany`` call one message — a
`GenerateBatch` — carries the chunks of every request on the call that had one at that
moment; chunks released together (one journal write acknowledges many requests' chunks)
leave together.

Each request runs as its own ``Generate`` call would, in a task of its own: the same
`Orchestrator.generate`, the same tokens, its errors as a failure event with the status,
details and trailing metadata (``retry-after``) that call would have ended with. The call's
tenant (its credential's, or the one ``x-pdorch-tenant`` picks among those allowed) applies
to every request on it. A request's deadline is its command's ``timeout_s`` (and the call's
own, if any): past it the request fails ``DEADLINE_EXCEEDED`` and detaches, as a
``Generate`` call cut by its deadline. A stop command detaches a request as a cancelled
``Generate`` call does (the drive runs on for the detach grace, so it can be resumed); the
call ending detaches every request left on it. Draining (the replica stopping), a call
refuses new requests (``UNAVAILABLE``: resume elsewhere) and ends once its last has.

**The chunks skip the request's task.** Each chunk is handed to the call in the step that
hands it out — the journal's writer's, once it is written (`Orchestrator.generate`'s
``sink``) — where it becomes an event at once; the task wakes only for the request's end
(or a follower's chunks, read from the journal). A
request has at most one event the call has not written yet (two at its end): chunks handed
out meanwhile are *joined* into one held chunk — contiguous tokens, one index — that goes
when the previous event is written. So a slow reader costs a request one growing chunk, not
a queue of messages, and gets its tokens in fewer, larger chunks.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Protocol

import grpc

from orchestrator import errors
from orchestrator.api import orchestrator_pb2
from orchestrator.api.many import Many, StreamAborted, batches
from orchestrator.control.orchestrator import GenerateInput, OutChunk, Sink
from orchestrator.core.idents import shown

__all__ = ["GenerateMany", "ManyCalls", "failure_of", "named"]

log = logging.getLogger(__name__)


class Generate(Protocol):
    """`Orchestrator.generate`."""

    def __call__(self, inp: GenerateInput, sink: Sink | None = None) -> AsyncIterator[OutChunk]: ...


Input = Callable[[orchestrator_pb2.GenerateRequest, float | None], GenerateInput]
"""A request's input, given its deadline (`time.monotonic` seconds; None: none)."""
Fill = Callable[[orchestrator_pb2.GenerateChunk, OutChunk], None]
"""Write an `OutChunk` into a `GenerateChunk` (`rpc.service`)."""


def named(request: orchestrator_pb2.GenerateRequest) -> str:
    """``request``'s id: the client's, else one assigned here and written into ``request``
    before anything can fail, so its input, its chunks and every log line about it carry the
    same id (never ``''``), as the HTTP gateway's requests do (`gateway.parse.request_id`)."""
    if not request.request_id:
        request.request_id = uuid.uuid4().hex
    return request.request_id


def failure_of(aborted: StreamAborted) -> orchestrator_pb2.StreamFailure:
    return orchestrator_pb2.StreamFailure(
        code=aborted.code.value[0], details=aborted.details, trailing=dict(aborted.trailing)
    )


def _batch(events: list[orchestrator_pb2.GenerateEvent]) -> orchestrator_pb2.GenerateBatch:
    return orchestrator_pb2.GenerateBatch(events=events)


def joined(held: OutChunk, chunk: OutChunk) -> OutChunk:
    """``held`` followed by ``chunk`` (the next one of the same request) as one chunk: their
    tokens, text and log-probabilities in order, at ``held``'s index; ``chunk``'s end, if it
    is one. ``held`` is this call's own (a copy, `_hold`): extended in place."""
    held.token_ids.extend(chunk.token_ids)
    held.text += chunk.text
    if chunk.logprobs:
        held.logprobs += chunk.logprobs
    held.prompt_logprobs = held.prompt_logprobs or chunk.prompt_logprobs
    held.prompt_tokens = held.prompt_tokens or chunk.prompt_tokens
    if chunk.finish_reason:
        held.finish_reason, held.timings, held.record = (
            chunk.finish_reason,
            chunk.timings,
            chunk.record,
        )
    return held


class GenerateMany(
    Many[
        orchestrator_pb2.GenerateCommand,
        orchestrator_pb2.GenerateEvent,
        orchestrator_pb2.GenerateBatch,
    ]
):
    """One ``GenerateMany`` call: its requests' tasks and the batches it sends."""

    _name = "pdorch-generate-many"
    _noun = "request"
    _draining_details = "orchestrator shutting down; resume elsewhere"

    def __init__(
        self,
        generate: Generate,
        input_of: Input,
        fill: Fill,
        failed: Callable[[errors.PdorchError], StreamAborted],
        call_deadline: float | None = None,
    ) -> None:
        super().__init__()
        self._generate = generate
        self._input_of = input_of
        self._fill = fill
        self._failed = failed
        self._call_deadline = call_deadline
        self._gathered: dict[int, orchestrator_pb2.GenerateEvent] = {}
        """Each request's event gathered and not yet packed (its end can still join it)."""
        self._writing: set[int] = set()
        """The requests whose event is in the batches being written."""
        self._flushed = asyncio.Event()
        """Set when the batches being written are written (then replaced)."""
        self._held: dict[int, OutChunk] = {}
        """Each request's chunks handed out while its previous event was unwritten, joined."""

    def _parse(self, command: orchestrator_pb2.GenerateCommand) -> tuple[int, str | None]:
        which = command.WhichOneof("command")
        return command.stream, "cancel" if which == "stop" else which

    def _refusal(self, ident: int, refused: StreamAborted) -> orchestrator_pb2.GenerateEvent:
        return orchestrator_pb2.GenerateEvent(stream=ident, failure=failure_of(refused))

    def _pack(
        self, events: list[orchestrator_pb2.GenerateEvent]
    ) -> Iterator[orchestrator_pb2.GenerateBatch]:
        return batches(events, _batch)

    def _sent(self) -> None:
        self._writing = set(self._gathered)
        self._gathered.clear()

    def _written(self) -> None:
        self._writing = set()
        for sid in [sid for sid in self._held if sid not in self._gathered]:
            self._gather(sid, self._held.pop(sid))
        self._flushed.set()
        self._flushed = asyncio.Event()

    def _unwritten(self, sid: int) -> bool:
        return sid in self._gathered or sid in self._writing

    def _gather(self, sid: int, chunk: OutChunk) -> None:
        event = orchestrator_pb2.GenerateEvent(stream=sid)
        self._fill(event.chunk, chunk)
        self._gathered[sid] = event
        self._emit(event)

    def _hand(self, sid: int, chunk: OutChunk) -> None:
        """A chunk handed out (`Sink`): an event now, or held — joined to what this request
        holds — until its previous event is written."""
        held = self._held.get(sid)
        if held is not None:
            joined(held, chunk)
        elif self._unwritten(sid):
            self._held[sid] = self._hold(chunk)
        else:
            self._gather(sid, chunk)

    @staticmethod
    def _hold(chunk: OutChunk) -> OutChunk:
        """A copy to join others to (the same chunk is handed to every client)."""
        held = copy.copy(chunk)
        held.token_ids = list(chunk.token_ids)
        return held

    async def _put(self, sid: int, chunk: OutChunk) -> None:
        """``chunk`` (yielded: the last one, or a follower's) as an event, after what this
        request holds, once its previous event is written."""
        held = self._held.pop(sid, None)
        if held is not None:
            chunk = joined(held, chunk)
        while self._unwritten(sid):
            await self._flushed.wait()
        self._gather(sid, chunk)

    def _end(self, sid: int, failure: StreamAborted | None = None) -> None:
        """The request's end: joined to its last chunk's event if that is not packed yet;
        a failure goes after what the request held."""
        held = self._held.pop(sid, None)
        if held is not None:
            self._gather(sid, held)  # its previous event may be unwritten: two, at the end
        last = self._gathered.get(sid)
        if last is not None and failure is None:
            last.ended = True
            return
        if failure is not None:
            self._emit(orchestrator_pb2.GenerateEvent(stream=sid, failure=failure_of(failure)))
        else:
            self._emit(orchestrator_pb2.GenerateEvent(stream=sid, ended=True))

    def _deadline(self, command: orchestrator_pb2.GenerateCommand) -> float | None:
        own = time.monotonic() + command.timeout_s if command.timeout_s > 0 else None
        deadlines = [d for d in (own, self._call_deadline) if d is not None]
        return min(deadlines) if deadlines else None

    async def _run(self, sid: int, command: orchestrator_pb2.GenerateCommand) -> None:
        request = command.start
        rid = named(request)
        deadline = self._deadline(command)
        loop = asyncio.get_running_loop()
        scope = asyncio.timeout_at(
            None if deadline is None else loop.time() + deadline - time.monotonic()
        )
        try:
            async with scope:
                inp = self._input_of(request, deadline)
                async for chunk in self._generate(inp, partial(self._hand, sid)):
                    await self._put(sid, chunk)
            self._end(sid)
        except TimeoutError:
            if scope.expired():
                late = StreamAborted(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())
                self._end(sid, late)
            else:
                self._bug(sid, request)
        except errors.PdorchError as exc:
            log.info("request %s failed: %s", shown(rid), exc)
            self._end(sid, self._failed(exc))
        except asyncio.CancelledError:
            if self._own(sid):  # not the client's stop nor the call's end
                lost = StreamAborted(grpc.StatusCode.CANCELLED, "the request was cancelled", ())
                self._end(sid, lost)
            raise
        except Exception:  # noqa: BLE001 - a bug: `_bug` logs it, the client sees INTERNAL
            self._bug(sid, request)
        finally:
            self._held.pop(sid, None)  # stopped, or the call ended: nobody reads them
            self._done(sid)

    def _bug(self, sid: int, request: orchestrator_pb2.GenerateRequest) -> None:
        """An error no rule maps: logged with the request, never shown to the client."""
        log.exception("request %s: GenerateMany stream failed", shown(request.request_id))
        self._end(sid, StreamAborted(grpc.StatusCode.INTERNAL, "internal error", ()))


class ManyCalls:
    """The replica's open ``GenerateMany`` calls, drained together when it stops."""

    def __init__(self) -> None:
        self._calls: set[GenerateMany] = set()
        self.draining = False

    def add(self, call: GenerateMany) -> None:
        self._calls.add(call)
        if self.draining:
            call.drain()

    def discard(self, call: GenerateMany) -> None:
        self._calls.discard(call)

    def drain(self) -> None:
        """Every call refuses new requests and ends once its last has."""
        self.draining = True
        for call in self._calls:
            call.drain()
