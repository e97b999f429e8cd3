"""A client of ``GenerateMany``: many requests on one call, each read as a ``Generate`` stream.

`ManyClient.generate` starts a request on the call (opened at first use, opened again after
one ended) and yields its `GenerateChunk`s; its failure raises `StreamFailed` with the
status code, details and trailing metadata its ``Generate`` call would have ended with. The
call failing (the orchestrator gone, the connection cut) fails every request on it with the
call's status — each can be resumed (``resume_from_index``) as a broken ``Generate``
stream. Leaving a request's iteration early sends a stop: the request detaches as a
cancelled ``Generate`` call's does. A request's wait is bounded: its ``timeout_s`` goes to
the orchestrator with it, and the client gives up a second after it if nothing ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from orchestrator.api import orchestrator_pb2
from orchestrator.api.protocol import ACCEPTED_KEY

__all__ = ["ManyClient", "StreamFailed", "status_of"]

log = logging.getLogger(__name__)

LATE_S = 1.0
"""How long past a request's timeout the client waits for the orchestrator to end it."""

Event = orchestrator_pb2.GenerateEvent


class StreamFailed(Exception):
    """A request on the call failed, or the call did: what its ``Generate`` call would
    have ended with."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing = trailing

    @classmethod
    def of(cls, failure: orchestrator_pb2.StreamFailure) -> StreamFailed:
        code = _CODES.get(failure.code, grpc.StatusCode.UNKNOWN)
        return cls(code, failure.details, tuple(sorted(failure.trailing.items())))


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_of(exc: grpc.aio.AioRpcError | StreamFailed) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a ``Generate`` call's error or of a request's on a
    ``GenerateMany`` call, alike."""
    if isinstance(exc, StreamFailed):
        return exc.code, exc.details
    return exc.code(), exc.details() or ""


def accepted(initial: Any) -> bool:
    """Whether a ``GenerateMany`` call's initial metadata says the orchestrator took it
    (`api.protocol.ACCEPTED_KEY`; a refused call has none)."""
    return any(key == ACCEPTED_KEY for key, _ in initial or ())


class _Call:
    """One open ``GenerateMany`` call: the commands it sends, the requests it feeds."""

    def __init__(
        self,
        open_call: Callable[[AsyncIterator[Any]], Any],
        ended: Callable[[_Call], None],
        counted: Callable[[], None],
    ) -> None:
        self._counted = counted
        self._commands: asyncio.Queue[orchestrator_pb2.GenerateCommand | None] = asyncio.Queue()
        self.streams: dict[int, asyncio.Queue[Event | StreamFailed]] = {}
        self.closed = False
        self._next = 0
        self._ended = ended
        self._rpc = open_call(self._outgoing())
        self._reader = asyncio.create_task(self._read(), name="pdorch-generate-many")

    def start(
        self, request: orchestrator_pb2.GenerateRequest, timeout_s: float
    ) -> tuple[int, asyncio.Queue[Event | StreamFailed]]:
        sid, self._next = self._next, self._next + 1
        feed = self.streams[sid] = asyncio.Queue()
        command = orchestrator_pb2.GenerateCommand(stream=sid, start=request, timeout_s=timeout_s)
        self._commands.put_nowait(command)
        return sid, feed

    def stop(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None and not self.closed:
            stop = orchestrator_pb2.GenerateStop()
            self._commands.put_nowait(orchestrator_pb2.GenerateCommand(stream=sid, stop=stop))

    async def close(self) -> None:
        self._rpc.cancel()
        await asyncio.wait({self._reader})

    async def _outgoing(self) -> AsyncIterator[orchestrator_pb2.GenerateCommand]:
        """The commands, once the orchestrator accepted the call (its initial metadata):
        a command written while it refuses the call (a credential it does not take) would
        make grpc.aio report INTERNAL instead of the refusal (grpc/grpc#36066)."""
        if not accepted(await self._rpc.initial_metadata()):
            return  # refused: its status is the call's
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        error = StreamFailed(grpc.StatusCode.UNAVAILABLE, "the orchestrator ended the call")
        try:
            async for batch in self._rpc:
                self._counted()
                for event in batch.events:
                    feed = self.streams.get(event.stream)
                    if feed is None:
                        continue  # stopped meanwhile
                    if event.HasField("failure") or event.ended:
                        del self.streams[event.stream]
                    feed.put_nowait(event)
        except grpc.aio.AioRpcError as exc:
            error = StreamFailed(exc.code(), exc.details() or "", ())
        except asyncio.CancelledError:
            error = StreamFailed(grpc.StatusCode.CANCELLED, "the client closed the call")
            raise
        except Exception as exc:  # noqa: BLE001 - a batch we cannot read: the call is done
            log.warning("a GenerateMany call failed: %r", exc)
            error = StreamFailed(grpc.StatusCode.UNAVAILABLE, f"the call failed: {exc!r}")
        finally:
            self._rpc.cancel()
            self.closed = True
            self._ended(self)
            streams, self.streams = list(self.streams.values()), {}
            for feed in streams:
                feed.put_nowait(error)
            self._commands.put_nowait(None)


class ManyClient:
    """Requests on one ``GenerateMany`` call of a channel (`rpc.client.channel`)."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._call: _Call | None = None
        self.batches = 0
        """Batches read, on every call so far (each one message, whatever it carried)."""

    async def generate(
        self, request: orchestrator_pb2.GenerateRequest, timeout_s: float = 0.0
    ) -> AsyncGenerator[orchestrator_pb2.GenerateChunk, None]:
        """``request``'s chunks, as its ``Generate`` stream would bring them (``timeout_s``:
        its deadline, 0 none); its failure raises `StreamFailed`."""
        call = self._current()
        sid, feed = call.start(request, timeout_s)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s + LATE_S if timeout_s > 0 else None
        try:
            while True:
                try:
                    async with asyncio.timeout_at(give_up):
                        item = await feed.get()
                except TimeoutError:
                    late = "the orchestrator did not end the request by its deadline"
                    raise StreamFailed(grpc.StatusCode.DEADLINE_EXCEEDED, late) from None
                if isinstance(item, StreamFailed):
                    raise item
                if item.HasField("chunk"):
                    yield item.chunk
                if item.HasField("failure"):
                    raise StreamFailed.of(item.failure)
                if item.ended:
                    return
        finally:
            call.stop(sid)

    async def close(self) -> None:
        """Cancel the call: what is still on it fails (CANCELLED)."""
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.close()

    def _current(self) -> _Call:
        if self._call is None or self._call.closed:
            self._call = _Call(self._stub.GenerateMany, self._forget, self._count)
        return self._call

    def _count(self) -> None:
        self.batches += 1

    def _forget(self, call: _Call) -> None:
        if self._call is call:
            self._call = None
