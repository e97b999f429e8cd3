"""A cancelled request stops being generated even when asyncio loses the cancellation.

Python 3.11's ``asyncio.wait_for`` drops a cancel that lands as its operation completes
(CPython gh-86296), and redis-py sends every command through it: about one abandoned
request in ten, under load, ran on to its last token (`tests/unit/test_aio.py` reproduces
the race itself). Here the journal write the drive waits for hangs until the drive is told
to stop (the drive waits on the journal writer's batch, not on redis-py, so the cancel
reaches it; the write that is still pending must not keep the request alive), in an
in-process orchestrator with simulated workers over real gRPC, TCP KV and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence

from orchestrator import errors
from orchestrator.control.clients import WorkerClients
from orchestrator.control.orchestrator import ControlSettings, GenerateInput, Orchestrator
from orchestrator.core.records import JournalEntry, WorkerInfo
from orchestrator.core.state import Edge, State
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

    real_append_many = store.append_many
    writing = asyncio.Event()
    lost: list[int] = []

    async def append_many(
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        if not writing.is_set() and any(e.index >= 8 for _, _, e in items):
            writing.set()
            # This write's reply comes only once the drive was told to stop (the client
            # left for good): the drive must not need it to end.
            for _ in range(3000):  # polling a condition, at most 30 s
                run = control.local.runs.get("lost-cancel")
                if run is None or run.cancelled:
                    break
                await asyncio.sleep(0.01)
            lost.extend(e.index for _, _, e in items)
        return await real_append_many(items, edges=edges)

    store.append_many = append_many  # type: ignore[method-assign]

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
        assert lost, "the cancel did not land while the journal write was pending"
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
