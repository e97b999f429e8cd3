"""The worker's side of ``DecodeMany`` without gRPC (`workers.mux`): what a batch holds when
the orchestrator reads late, and how batches are cut."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.api.many import MAX_BATCH_BYTES, BadCommand
from orchestrator.api.undecodable import Undecodable
from orchestrator.workers import mux
from orchestrator.workers.host import Context
from orchestrator.workers.mux import DecodeMany

LIMIT_S = 10.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


async def decode(
    request: worker_pb2.DecodeRequest, _context: Context
) -> AsyncIterator[worker_pb2.TokenChunk]:
    """Token i at index i, from ``generated`` to ``max_tokens``, one per loop turn."""
    for index in range(request.generated, request.max_tokens):
        await asyncio.sleep(0)
        yield worker_pb2.TokenChunk(index=index, token_ids=[index], text=f"<{index}>")
    yield worker_pb2.TokenChunk(
        index=request.max_tokens, finish_reason=common_pb2.FINISH_REASON_LENGTH
    )


def start(sid: int, max_tokens: int) -> worker_pb2.DecodeCommand:
    request = worker_pb2.DecodeRequest(
        request_id=f"r{sid}", epoch=1, generated=1, max_tokens=max_tokens, flush_ms=0
    )
    return worker_pb2.DecodeCommand(stream=sid, start=request)


async def commands(
    *items: worker_pb2.DecodeCommand | Undecodable,
) -> AsyncIterator[worker_pb2.DecodeCommand | Undecodable]:
    for item in items:
        yield item
    await asyncio.Event().wait()  # the orchestrator keeps its side open


def test_an_orchestrator_reading_late_gets_one_merged_chunk_per_stream_not_a_backlog() -> None:
    """Three streams decode while nobody reads the call: the batch then holds, per stream,
    its first chunk alone (its shape is the orchestrator's to complete) and one chunk with
    every later token, in order, ended — what a blocked ``Decode`` call would send."""

    async def main() -> None:
        many = DecodeMany(decode, lambda chunk: chunk)
        batches = many.serve(commands(start(1, 40), start(2, 40), start(3, 40)))
        first = await anext(batches)  # the call is served from here on
        await asyncio.sleep(0.2)  # every stream has finished meanwhile, unread
        events = list(first.events)
        while not all(any(e.stream == s and e.ended for e in events) for s in (1, 2, 3)):
            events += (await anext(batches)).events
        for sid in (1, 2, 3):
            mine = [e for e in events if e.stream == sid]
            assert len(mine) <= 3, mine  # not one per token
            assert list(mine[0].chunk.token_ids) == [1]  # the first, alone
            tokens = [t for e in mine for t in e.chunk.token_ids]
            assert tokens == list(range(1, 40))  # contiguous, no duplicate
            assert mine[-1].ended
            assert mine[-1].chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert "".join(e.chunk.text for e in mine) == "".join(f"<{i}>" for i in range(1, 40))
        await batches.aclose()

    run(main())


def test_a_large_backlog_is_cut_into_batches_under_the_message_limit() -> None:
    events = [
        worker_pb2.DecodeEvent(stream=i, chunk=worker_pb2.TokenChunk(index=0, text="x" * 100_000))
        for i in range(25)
    ]
    batches = list(mux.batches(events, mux._decode_batch))
    assert len(batches) >= 3
    assert all(b.ByteSize() <= MAX_BATCH_BYTES for b in batches)
    assert [e.stream for b in batches for e in b.events] == list(range(25))  # order kept
    small = list(mux.batches(events[:2], mux._decode_batch))
    assert len(small) == 1


def test_an_undecodable_command_refuses_the_call_and_stops_its_streams() -> None:
    async def main() -> None:
        many = DecodeMany(decode, lambda chunk: chunk)
        bad = Undecodable("String field had bad UTF-8")
        batches = many.serve(commands(start(1, 10_000), bad))

        async def drain() -> None:
            while True:
                await anext(batches)

        with pytest.raises(BadCommand, match="bad UTF-8"):
            await drain()
        assert not many._tasks  # the stream it had started is cancelled

    run(main())


def test_an_empty_or_repeated_command_is_refused_and_touches_no_other() -> None:
    """A command that starts nothing, or starts a stream already running, is answered with
    that stream's failure (INVALID_ARGUMENT; ALREADY_EXISTS for the repeated start, so the
    client can tell it from the running stream's end); the running one goes on."""

    async def main() -> None:
        many = DecodeMany(decode, lambda chunk: chunk)
        empty = worker_pb2.DecodeCommand(stream=7)
        batches = many.serve(commands(start(1, 30), empty, start(1, 30)))
        events: list[worker_pb2.DecodeEvent] = []
        while not any(e.stream == 1 and e.ended for e in events):
            events += (await anext(batches)).events
        refused = {(e.stream, e.failure.code) for e in events if e.HasField("failure")}
        assert refused == {(7, 3), (1, 6)}  # INVALID_ARGUMENT, ALREADY_EXISTS
        tokens = [t for e in events if e.stream == 1 for t in e.chunk.token_ids]
        assert tokens == list(range(1, 30))
        await batches.aclose()

    run(main())
