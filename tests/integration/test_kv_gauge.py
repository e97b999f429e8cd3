"""A worker's ``kv_used_bytes`` is exact: the KV its sequences hold now (grown token by token),
not what they held when they started — the gauge capacity placement and the chaos checker's
leak check read. A simulated engine behind a real worker (gRPC on loopback), in one process.
"""

from __future__ import annotations

import asyncio

import grpc

from orchestrator.api import common_pb2, worker_pb2, worker_pb2_grpc
from orchestrator.core.records import WorkerInfo
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec

LONG, SHORT = 200, 6


def _generate(rid: str, ids: list[int], max_tokens: int) -> worker_pb2.AggregatedRequest:
    return worker_pb2.AggregatedRequest(
        request_id=rid,
        epoch=1,
        token_ids=ids,
        sampling=common_pb2.SamplingParams(),
        max_tokens=max_tokens,
        prompt_tokens=len(ids),
    )


async def _two_streams() -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    per_token = engine.info.kv_bytes_per_token()

    async def publish(info: WorkerInfo) -> None:
        pass

    worker = Worker(
        engine, WorkerSettings(role="decode", worker_id="d"), publish, runner=SimRunner(engine)
    )
    await worker.start()
    try:
        ids = engine.tokenize("a prompt of seven words for you")
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            long = stub.Generate(_generate("long", ids, LONG), timeout=60)
            seen = 0
            async for chunk in long:
                seen += len(chunk.token_ids)
                if seen >= 2:
                    break
            # A short stream starts and ends while the long one decodes.
            async for _ in stub.Generate(_generate("short", ids, SHORT), timeout=60):
                pass
            before = seen
            used = worker.kv_used()
            async for chunk in long:
                seen += len(chunk.token_ids)
                if seen >= before + 1:
                    break
            # The long stream alone holds KV now: its prompt and at least the tokens the
            # client has seen, at most all it may generate. (The old gauge added each
            # stream's prompt-sized KV and subtracted its grown KV at the end: here the
            # short stream's end took more than it had added, off the long one's count.)
            assert worker.active_sequences() == 1
            assert (len(ids) + before - 1) * per_token <= used <= (len(ids) + LONG) * per_token
            long.cancel()
        deadline = asyncio.get_running_loop().time() + 10
        while worker.active_sequences() or worker.kv_used():
            assert asyncio.get_running_loop().time() < deadline, worker.kv_used()
            await asyncio.sleep(0.02)  # the cancelled stream unwinds on the server
        assert worker.kv_used() == 0
    finally:
        await worker.stop()


def test_kv_used_is_the_kv_the_live_sequences_hold_now() -> None:
    asyncio.run(_two_streams())
