"""Takeover edge cases found at scale (`pdorch bench control-plane`), against a real Redis."""

from __future__ import annotations

import asyncio
import time

from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, Orchestrator
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.state import Edge, State
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec
from transport import wire
from transport.base import TransportSettings
from transport.tcp import tcp_receiver, tcp_sender


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


async def _kv_released_on_takeover(redis_url: str) -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    store = RedisStore(StoreSettings(url=redis_url, lease_ttl_s=1.0))

    async def publish(info: WorkerInfo) -> None:
        await store.heartbeat(info, 3.0)

    worker = Worker(
        engine,
        WorkerSettings(role="decode", worker_id="decode-0"),
        publish,
        receiver=tcp_receiver(TransportSettings(), engine.info.model_spec()),  # 30 s hold
        runner=SimRunner(engine),
    )
    await worker.start()
    sender = tcp_sender()
    control = Orchestrator(store, WorkerClients(), ControlSettings(reap_interval_s=0.1), "b")
    try:
        ids = engine.tokenize("a prompt whose owner died between prefill and decode")
        # The old owner prefilled at epoch 1 and its KV reached decode-0; then it died.
        result = engine.prefill(ids, SamplingParams())
        header = wire.header_for(
            "orphan", 1, engine.info.fingerprint, wire.DType.BFLOAT16, result.kv
        )
        await sender.send(worker.kv_address, wire.KvCache(header, tuple(result.kv)))
        assert worker.kv_used() > 0
        record = RequestRecord("orphan", State.QUEUED, 1, "h" * 32, len(ids), 4, time.time(),
                               owner="ghost", prompt_ids=ids)  # fmt: skip
        assert await store.create(record) is None
        placed = {"mode": "disaggregated", "prefill_worker": "p-gone", "decode_worker": "decode-0"}
        await store.transition("orphan", Edge.PREFILL, epoch=1, fields=placed)
        await store.transition("orphan", Edge.KV_SENT, epoch=1)
        assert await store.release_lease("orphan", "ghost")  # the owner is gone
        await control.start()
        started = time.monotonic()
        while (got := await store.get("orphan")) is not None and not got.state.terminal:
            assert time.monotonic() - started < 20, "the request was never finished"
            await asyncio.sleep(0.05)  # polling the record with a deadline
        assert got is not None
        assert (got.state, got.epoch) == (State.DONE, 2)
        done_at = time.monotonic()
        while worker.kv_used() > 0:  # the resumed run ended: only the orphan's KV is left
            assert time.monotonic() - done_at < 2, "the old epoch's KV is still held"
            await asyncio.sleep(0.05)
    finally:
        await control.stop()
        await sender.close()
        await worker.stop()
        await store.close()


def test_kv_of_a_request_taken_over_is_released_not_held_for_its_lease(redis_url: str) -> None:
    """Issue 18: a replica died between prefill and decode; the replica taking its request
    over releases the old epoch's KV on the decode worker at once, instead of leaving it held
    for the worker's 30 s hold lease (a real worker, KV over TCP, real Redis)."""
    asyncio.run(asyncio.wait_for(_kv_released_on_takeover(redis_url), 60))
