"""The journal writer's group commit (`control.journal`): many streams' chunks, one write.

Against `MemoryStore` (one `append_many` is one round trip there too) with `Run`s driven
directly: no workers. Checks that batching keeps what the per-chunk writer guaranteed —
contiguous journals, a refusal confined to its own request, nothing counted as journalled
that a failed write did not store — and that it does batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Coroutine, Mapping, Sequence
from typing import Any, cast

import pytest

from orchestrator import errors
from orchestrator.api import common_pb2, worker_pb2
from orchestrator.control.failover import Failover
from orchestrator.control.journal import JournalWriter
from orchestrator.control.leases import LeaseKeeper
from orchestrator.control.ledger import Ledger
from orchestrator.control.local import Local
from orchestrator.control.relay import Relay
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import JournalEntry
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge, State
from orchestrator.store.memory import MemoryStore
from orchestrator.store.settings import StoreSettings

LIMIT_S = 5.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class CountingStore(MemoryStore):
    """Counts the round trips of journal writes (and their sizes)."""

    def __init__(self, settings: StoreSettings) -> None:
        super().__init__(settings)
        self.batches: list[int] = []
        self.started: list[float] = []
        """When each write began."""
        self.edges: list[list[Edge]] = []
        """The edges each write took along."""

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        self.batches.append(len(items))
        self.started.append(time.monotonic())
        self.edges.append(list((edges or {}).values()))
        return await super().append_many(items, edges=edges)


async def started(store: MemoryStore, *rids: str) -> list[Run]:
    runs = []
    for rid in rids:
        spec = RequestSpec(rid, (1, 2, 3), 64)
        await store.create(spec.record("a"))
        await store.transition(rid, Edge.AGGREGATE, epoch=1)
        runs.append(Run(spec, 1, time.monotonic()))
    return runs


def entry(index: int) -> JournalEntry:
    return JournalEntry(index, (100 + index,), f"<{index}>")


async def journalled(store: MemoryStore, rid: str) -> list[int]:
    return [e.index for e in await store.journal(rid)]


def test_concurrent_streams_share_one_write() -> None:
    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        runs = await started(store, *(f"r{i}" for i in range(20)))
        writer = JournalWriter(store, 1.0)
        for index in range(3):
            await asyncio.gather(*(writer.journal(r, entry(index)) for r in runs))
        assert len(store.batches) <= 6  # not 60 round trips
        assert sum(store.batches) == 60
        for r in runs:
            assert await journalled(store, r.rid) == [0, 1, 2]
            assert r.journal.unjournalled == 0

    run(main())


def test_a_busy_writer_gathers_for_gather_s_and_an_idle_one_writes_at_once() -> None:
    gather_s = 0.3

    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        runs = await started(store, *(f"r{i}" for i in range(10)))
        writer = JournalWriter(store, 1.0, gather_s=gather_s)
        t0 = time.monotonic()
        await writer.journal(runs[0], entry(0))
        assert time.monotonic() - t0 < gather_s  # idle: no wait

        async def late(k: int) -> None:  # arriving over ~20 ms, while the writer is busy
            await asyncio.sleep(k * 0.002)
            await writer.journal(runs[k], entry(0))

        await asyncio.gather(*(late(k) for k in range(1, 10)))
        assert store.batches == [1, 9]  # not nine writes
        assert store.started[1] - store.started[0] >= gather_s - 0.005
        await asyncio.sleep(gather_s)  # idle again: the next write goes at once
        t0 = time.monotonic()
        await writer.journal(runs[0], entry(1))
        assert time.monotonic() - t0 < gather_s
        assert store.batches == [1, 9, 1]
        for r in runs:
            assert r.journal.unjournalled == 0

    run(main())


def test_a_stale_run_in_a_batch_fails_alone() -> None:
    # Another replica took r1 over (epoch + 1) while its chunk waited in the batch: r1's
    # write is refused, r0's and r2's land, and no index is skipped or doubled in either.
    async def main() -> None:
        store = MemoryStore(StoreSettings(url="memory://"))
        r0, r1, r2 = await started(store, "r0", "r1", "r2")
        writer = JournalWriter(store, 1.0)
        await asyncio.gather(*(writer.journal(r, entry(0)) for r in (r0, r1, r2)))
        await store.transition("r1", Edge.TAKE_OVER, epoch=1)
        got = await asyncio.gather(
            *(writer.journal(r, entry(1)) for r in (r0, r1, r2)), return_exceptions=True
        )
        assert isinstance(got[1], errors.StaleEpochError)
        assert got[0] is None
        assert got[2] is None
        assert await journalled(store, "r0") == [0, 1]
        assert await journalled(store, "r2") == [0, 1]
        assert await journalled(store, "r1") == [0]  # the new owner continues from here
        assert r1.journal.unjournalled == 1  # never counted as written

    run(main())


def test_a_failed_batch_acks_nothing_and_is_written_when_the_store_is_back() -> None:
    async def main() -> None:
        store = MemoryStore(StoreSettings(url="memory://", outage_s=2.0))
        r0, r1 = await started(store, "r0", "r1")
        writer = JournalWriter(store, 2.0)
        await asyncio.gather(writer.journal(r0, entry(0)), writer.journal(r1, entry(0)))
        store.fail_next(1)  # the next batch's round trip fails before it takes effect
        # The relay goes on (the client gets the chunks); the journal does not have them.
        await asyncio.gather(writer.journal(r0, entry(1)), writer.journal(r1, entry(1)))
        assert (r0.journal.unjournalled, r1.journal.unjournalled) == (1, 1)
        assert await journalled(store, "r0") == [0]
        await writer.journal(r0, entry(2))  # the store is back: r0's backlog goes in order
        await writer.settle(r1)
        assert await journalled(store, "r0") == [0, 1, 2]
        assert await journalled(store, "r1") == [0, 1]
        assert (r0.journal.unjournalled, r1.journal.unjournalled) == (0, 0)

    run(main())


def test_a_batch_whose_reply_was_lost_is_not_written_twice() -> None:
    # The batch landed but its reply was lost: the chunks count as unjournalled, and the
    # next write resyncs from the journal's end instead of duplicating them.
    async def main() -> None:
        store = MemoryStore(StoreSettings(url="memory://"))
        r0, r1 = await started(store, "r0", "r1")
        writer = JournalWriter(store, 1.0)
        store.lose_replies(1)
        await asyncio.gather(writer.journal(r0, entry(0)), writer.journal(r1, entry(0)))
        assert (r0.journal.unjournalled, r1.journal.unjournalled) == (1, 1)
        await asyncio.gather(writer.journal(r0, entry(1)), writer.settle(r1))
        assert await journalled(store, "r0") == [0, 1]
        assert await journalled(store, "r1") == [0]
        assert (r0.journal.unjournalled, r1.journal.unjournalled) == (0, 0)

    run(main())


def test_an_ended_request_is_told_so() -> None:
    async def main() -> None:
        store = MemoryStore(StoreSettings(url="memory://"))
        (r0,) = await started(store, "r0")
        writer = JournalWriter(store, 1.0)
        await store.transition("r0", Edge.CANCEL, epoch=1)
        with pytest.raises(errors.RequestEndedError):
            await writer.journal(r0, entry(0))

    run(main())


def test_close_fails_waiting_runs_instead_of_leaving_them() -> None:
    async def main() -> None:
        store = MemoryStore(StoreSettings(url="memory://"))
        (r0,) = await started(store, "r0")
        writer = JournalWriter(store, 1.0)
        store.available = False
        r0.journal.entries.append(entry(0))
        r0.journal.unjournalled = 1
        waiting = asyncio.ensure_future(writer.flush(r0))
        await asyncio.sleep(0)
        await writer.close()
        with pytest.raises(errors.UnavailableError):
            await waiting

    run(main())


def test_a_run_cancelled_while_waiting_leaves_its_chunks_queued_and_can_wait_again() -> None:
    # The wait is not shielded (issue 21: a future and a callback less per chunk): a run
    # cancelled while its chunk waits for the next batch cancels only its own future; the
    # chunk is still written, and the run's next flush (its end's settle) waits again.
    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        (r0,) = await started(store, "r0")
        writer = JournalWriter(store, 1.0, gather_s=0.2)
        await writer.journal(r0, entry(0))  # the writer is busy for gather_s now
        waiting = asyncio.create_task(writer.journal(r0, entry(1)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert r0.journal.unjournalled == 1
        await writer.settle(r0)  # waits on a new future: not the cancelled one
        assert r0.journal.unjournalled == 0
        assert await journalled(store, "r0") == [0, 1]

    run(main())


def test_an_edge_rides_with_the_runs_next_write_once() -> None:
    # The decode stream's first chunk adopts the KV in its journal write (`JournalBuffer
    # .adopt`): the edge goes with that write only, and is cleared once it landed.
    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        spec = RequestSpec("r0", (1, 2, 3), 64)
        await store.create(spec.record("a"))
        for edge in (Edge.PREFILL, Edge.KV_SENT):
            await store.transition("r0", edge, epoch=1)
        r0 = Run(spec, 1, time.monotonic())
        writer = JournalWriter(store, 1.0)
        r0.journal.adopt = Edge.KV_ADOPTED
        await writer.journal(r0, entry(0))
        assert r0.journal.adopt is None
        record = await store.get("r0")
        assert record is not None
        assert record.state is State.DECODING
        await writer.journal(r0, entry(1))
        assert store.edges == [[Edge.KV_ADOPTED], []]

    run(main())


def test_a_first_chunk_cuts_the_gather_short_and_takes_the_batch_with_it() -> None:
    # Issue 21: a request's first token is its client's TTFT — it must not wait for the
    # gather window of a busy writer. It goes at once, and the chunks gathered so far go
    # in the same write; a later chunk (not a first) waits for the window again.
    gather_s = 0.5

    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        r0, r1, r2, r3 = await started(store, "r0", "r1", "r2", "r3")
        writer = JournalWriter(store, 1.0, gather_s=gather_s)
        await writer.journal(r0, entry(0))  # the writer is busy for gather_s now
        gathering = asyncio.create_task(writer.journal(r1, entry(0)))  # not a first: waits
        await asyncio.sleep(0.02)
        assert not gathering.done()
        t0 = time.monotonic()
        await writer.journal(r2, entry(0), first=True)
        assert time.monotonic() - t0 < gather_s / 2
        await gathering  # it went with the first chunk's write
        assert store.batches == [1, 2]
        t0 = time.monotonic()
        await writer.journal(r3, entry(0))  # a write just went: this one gathers again
        assert time.monotonic() - t0 >= gather_s - 0.005
        assert store.batches == [1, 2, 1]
        for r in (r0, r1, r2, r3):
            assert await journalled(store, r.rid) == [0]
            assert r.journal.unjournalled == 0

    run(main())


def test_a_first_chunk_queued_during_a_write_skips_the_next_gather() -> None:
    # The first chunk arrives while a write is in flight: the write after it goes as soon
    # as that one returns, without the gather.
    gather_s = 0.5

    async def main() -> None:
        store = SlowStore(StoreSettings(url="memory://"), delay_s=0.05)
        r0, r1 = await started(store, "r0", "r1")
        writer = JournalWriter(store, 1.0, gather_s=gather_s)
        writing = asyncio.create_task(writer.journal(r0, entry(0)))
        await asyncio.sleep(0.01)  # r0's write is in flight
        t0 = time.monotonic()
        await writer.journal(r1, entry(0), first=True)
        assert time.monotonic() - t0 < gather_s / 2
        await writing
        assert await journalled(store, "r1") == [0]

    run(main())


class SlowStore(MemoryStore):
    """Each journal write takes ``delay_s`` (a round trip)."""

    def __init__(self, settings: StoreSettings, delay_s: float) -> None:
        super().__init__(settings)
        self.delay_s = delay_s

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        await asyncio.sleep(self.delay_s)
        return await super().append_many(items, edges=edges)


def test_the_relay_sends_the_first_token_without_the_gather_and_the_rest_with_it() -> None:
    # The relay marks the chunk carrying a request's first token as its first (`Relay`):
    # behind a busy writer it reaches the client at once; the next chunk waits the gather.
    # Each is handed to the client by the writer, once its entry is written.
    gather_s = 0.5

    async def main() -> None:
        store = CountingStore(StoreSettings(url="memory://"))
        busy, r1 = await started(store, "busy", "r1")
        writer = JournalWriter(store, 1.0, gather_s=gather_s)
        relay = Relay(store, ControlSettings(), writer, None)
        await writer.journal(busy, entry(0))  # the writer is busy for gather_s now
        handed: list[tuple[float, OutChunk, int]] = []
        one, two = asyncio.Event(), asyncio.Event()

        def deliver(chunk: OutChunk) -> None:
            buf = r1.journal
            handed.append((time.monotonic(), chunk, len(buf.entries) - buf.unjournalled))
            (one if len(handed) == 1 else two).set()

        r1.deliver = deliver

        async def stream() -> AsyncGenerator[worker_pb2.TokenChunk, None]:
            yield worker_pb2.TokenChunk(index=0, token_ids=[7], text="a")
            await one.wait()  # the next token comes after the first reached the client
            yield worker_pb2.TokenChunk(index=1, token_ids=[8], text="b")
            await asyncio.Event().wait()  # the worker is slow with the next

        t0 = time.monotonic()
        out = relay.relay(r1, stream())
        reading = asyncio.ensure_future(anext(out))
        await two.wait()
        (t_first, first, written_first), (t_second, second, written_second) = handed
        assert (first.index, first.token_ids) == (0, [7])
        assert t_first - t0 < gather_s / 2
        assert (second.index, second.token_ids) == (1, [8])
        assert t_second - t_first >= gather_s - 0.05  # a write just went: it gathers
        assert (written_first, written_second) == (1, 2)  # journalled before handed
        assert await journalled(store, "r1") == [0, 1]
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await out.aclose()

    run(main())


class Worker:
    """A token stream the test paces: chunk ``i`` goes when the test says so."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[worker_pb2.TokenChunk] = asyncio.Queue()

    def send(self, index: int, finish: bool = False) -> None:
        reason = common_pb2.FINISH_REASON_LENGTH if finish else common_pb2.FINISH_REASON_UNSPECIFIED
        chunk = worker_pb2.TokenChunk(index=index, token_ids=[100 + index], text=f"<{index}>")
        chunk.finish_reason = reason
        self.queue.put_nowait(chunk)

    async def stream(self) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        while True:
            yield await self.queue.get()


class Handed(list[OutChunk]):
    """The chunks a run's clients were handed (`Run.deliver`)."""

    def __init__(self) -> None:
        super().__init__()
        self._more = asyncio.Event()

    def __call__(self, chunk: OutChunk) -> None:
        self.append(chunk)
        self._more.set()

    async def until(self, n: int) -> None:
        while len(self) < n:
            self._more.clear()
            await self._more.wait()


async def relay_of_one() -> tuple[MemoryStore, Run, Relay, Handed, Worker]:
    """A request ``r``, its relay, what its clients are handed, and its worker's stream."""
    store = MemoryStore(StoreSettings(url="memory://"))
    (r,) = await started(store, "r")
    relay = Relay(store, ControlSettings(), JournalWriter(store, 1.0), None)
    handed = Handed()
    r.deliver = handed
    return store, r, relay, handed, Worker()


async def relaying(
    refuse: Edge, last_finishes: bool
) -> tuple[list[OutChunk], list[OutChunk | BaseException]]:
    """Relay chunk 0, then take ``refuse`` in the store (as another replica would), then
    relay chunk 1 (and chunk 2 unless ``last_finishes``): what the client was handed, and
    what the relay yielded or raised."""
    store, r, relay, handed, worker = await relay_of_one()
    yielded: list[OutChunk | BaseException] = []

    async def consume() -> None:
        try:
            async for chunk in relay.relay(r, worker.stream()):
                yielded.append(chunk)
        except errors.PdorchError as exc:
            yielded.append(exc)

    consuming = asyncio.create_task(consume())
    worker.send(0)
    await handed.until(1)
    await store.transition("r", refuse, epoch=1)
    worker.send(1, finish=last_finishes)
    if not last_finishes:
        await asyncio.sleep(0.1)  # chunk 1's write is refused meanwhile
        worker.send(2)
    await asyncio.wait_for(consuming, 2.0)
    return handed, yielded


@pytest.mark.parametrize("last_finishes", [False, True])
def test_a_request_cancelled_elsewhere_ends_its_stream_after_what_the_client_has(
    last_finishes: bool,
) -> None:
    """The relay does not wait for a chunk's write; a write refused because the request
    ended elsewhere hands nothing out, and the relay ends the stream "cancelled" at the
    count the client has (at its next chunk, or before recording the end)."""

    async def main() -> None:
        handed, yielded = await relaying(Edge.CANCEL, last_finishes)
        assert [c.index for c in handed] == [0]
        assert len(yielded) == 1
        end = yielded[0]
        assert isinstance(end, OutChunk)
        assert (end.index, end.finish_reason) == (1, "cancelled")

    run(main())


@pytest.mark.parametrize("last_finishes", [False, True])
def test_a_write_refused_for_a_stale_epoch_fails_the_relay_and_hands_nothing_after(
    last_finishes: bool,
) -> None:
    async def main() -> None:
        handed, yielded = await relaying(Edge.TAKE_OVER, last_finishes)
        assert [c.index for c in handed] == [0]
        assert len(yielded) == 1
        assert isinstance(yielded[0], errors.StaleEpochError)

    run(main())


def test_an_unreachable_store_hands_the_chunks_out_and_journals_them_later() -> None:
    """Redis away: the stream goes on (chunks handed out unjournalled, as before the
    writer handed them); they are journalled, in order, by the next write that lands."""

    async def main() -> None:
        store, r, relay, handed, worker = await relay_of_one()
        out = relay.relay(r, worker.stream())
        reading = asyncio.ensure_future(anext(out))
        store.available = False
        worker.send(0)
        worker.send(1)
        await handed.until(2)
        assert r.journal.unjournalled == 2
        store.available = True
        worker.send(2, finish=True)
        end = await asyncio.wait_for(reading, 2.0)
        assert end.finish_reason == "length"
        assert [c.index for c in handed] == [0, 1, 2]
        assert await journalled(store, "r") == [0, 1, 2]
        await out.aclose()

    run(main())


def test_a_stopping_replica_hands_out_nothing_unjournalled() -> None:
    """At shutdown the writer fails what is queued without handing it out: a client
    resumes elsewhere from the journal, never from a chunk that may not be in it."""

    async def main() -> None:
        store = SlowStore(StoreSettings(url="memory://"), 0.2)
        (r,) = await started(store, "r")
        writer = JournalWriter(store, 1.0)
        handed: list[OutChunk] = []
        r.journal.hand = handed.append
        writer.submit(r, entry(0), OutChunk("r", 0, [100], "<0>"))
        await asyncio.sleep(0.05)  # its write is under way
        await writer.close()
        assert handed == []
        assert r.journal.unjournalled == 1

    run(main())


def test_a_failover_waits_for_the_failed_attempts_chunks_before_fencing_it_off() -> None:
    """The relay does not wait for its writes, so a worker can fail while its last chunk's
    write is in flight: the failover's epoch + 1 waits for it — written after, at the old
    epoch, it would be refused as stale and the request taken for lost to a peer."""

    async def main() -> None:
        store = SlowStore(StoreSettings(url="memory://"), 0.2)
        (r,) = await started(store, "r")
        settings = ControlSettings()
        writer = JournalWriter(store, 1.0)
        relay = Relay(store, settings, writer, None)
        local = Local()
        failover = Failover(
            store,
            settings,
            Ledger(settings),
            cast(Any, None),  # no attempt is dispatched here
            relay,
            LeaseKeeper(store, local, "me"),
            local,
            None,
        )
        handed = Handed()
        r.journal.hand = handed
        writer.submit(r, entry(0), OutChunk("r", 0, [100], "<0>"))
        await asyncio.sleep(0.05)  # its write is under way
        await failover._reassign(r)
        assert r.epoch == 2
        assert [c.index for c in handed] == [0]
        assert writer.refusal(r) is None
        assert await journalled(store, "r") == [0]

    run(main())
