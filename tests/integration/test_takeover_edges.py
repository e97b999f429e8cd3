"""Takeover edge cases found at scale (`pdorch bench control-plane`), against a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.cluster import free_port, redis_server_binary
from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, Orchestrator
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.state import State
from orchestrator.store.redis_store import RedisStore, StoreSettings


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(redis.RedisError):
            if client.ping():
                break
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)  # polling readiness with a deadline
    client.close()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


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
        await store.transition("full", epoch=1, target=State.DECODING)
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
