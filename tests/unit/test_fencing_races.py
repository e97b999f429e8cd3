"""Races between two replicas over one request: the epoch fences them, whoever is late.

Each test opens the window a real cluster opens rarely — a replica stalled past its lease
while a peer takes the request over, a Cancel read one round trip before a failover —
with a store that waits or acts at the exact step (`MemoryStore` subclasses sharing one
data set, a `ManualClock` for leases) and the fake fleet of `tests.unit.control_fakes`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from orchestrator import errors
from orchestrator.control.orchestrator import Orchestrator, OutChunk
from orchestrator.core.deadlines import StateDeadlines
from orchestrator.core.records import RequestRecord
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge, State
from orchestrator.store.memory import ManualClock, MemoryStore
from orchestrator.store.settings import StoreSettings
from tests.unit.control_fakes import FakeFleet, FakeWorker
from tests.unit.test_control_plane import FAST, eventually, inp, run, setup

LEASE_S = 30.0


class _Logged(MemoryStore):
    """Records every transition that landed: (replica, edge, epoch it was taken at)."""

    def __init__(self, settings: StoreSettings, log: list[tuple[str, str, int]], **kw: Any):
        super().__init__(settings, **kw)
        self.who = "?"
        self.log = log

    async def transition(self, request_id: str, edge: Edge, *, epoch: int, **kw: Any) -> int:
        got = await super().transition(request_id, edge, epoch=epoch, **kw)
        self.log.append((self.who, edge.wire, epoch))
        return got


def _peer(of: MemoryStore, store: MemoryStore) -> MemoryStore:
    store._data = of._data
    return store


async def _drain(stream: Any, into: list[OutChunk | BaseException]) -> None:
    try:
        async for chunk in stream:
            into.append(chunk)
    except Exception as exc:
        into.append(exc)


def test_a_replica_taken_over_cannot_requeue_the_new_owners_epoch() -> None:
    """Replica a stalls past its lease; b takes the request over (epoch 2) and streams it.
    Then a's decode stream goes silent and a fails over: its requeue is fenced by *its*
    epoch (1), refused, and a's client follows b — b keeps the request and ends it."""

    async def main() -> None:
        clock = ManualClock()
        settings = StoreSettings(url="memory://", lease_ttl_s=LEASE_S)
        log: list[tuple[str, str, int]] = []
        store_a = _Logged(settings, log, clock=clock)
        store_a.who = "a"
        p0, d1 = FakeWorker("p0", "prefill"), FakeWorker("d1", "decode", delay_s=0.002)
        d0 = FakeWorker("d0", "decode", hang_after=3)  # a's stream goes silent at token 3
        a, _, _ = await setup(
            p0, d0, d1, store=store_a, owner="a", settings=replace(FAST, token_timeout_s=0.5)
        )
        store_b = _peer(store_a, _Logged(settings, log, clock=clock))
        store_b.who = "b"
        b = Orchestrator(store_b, FakeFleet(p0, d0, d1).as_clients(), FAST, "b")
        got: list[OutChunk | BaseException] = []
        client = asyncio.create_task(_drain(a.generate(inp(max_tokens=60)), got))
        await eventually(lambda: _at_least(got, 3))
        await b.start()
        clock.advance(LEASE_S + 1)  # a's lease lapses: b's reaper takes the request over
        await eventually(lambda: _any(log, "b"))
        await client
        await eventually(lambda: _terminal(store_b))
        record = await store_b.get("r1")
        await b.stop()
        await a.stop()
        assert ("a", "requeue", 2) not in log, log
        assert record is not None
        assert (record.state, record.output_tokens) == (State.DONE, 60), record
        last = got[-1]
        assert isinstance(last, OutChunk), last
        ids = [t for c in got if isinstance(c, OutChunk) for t in c.token_ids]
        assert (len(ids), last.finish_reason) == (60, "length")

    run(main())


class _StallingEnd(MemoryStore):
    """A replica that freezes right before recording a request's end (its lease lapses)."""

    def __init__(self, settings: StoreSettings, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.gate = asyncio.Event()

    async def end(self, *args: Any, **kw: Any) -> RequestRecord:
        await self.gate.wait()
        return await super().end(*args, **kw)


@pytest.mark.parametrize(
    ("stop", "eos_at", "finish", "tokens", "text"),
    [
        (("<2>",), None, "stop", 3, "<0><1>"),  # the stop string's chunk carries the finish
        ((), 3, "eos", 3, "<0><1><2>"),  # the model's end came alone: an entry of its own
    ],
)
def test_a_request_that_ended_is_ended_by_its_new_owner_not_generated_past_its_end(
    stop: tuple[str, ...], eos_at: int | None, finish: str, tokens: int, text: str
) -> None:
    """a relays and journals the request's end, then freezes before recording it; b takes
    the request over. b ends it with the journalled finish instead of generating on; a's
    late end is refused, and its client follows b."""

    async def main() -> None:
        clock = ManualClock()
        settings = StoreSettings(url="memory://", lease_ttl_s=LEASE_S)
        store_a = _StallingEnd(settings, clock=clock)
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", eos_at=eos_at)
        a, _, _ = await setup(p0, d0, store=store_a, owner="a")
        store_b = _peer(store_a, MemoryStore(settings, clock=clock))
        b = Orchestrator(store_b, FakeFleet(p0, d0).as_clients(), FAST, "b")
        got: list[OutChunk | BaseException] = []
        ending = replace(inp(max_tokens=8), stop=stop)
        client = asyncio.create_task(_drain(a.generate(ending), got))
        await eventually(lambda: _finish_journalled(store_b, finish))
        d0.eos_at = None  # from now on a model that would go on: b must end it as journalled
        await b.start()
        clock.advance(LEASE_S + 1)
        await eventually(lambda: _terminal(store_b))
        store_a.gate.set()  # a wakes up: its end comes too late
        await client
        await b.stop()
        await a.stop()
        record = await store_b.get("r1")
        assert record is not None
        assert (record.state, record.finish_reason, record.output_tokens) == (
            State.DONE,
            finish,
            tokens,
        )
        journal = await store_b.journal("r1")
        assert "".join(e.text for e in journal) == text
        last = got[-1]
        assert isinstance(last, OutChunk), last
        assert last.finish_reason == finish
        assert all(c.token_ids or c.text or c.finish_reason for c in got if isinstance(c, OutChunk))
        assert [t for c in got if isinstance(c, OutChunk) for t in c.token_ids] == [
            t for e in journal for t in e.token_ids
        ]

    run(main())


class _FailoverAfterRead(MemoryStore):
    """The replica a Cancel reaches: the request's owner fails it over (requeue, epoch + 1)
    right after the Cancel read its record — one round trip before its transition."""

    def __init__(self, settings: StoreSettings, owner: MemoryStore) -> None:
        super().__init__(settings)
        _peer(owner, self)
        self.owner = owner
        self.raced = False

    async def get(self, request_id: str) -> RequestRecord | None:
        got = await super().get(request_id)
        if got is not None and not self.raced and not got.state.terminal:
            self.raced = True
            await self.owner.transition(request_id, Edge.REQUEUE, epoch=got.epoch)
        return got


def test_a_cancel_racing_a_failover_still_cancels() -> None:
    async def main() -> None:
        settings = StoreSettings(url="memory://")
        store_a = MemoryStore(settings)
        await store_a.create(RequestSpec("r1", (1, 2, 3), 8).record("a"))
        await store_a.transition("r1", Edge.AGGREGATE, epoch=1)
        b = Orchestrator(_FailoverAfterRead(settings, store_a), FakeFleet().as_clients(), FAST, "b")
        answered = await b.cancel("r1")
        record = await store_a.get("r1")
        assert record is not None
        assert (answered, record.state, record.epoch) == (State.CANCELLED, State.CANCELLED, 2)

    run(main())


async def _at_least(got: list[Any], n: int) -> bool:
    return len(got) >= n


async def _any(log: list[tuple[str, str, int]], who: str) -> bool:
    return any(w == who for w, _, _ in log)


async def _terminal(store: MemoryStore) -> bool:
    record = await store.get("r1")
    return record is not None and record.state.terminal


async def _finish_journalled(store: MemoryStore, finish: str) -> bool:
    journal = await store.journal("r1")
    return bool(journal) and journal[-1].finish == finish


def test_a_request_a_peers_reaper_failed_is_told_to_its_client_as_failed() -> None:
    """b's deadline reaper fails a request a drives (no token for longer than the decoding
    deadline, by the store's clock): a's next journal write is refused — the request ended
    — and its client is told the request failed (`ABORTED`), not that it was cancelled."""

    async def main() -> None:
        clock = ManualClock()
        settings = StoreSettings(url="memory://", lease_ttl_s=LEASE_S)
        store_a = MemoryStore(settings, clock=clock)
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", delay_s=0.05)
        a, _, _ = await setup(p0, d0, store=store_a, owner="a")
        store_b = _peer(store_a, MemoryStore(settings, clock=clock))
        reaping = replace(FAST, deadline_scan_s=0.0, deadlines=StateDeadlines(decoding_s=5.0))
        b = Orchestrator(store_b, FakeFleet(p0, d0).as_clients(), reaping, "b")
        got: list[OutChunk | BaseException] = []
        client = asyncio.create_task(_drain(a.generate(inp(max_tokens=200)), got))
        await eventually(lambda: _at_least(got, 2))
        await b.start()
        clock.advance(6.0)
        await eventually(lambda: _terminal(store_b))
        await asyncio.wait_for(client, 5)
        await b.stop()
        await a.stop()
        record = await store_b.get("r1")
        assert record is not None
        assert record.state is State.FAILED
        assert isinstance(got[-1], errors.RequestFailedError), got[-1]
        assert "decoding" in str(got[-1])

    run(main())


class _StallingAfterHeld(MemoryStore):
    """A replica that freezes after journalling a chunk whose text waits (it may begin a
    stop string: `JournalEntry.held`) — its lease lapses with that text given to no one."""

    def __init__(self, settings: StoreSettings, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.frozen = asyncio.Event()
        self.gate = asyncio.Event()

    async def append_many(self, *args: Any, **kw: Any) -> Any:
        if self.frozen.is_set():
            await self.gate.wait()  # frozen until the test wakes it (its writes then late)
        got = await super().append_many(*args, **kw)
        journal = await super().journal("r1")
        if journal and journal[-1].held:
            self.frozen.set()
        return got


def test_text_held_for_a_stop_string_is_given_out_by_the_new_owner() -> None:
    """The text of token 2 might begin the stop string "<2>!" (it never does): a holds it,
    journals it as held, and freezes. b takes the request over from the journal and gives
    that text out with the rest — the client following b misses nothing."""

    async def main() -> None:
        clock = ManualClock()
        settings = StoreSettings(url="memory://", lease_ttl_s=LEASE_S)
        store_a = _StallingAfterHeld(settings, clock=clock)
        p0 = FakeWorker("p0", "prefill")
        d0 = FakeWorker("d0", "decode", delay_s=0.05)  # a write per chunk
        a, _, _ = await setup(p0, d0, store=store_a, owner="a")
        store_b = _peer(store_a, MemoryStore(settings, clock=clock))
        b = Orchestrator(store_b, FakeFleet(p0, d0).as_clients(), FAST, "b")
        got: list[OutChunk | BaseException] = []
        client = asyncio.create_task(
            _drain(a.generate(replace(inp(max_tokens=6), stop=("<2>!",))), got)
        )
        await asyncio.wait_for(store_a.frozen.wait(), 10)
        assert (await store_b.journal("r1"))[-1].held == "<2>"
        await b.start()
        clock.advance(LEASE_S + 1)
        await eventually(lambda: _terminal(store_b))
        store_a.gate.set()  # a wakes up: its writes are refused, its client follows b
        await asyncio.wait_for(client, 10)
        await b.stop()
        await a.stop()
        record = await store_b.get("r1")
        assert record is not None
        assert (record.state, record.finish_reason) == (State.DONE, "length")
        journal = await store_b.journal("r1")
        whole = "".join(f"<{i}>" for i in range(6))
        assert "".join(e.text for e in journal) == whole
        assert "".join(c.text for c in got if isinstance(c, OutChunk)) == whole, got

    run(main())


class _StallingBeforeTheEnd(MemoryStore):
    """Journals entries up to the end's; freezes before writing the entry with the finish."""

    def __init__(self, settings: StoreSettings, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.frozen = asyncio.Event()
        self.gate = asyncio.Event()

    async def append_many(self, items: Any, **kw: Any) -> Any:
        ended = [i for i, (_, _, e) in enumerate(items) if e.finish]
        if ended:
            before = list(items[: ended[0]])
            got = await super().append_many(before, **kw) if before else []
            self.frozen.set()
            await self.gate.wait()
            return got + await super().append_many(list(items[ended[0] :]), **kw)
        return await super().append_many(items, **kw)


def test_held_text_of_the_last_token_is_given_out_after_takeover() -> None:
    """Every token journalled, the last one's text held (it may begin "<5>!"), the end not
    yet: the new owner ends the request and gives out what was held."""

    async def main() -> None:
        clock = ManualClock()
        settings = StoreSettings(url="memory://", lease_ttl_s=LEASE_S)
        store_a = _StallingBeforeTheEnd(settings, clock=clock)
        p0 = FakeWorker("p0", "prefill")
        d0 = FakeWorker("d0", "decode", delay_s=0.05)
        a, _, _ = await setup(p0, d0, store=store_a, owner="a")
        store_b = _peer(store_a, MemoryStore(settings, clock=clock))
        b = Orchestrator(store_b, FakeFleet(p0, d0).as_clients(), FAST, "b")
        got: list[OutChunk | BaseException] = []
        # token 5's text "<5>" may begin "<5>!": held; the end (length) comes alone
        client = asyncio.create_task(
            _drain(a.generate(replace(inp(max_tokens=6), stop=("<5>!",))), got)
        )
        await asyncio.wait_for(store_a.frozen.wait(), 10)
        assert (await store_b.journal("r1"))[-1].held == "<5>"
        await b.start()
        clock.advance(LEASE_S + 1)
        await eventually(lambda: _terminal(store_b))
        store_a.gate.set()
        await asyncio.wait_for(client, 10)
        await b.stop()
        await a.stop()
        whole = "".join(f"<{i}>" for i in range(6))
        journal = await store_b.journal("r1")
        assert "".join(e.text for e in journal) == whole
        assert "".join(c.text for c in got if isinstance(c, OutChunk)) == whole, got

    run(main())
