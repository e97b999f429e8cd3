"""The shared listing of live workers (`control.directory`): admission and every watch on
a worker read one listing per ``max_age_s`` instead of a store call each; a worker missing
from it is asked about directly, so a death is never hidden by the cache."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from orchestrator import errors
from orchestrator.control.directory import WorkerDirectory
from orchestrator.core.records import WorkerInfo
from orchestrator.store.memory import MemoryStore
from orchestrator.store.settings import StoreSettings

LIMIT_S = 5.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


def info(wid: str) -> WorkerInfo:
    return WorkerInfo(wid, "decode", "127.0.0.1:1", "127.0.0.1:2", "tcp", "tiny", "f", 2048,
                      1000, 16, 1 << 20)  # fmt: skip


class CountingStore(MemoryStore):
    """Counts listings and single-worker checks; ``down`` makes both fail as an outage."""

    def __init__(self) -> None:
        super().__init__(StoreSettings())
        self.listings = 0
        self.checks = 0
        self.down = False
        self.gate: asyncio.Event | None = None
        """When set: listings wait for it (to have callers arrive while one is in flight)."""

    async def workers(self) -> list[WorkerInfo]:
        self.listings += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise errors.StoreUnavailableError("request store unreachable (list workers)")
        return await super().workers()

    async def worker_alive(self, worker_id: str) -> bool:
        self.checks += 1
        if self.down:
            raise errors.StoreUnavailableError("request store unreachable (worker heartbeat)")
        return await super().worker_alive(worker_id)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watches_and_admission_share_one_listing_per_max_age() -> None:
    async def scenario() -> None:
        store, clock = CountingStore(), Clock()
        await store.heartbeat(info("w1"), ttl_s=30)
        await store.heartbeat(info("w2"), ttl_s=30)
        d = WorkerDirectory(store, 0.25, clock)
        answers = await asyncio.gather(*(d.alive(info(w)) for w in ("w1", "w2") * 50))
        assert all(answers)
        assert [w.worker_id for w in await d.listing()] == ["w1", "w2"]
        assert (store.listings, store.checks) == (1, 0)
        clock.now += 0.25  # too old: listed again, once
        assert await d.alive(info("w1"))
        assert await d.alive(info("w2"))
        assert (store.listings, store.checks) == (2, 0)

    run(scenario())


def test_a_worker_missing_from_the_listing_is_asked_about_directly() -> None:
    async def scenario() -> None:
        store, clock = CountingStore(), Clock()
        await store.heartbeat(info("w1"), ttl_s=30)
        d = WorkerDirectory(store, 0.25, clock)
        assert await d.alive(info("w1"))
        await store.deregister("w1")  # died after the listing: the cache still says alive...
        assert await d.alive(info("w1"))
        clock.now += 0.25  # ...for at most max_age
        assert not await d.alive(info("w1"))
        await store.heartbeat(info("w3"), ttl_s=30)  # registered after the listing
        assert await d.alive(info("w3"))  # not in it: the store's word, not the cache's
        assert store.checks == 2
        assert not await d.alive(info("gone"))

    run(scenario())


def test_callers_arriving_during_a_listing_wait_for_it_and_survive_a_cancelled_one() -> None:
    async def scenario() -> None:
        store, clock = CountingStore(), Clock()
        await store.heartbeat(info("w1"), ttl_s=30)
        store.gate = asyncio.Event()
        d = WorkerDirectory(store, 0.25, clock)
        first = asyncio.create_task(d.listing())
        others = [asyncio.create_task(d.listing()) for _ in range(5)]
        await asyncio.sleep(0)
        first.cancel()  # the caller that started it gives up: the others still get it
        store.gate.set()
        got = await asyncio.gather(*others)
        assert all([w.worker_id for w in g] == ["w1"] for g in got)
        assert store.listings == 1

    run(scenario())


def test_an_unreachable_store_counts_as_alive_and_zero_max_age_never_caches() -> None:
    async def scenario() -> None:
        store, clock = CountingStore(), Clock()
        await store.heartbeat(info("w1"), ttl_s=30)
        store.down = True
        d = WorkerDirectory(store, 0.25, clock)
        assert await d.alive(info("w1"))  # the store is down, not the worker
        store.down = False
        uncached = WorkerDirectory(store, 0.0, clock)
        await uncached.listing()
        await uncached.listing()
        assert await uncached.alive(info("w1"))
        assert not await uncached.alive(info("w2"))
        assert store.listings == 1 + 2  # the outage's, then every call
        assert store.checks == 2

    run(scenario())
