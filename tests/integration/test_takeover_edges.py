"""Takeover edge cases found at scale (`pdorch bench control-plane`), against a real Redis."""

from __future__ import annotations

import asyncio
import time

from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, Orchestrator
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.state import Edge, State
from orchestrator.store.redis_store import RedisStore, StoreSettings


def test_a_fully_journalled_request_is_finished_by_the_replica_taking_it_over(
    redis_url: str,
) -> None:
    """The owner ('ghost') journalled all max_tokens tokens and lost its lease before it
    recorded the end (its event loop stalled past the lease TTL under load). The replica
    taking over has nothing to generate: it records the request done, not a worker call
    for zero tokens."""

    async def main() -> None:
        store = RedisStore(StoreSettings(url=redis_url, lease_ttl_s=1.0))
        control = Orchestrator(store, WorkerClients(), ControlSettings(reap_interval_s=0.1), "b")
        record = RequestRecord("full", State.QUEUED, 1, "h" * 32, 3, 4, time.time(),
                               owner="ghost", prompt_ids=[1, 2, 3])  # fmt: skip
        assert await store.create(record) is None
        await store.transition("full", Edge.AGGREGATE, epoch=1)
        await store.append("full", 1, JournalEntry(0, (7, 8), " a b"))
        await store.append("full", 1, JournalEntry(2, (9, 10), " c d"))
        assert await store.release_lease("full", "ghost")  # the owner is gone
        await control.start()
        started = time.monotonic()
        try:
            while (got := await store.get("full")) is not None and not got.state.terminal:
                assert time.monotonic() - started < 10, "the request was never finished"
                await asyncio.sleep(0.05)  # polling the record with a deadline
            assert got is not None
            assert (got.state, got.finish_reason, got.epoch) == (State.DONE, "length", 2)
            assert got.output_tokens == 4
            assert [t for e in await store.journal("full") for t in e.token_ids] == [7, 8, 9, 10]
        finally:
            await control.stop()
            await store.close()

    asyncio.run(asyncio.wait_for(main(), 30))
