"""`MemoryStore`'s TTLs on its injectable clock, the parts of the store contract the shared
suite (``tests/contract/test_store.py``) checks on Redis through key TTLs and real waits.

Time moves only when a test says so (`ManualClock`), so nothing here waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import Edge, State
from orchestrator.store.memory import ManualClock, MemoryStore
from orchestrator.store.settings import StoreSettings

SETTINGS = StoreSettings(url="memory://", lease_ttl_s=3.0, record_ttl_s=60)


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 5.0))


def record(rid: str = "r1", owner: str = "orch-1") -> RequestRecord:
    return RequestRecord(rid, State.QUEUED, 1, "b" * 32, 5, 16, 1.0, owner=owner)


def worker(wid: str) -> WorkerInfo:
    return WorkerInfo(wid, "decode", "127.0.0.1:1", "127.0.0.1:2", "tcp", "tiny", "f", 2048,
                      1000, 64, 1 << 20)  # fmt: skip


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(SETTINGS, clock=clock)


def test_a_lease_lapses_after_its_ttl_and_a_peer_takes_over(
    store: MemoryStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        peer = store.peer()
        assert await store.create(record()) is None
        clock.advance(2.9)
        assert await peer.take_over("r1", "orch-2") is None  # still held
        assert await store.refresh_lease("r1", "orch-1")  # 3 s more from now
        clock.advance(2.9)
        assert await peer.lease_holders(["r1"]) == ["orch-1"]
        clock.advance(0.1)
        assert await peer.lease_holders(["r1"]) == [None]
        assert not await store.refresh_lease("r1", "orch-1")  # lapsed: not extended
        assert await peer.take_over("r1", "orch-2") == 2
        assert await store.refresh_leases([("r1", 1)], "orch-1") == [False]  # fenced off

    run(scenario())


def test_records_and_journals_expire_after_the_record_ttl(
    store: MemoryStore, clock: ManualClock
) -> None:
    async def scenario() -> None:
        assert await store.create(record()) is None
        await store.transition("r1", Edge.AGGREGATE, epoch=1)
        clock.advance(30)
        await store.append("r1", 1, JournalEntry(0, (1,), "a"))  # the journal's TTL: 60 s on
        clock.advance(30)
        assert await store.get("r1") is None  # created 60 s ago
        assert await store.progress(["r1"]) == {}
        assert await store.journal("r1") == [JournalEntry(0, (1,), "a")]
        clock.advance(30)
        assert await store.journal("r1") == []
        assert await store.create(record()) is None  # the id is free again

    run(scenario())


def test_heartbeats_and_client_attachment_expire(store: MemoryStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        await store.heartbeat(worker("w1"), ttl_s=1.0)
        await store.heartbeat(worker("w2"), ttl_s=5.0)
        await store.touch_client("r1", 2.0)
        clock.advance(1.0)
        assert not await store.worker_alive("w1")
        assert store.worker_index() == {"w1", "w2"}  # pruned by the next listing
        assert [w.worker_id for w in await store.workers()] == ["w2"]
        assert store.worker_index() == {"w2"}
        assert await store.client_attached("r1")
        clock.advance(1.0)
        assert not await store.client_attached("r1")

    run(scenario())


def test_progress_times_are_the_store_clock(store: MemoryStore, clock: ManualClock) -> None:
    async def scenario() -> None:
        assert await store.create(record()) is None
        (_, _, created), *_ = (await store.progress(["r1"])).values()
        assert float(created) == await store.now_ms() == clock() * 1000
        clock.advance(0.25)
        await store.transition("r1", Edge.AGGREGATE, epoch=1)
        (_, _, moved), *_ = (await store.progress(["r1"])).values()
        assert float(moved) - float(created) == 250

    run(scenario())


def test_time_never_moves_back(clock: ManualClock) -> None:
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)
