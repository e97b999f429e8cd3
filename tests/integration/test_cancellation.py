"""A cancelled request stops being generated even when asyncio loses the cancellation.

Python 3.11's ``asyncio.wait_for`` drops a cancel that lands as its operation completes
(CPython gh-86296), and redis-py sends every command through it: about one abandoned
request in ten, under load, ran on to its last token (`tests/unit/test_aio.py` reproduces
the race itself). Here the drive awaits a journal write that swallows the cancel — the
same outcome, made deterministic — in an in-process orchestrator with simulated workers
over real gRPC, TCP KV and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, GenerateInput, Orchestrator
from orchestrator.core.records import JournalEntry, WorkerInfo
from orchestrator.core.state import State
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.workers.fleet import SharedSender, WorkerFleet
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec
from transport.base import TransportSettings
from transport.tcp import TcpDataPlane, tcp_receiver

MAX_TOKENS = 2000


async def _abandoned_while_the_cancel_is_lost(redis_url: str) -> None:
    store = RedisStore(StoreSettings(url=redis_url))
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    ts = TransportSettings()

    async def publish(info: WorkerInfo) -> None:
        await store.heartbeat(info, 3.0)

    fleet = WorkerFleet(
        [
            Worker(engine, WorkerSettings(role="prefill", worker_id="prefill-0"), publish,
                   sender=SharedSender(TcpDataPlane(), ts, users=1), runner=SimRunner(engine)),
            Worker(engine, WorkerSettings(role="decode", worker_id="decode-0"), publish,
                   receiver=tcp_receiver(ts, engine.info.model_spec()), runner=SimRunner(engine)),
        ]
    )  # fmt: skip
    control = Orchestrator(store, WorkerClients(), ControlSettings(detach_grace_s=0.5), "solo")

    real_append = store.append
    writing = asyncio.Event()
    lost: list[int] = []

    async def append(request_id: str, epoch: int, entry: JournalEntry) -> int:
        if entry.index >= 8 and not writing.is_set():
            writing.set()
            try:
                await asyncio.Event().wait()  # this write's reply never comes...
            except asyncio.CancelledError:
                lost.append(entry.index)  # ...until the cancel, which is swallowed here
        return await real_append(request_id, epoch, entry)

    store.append = append  # type: ignore[method-assign]

    async def client() -> None:
        inp = GenerateInput(request_id="lost-cancel", text="tell me a long story",
                            max_tokens=MAX_TOKENS)  # fmt: skip
        async for _ in control.generate(inp):
            pass

    await fleet.start()
    await control.start()
    stream = asyncio.create_task(client())
    try:
        await asyncio.wait_for(writing.wait(), 30)
        stream.cancel()  # the client goes away for good; after the grace, the drive is cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await stream
        started = time.monotonic()
        while True:
            record = await store.get("lost-cancel")
            assert record is not None
            if record.state.terminal:
                break
            assert time.monotonic() - started < 5, f"still {record.state} after the cancel"
            await asyncio.sleep(0.05)  # polling the record with a deadline
        assert lost, "the cancel was not delivered inside the journal write"
        assert (record.state, record.finish_reason, record.epoch) == (
            State.CANCELLED,
            "cancelled",
            1,
        )
        assert record.output_tokens < MAX_TOKENS
        journalled = [t for e in await store.journal("lost-cancel") for t in e.token_ids]
        assert len(journalled) == record.output_tokens  # its end matches what was journalled
    finally:
        await control.stop()
        await fleet.stop()
        await store.close()


def test_an_abandoned_request_ends_cancelled_when_the_task_cancel_is_lost(
    redis_url: str,
) -> None:
    asyncio.run(asyncio.wait_for(_abandoned_while_the_cancel_is_lost(redis_url), 60))
