"""``GenerateMany`` without a gRPC server: the orchestrator's side (`rpc.many`) — a slow
reader holds its requests back, a request's end joins its last chunk — and the client's
(`rpc.many_client`) — the call failing fails every request on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, ClassVar

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import orchestrator_pb2 as pb
from orchestrator.api.many import StreamAborted
from orchestrator.api.protocol import ACCEPTED_KEY
from orchestrator.control.orchestrator import GenerateInput, OutChunk, Sink
from orchestrator.rpc import service
from orchestrator.rpc.many import GenerateMany
from orchestrator.rpc.many_client import ManyClient, StreamFailed

LIMIT_S = 10.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class Producer:
    """A request that has ``tokens`` chunks ready at once, counting those taken; ``sunk``:
    all but the last handed to the sink, as a drive does (else yielded, as a follower's)."""

    def __init__(self, tokens: int, *, sunk: bool = False) -> None:
        self.tokens = tokens
        self.sunk = sunk
        self.taken: dict[str, int] = {}

    async def generate(
        self, inp: GenerateInput, sink: Sink | None = None
    ) -> AsyncIterator[OutChunk]:
        rid = inp.request_id
        for i in range(self.tokens):
            self.taken[rid] = i + 1
            last = i == self.tokens - 1
            chunk = OutChunk(rid, i, [i], f"t{i}", "length" if last else "")
            if self.sunk and sink is not None and not last:
                sink(chunk)
            else:
                yield chunk
            await asyncio.sleep(0)


def aborted(exc: errors.PdorchError) -> StreamAborted:
    raise AssertionError(f"no error expected: {exc}")


def many(producer: Producer) -> GenerateMany:
    def input_of(req: pb.GenerateRequest, until: float | None) -> GenerateInput:
        return service._input(req, "default", until)

    return GenerateMany(producer.generate, input_of, service._fill_chunk, aborted)


async def commands(n: int, stop: asyncio.Event) -> AsyncIterator[pb.GenerateCommand]:
    for i in range(n):
        start = pb.GenerateRequest(request_id=f"r{i}", text="x", max_tokens=10_000)
        yield pb.GenerateCommand(stream=i, start=start)
    await stop.wait()


def test_a_reader_that_stops_reading_holds_its_requests_back() -> None:
    """A request has at most one event the call has not written: with the batches' writer
    stalled (gRPC's flow control, a client that reads nothing), its requests stop being
    read from the orchestrator instead of their chunks queueing here."""

    async def main() -> None:
        producer = Producer(10_000)
        call = many(producer)
        stop = asyncio.Event()
        batches = call.serve(commands(3, stop))
        first = await anext(batches)  # then the writer stalls: the next is not asked for
        assert first.events
        for _ in range(200):
            await asyncio.sleep(0)
        assert len(producer.taken) == 3
        assert all(n <= 3 for n in producer.taken.values()), producer.taken
        assert len(call._events) <= 3  # one per request
        # reading again lets them go on
        seen = {e.stream: e.chunk.index for e in first.events}
        for _ in range(20):
            batch = await anext(batches)
            for event in batch.events:
                if event.HasField("chunk"):
                    assert event.chunk.index == seen.get(event.stream, -1) + 1  # in order
                    seen[event.stream] = event.chunk.index
        assert max(producer.taken.values()) > 10
        stop.set()
        await batches.aclose()

    run(main())


def test_chunks_handed_out_while_the_reader_stalls_are_joined_into_one_per_request() -> None:
    """The drive never waits for a client: what it hands a request whose event is unwritten
    is joined into one held chunk (contiguous tokens at one index), so a stalled reader
    costs a request one event and one chunk, and gets every token, in order, when it reads."""

    async def main() -> None:
        producer = Producer(3000, sunk=True)
        call = many(producer)
        stop = asyncio.Event()
        batches = call.serve(commands(3, stop))
        first = await anext(batches)  # then the writer stalls
        for _ in range(400):
            await asyncio.sleep(0)
        assert all(n > 100 for n in producer.taken.values()), producer.taken  # it went on
        assert len(call._events) <= 3  # one event per request
        assert sorted(call._held) == [0, 1, 2]
        assert all(len(h.token_ids) > 50 for h in call._held.values())
        tokens: dict[int, list[int]] = {}
        second = await anext(batches)
        assert sorted(e.stream for e in second.events) == [0, 1, 2]
        assert all(len(e.chunk.token_ids) > 50 for e in second.events)  # each joined
        events = [*first.events, *second.events]
        while sum(e.ended for e in events) < 3:
            events.extend((await anext(batches)).events)
        for event in events:
            if event.HasField("chunk"):
                assert event.chunk.index == len(tokens.setdefault(event.stream, []))
                tokens[event.stream].extend(event.chunk.token_ids)
        assert tokens == {i: list(range(3000)) for i in range(3)}
        assert [e.chunk.finish_reason != 0 for e in events if e.ended] == [True] * 3
        stop.set()
        await batches.aclose()

    run(main())


def test_a_requests_end_joins_its_last_chunk() -> None:
    async def main() -> None:
        producer = Producer(3)
        call = many(producer)
        stop = asyncio.Event()
        events: list[pb.GenerateEvent] = []
        batches = call.serve(commands(1, stop))
        async for batch in batches:
            events.extend(batch.events)
            if any(e.ended for e in batch.events):
                break
        await batches.aclose()
        assert [e.chunk.index for e in events] == [0, 1, 2]
        assert events[-1].ended
        assert events[-1].chunk.finish_reason != 0
        assert not any(e.ended for e in events[:-1])

    run(main())


class FakeCall:
    """A ``GenerateMany`` call that brings ``batches`` (built from the commands it was sent),
    then fails with ``code``."""

    opened = 0

    def __init__(self, outgoing: AsyncIterator[pb.GenerateCommand], code: grpc.StatusCode) -> None:
        FakeCall.opened += 1
        self.outgoing = outgoing
        self.code = code
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((ACCEPTED_KEY, "1"),)

    def __aiter__(self) -> AsyncIterator[pb.GenerateBatch]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[pb.GenerateBatch]:
        started = [await anext(self.outgoing) for _ in range(2)]
        chunk = pb.GenerateChunk(index=0, token_ids=[7])
        yield pb.GenerateBatch(
            events=[pb.GenerateEvent(stream=c.stream, chunk=chunk) for c in started]
        )
        empty = grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(self.code, empty, empty, "gone", None)


class FakeStub:
    def GenerateMany(self, outgoing: AsyncIterator[pb.GenerateCommand]) -> FakeCall:
        return FakeCall(outgoing, grpc.StatusCode.UNAVAILABLE)


def test_the_call_failing_fails_every_request_on_it_and_the_next_opens_another() -> None:
    async def main() -> None:
        client = ManyClient(FakeStub())

        async def one(rid: str) -> tuple[list[int], grpc.StatusCode]:
            seen: list[int] = []
            try:
                async for chunk in client.generate(pb.GenerateRequest(request_id=rid), 5.0):
                    seen.extend(chunk.token_ids)
            except StreamFailed as exc:
                return seen, exc.code
            raise AssertionError("the request did not fail")

        FakeCall.opened = 0
        results = await asyncio.gather(one("a"), one("b"))
        assert list(results) == [([7], grpc.StatusCode.UNAVAILABLE)] * 2  # the call's status
        assert client.batches == 1
        await asyncio.gather(one("c"), one("d"))
        assert FakeCall.opened == 2  # the failed call was forgotten: a new one opened
        await client.close()

    run(main())


class RefusedCall(FakeCall):
    """A call the orchestrator refuses (no initial metadata but its status): what the
    client tried to write is recorded."""

    written: ClassVar[list[pb.GenerateCommand]] = []

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def _batches(self) -> AsyncIterator[pb.GenerateBatch]:
        RefusedCall.written = [c async for c in self.outgoing]
        if self.code != grpc.StatusCode.OK:
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(self.code, empty, empty, "no credential", None)
        yield pb.GenerateBatch()


class RefusingStub:
    def GenerateMany(self, outgoing: AsyncIterator[pb.GenerateCommand]) -> FakeCall:
        return RefusedCall(outgoing, grpc.StatusCode.UNAUTHENTICATED)


def test_the_client_writes_nothing_on_a_call_the_orchestrator_did_not_accept() -> None:
    """A command written while the call is refused makes grpc.aio report INTERNAL instead
    of the refusal (grpc/grpc#36066): the client writes only once the call is accepted."""

    async def main() -> None:
        client = ManyClient(RefusingStub())
        with pytest.raises(StreamFailed) as refused:
            async for _ in client.generate(pb.GenerateRequest(request_id="x"), 5.0):
                pass
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert RefusedCall.written == []
        await client.close()

    run(main())
