"""The deadline reaper against a real Redis: a request stuck in a state fails, whoever owns it."""

from __future__ import annotations

import asyncio
import time

from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, Orchestrator
from orchestrator.core.deadlines import StateDeadlines
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import Edge, State
from orchestrator.store.redis_store import RedisStore, StoreSettings


def test_a_request_stuck_with_a_live_owner_is_failed_by_the_reaper(redis_url: str) -> None:
    """Its owner ('ghost') keeps its lease alive, so no takeover happens — but the request
    makes no progress in `decoding`: the deadline reaper of another replica fails it."""

    async def main() -> None:
        store = RedisStore(StoreSettings(url=redis_url, lease_ttl_s=1.0))
        settings = ControlSettings(
            deadlines=StateDeadlines(decoding_s=1.0),
            deadline_scan_s=0.2,
            reap_interval_s=0.1,
        )
        control = Orchestrator(store, WorkerClients(), settings, owner="reaper")
        record = RequestRecord("stuck", State.QUEUED, 1, "h" * 32, 3, 8, time.time(),
                               owner="ghost", prompt_ids=[1, 2, 3])  # fmt: skip
        assert await store.create(record) is None
        await store.transition("stuck", Edge.AGGREGATE, epoch=1)
        await control.start()
        started = time.monotonic()
        try:
            while True:
                got = await store.get("stuck")
                assert got is not None
                if got.state is State.FAILED:
                    break
                assert await store.refresh_lease("stuck", "ghost")  # the owner is "alive"
                assert time.monotonic() - started < 10, "the reaper never failed it"
                await asyncio.sleep(0.1)  # polling the record with a deadline
            elapsed = time.monotonic() - started
            assert got.epoch == 1  # failed in place, not taken over
            assert "no progress in state decoding" in got.error
            assert elapsed >= 0.5
        finally:
            await control.stop()
            await store.close()

    asyncio.run(asyncio.wait_for(main(), 30))
