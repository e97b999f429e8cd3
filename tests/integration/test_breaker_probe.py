"""Issue 18, defect 2, end to end: a healthy decode pool whose breakers are half-open is not
treated as down. A real Redis, an in-process orchestrator, and simulated workers (one prefill,
two decode) over real gRPC and TCP KV.

Both decode workers failed a call once (in the chaos runs, collateral of another transfer's
failure: issue 18, defect 1), so both breakers are half-open. Two long streams are placed:
each is its worker's probe. Before the fix a probe lasted its whole stream, and every request
meanwhile ran "decode pool down: aggregated on prefill" although both workers were alive.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.control.clients import WorkerClients
from orchestrator.control.ledger import breaker_key
from orchestrator.control.orchestrator import ControlSettings, GenerateInput, Orchestrator
from orchestrator.core.admission import AdmissionPolicy
from orchestrator.core.records import WorkerInfo
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.workers.fleet import WorkerFleet
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec
from transport.base import TransportSettings
from transport.tcp import tcp_receiver, tcp_sender

pytestmark = pytest.mark.slow  # starts real processes (Redis, workers, orchestrators)

SETTINGS = ControlSettings(admission=AdmissionPolicy(aggregate_below=0))  # always disaggregate


async def _half_open_pool(redis_url: str) -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    store = RedisStore(StoreSettings(url=redis_url))

    async def publish(info: WorkerInfo) -> None:
        await store.heartbeat(info, 3.0)

    ts = TransportSettings()
    prefill = Worker(
        engine, WorkerSettings(role="prefill", worker_id="prefill-0"), publish,
        sender=tcp_sender(), runner=SimRunner(engine),
    )  # fmt: skip
    decodes = [
        Worker(
            engine,
            WorkerSettings(role="decode", worker_id=f"decode-{i}"),
            publish,
            receiver=tcp_receiver(ts, engine.info.model_spec()),
            runner=SimRunner(engine),
        )
        for i in range(2)
    ]
    fleet = WorkerFleet([prefill, *decodes])
    await fleet.start()
    control = Orchestrator(store, WorkerClients(), SETTINGS, "a")
    ids = tuple(engine.tokenize("a prompt for a probe"))
    streams: list[asyncio.Task[None]] = []
    try:
        workers = await store.workers()
        assert len(workers) == 3
        failed_at = time.monotonic() - SETTINGS.breaker_cooldown_s - 1  # cooled down since
        for w in workers:
            if w.role == "decode":
                control.ledger.breakers.failure(breaker_key(w), failed_at)
        first_tokens = [asyncio.Event(), asyncio.Event()]

        async def probe(i: int) -> None:
            inp = GenerateInput(f"probe-{i}", token_ids=ids, max_tokens=400)
            async for chunk in control.generate(inp):
                if chunk.token_ids:
                    first_tokens[i].set()

        streams = [asyncio.create_task(probe(i), name=f"probe-{i}") for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 30)
        probes = [await control.get(f"probe-{i}") for i in range(2)]
        assert {p.decode_worker for p in probes} == {"decode-0", "decode-1"}
        assert not any(s.done() for s in streams)  # both probe streams still going

        after = GenerateInput("after", token_ids=ids, max_tokens=4)
        chunks = [c async for c in control.generate(after)]
        assert chunks[-1].finish_reason == "length"
        record = await control.get("after")
        assert (record.mode, record.placement) == (
            "disaggregated", "disaggregated (conditional disaggregation off)"
        ), record.placement  # fmt: skip
        assert record.decode_worker.startswith("decode-")
    finally:
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await control.stop()
        await fleet.stop()
        await store.close()


def test_half_open_decode_workers_are_not_a_pool_down(redis_url: str) -> None:
    asyncio.run(asyncio.wait_for(_half_open_pool(redis_url), 90))
