"""A decode worker's KV inbox seen through its RPCs: replays and Release.

One simulated decode worker over real gRPC and TCP KV, in process; the test is the prefill
side (a transport sender) and the orchestrator (Decode and Release calls). A KV that a
Decode took cannot be sent again or taken again; a Release closes its attempt's epoch even
before the KV arrives, and never touches a newer attempt's KV.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from orchestrator.api import worker_pb2
from orchestrator.control.clients import WorkerClients, WorkerStubs
from orchestrator.core.records import WorkerInfo
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec
from transport import errors, wire
from transport.base import TransportSettings
from transport.tcp import tcp_receiver, tcp_sender

GREEDY = SamplingParams()


class Decoder:
    def __init__(self, engine: SimEngine, stubs: WorkerStubs, kv_address: str) -> None:
        self.engine, self.stubs, self.kv_address = engine, stubs, kv_address
        self.sender = tcp_sender()

    async def send(self, rid: str, epoch: int, ids: list[int]) -> int:
        """Prefill ``ids`` and send their KV as (rid, epoch); returns the first token."""
        result = self.engine.prefill(ids, GREEDY)
        header = wire.header_for(
            rid, epoch, self.engine.info.fingerprint, wire.DType.BFLOAT16, result.kv
        )
        await self.sender.send(self.kv_address, wire.KvCache(header, tuple(result.kv)))
        return result.first_token

    async def decode(self, rid: str, epoch: int, ids: list[int], first: int) -> list[int]:
        request = worker_pb2.DecodeRequest(
            request_id=rid,
            epoch=epoch,
            token_ids=ids,
            last_token=first,
            generated=1,
            max_tokens=4,
            kv_timeout_s=10.0,
            prompt_tokens=len(ids),
        )
        return [t for chunk in [c async for c in self.stubs.decode.Decode(request)]
                for t in chunk.token_ids]  # fmt: skip

    async def release(self, rid: str, epoch: int) -> bool:
        reply = await self.stubs.decode.Release(
            worker_pb2.ReleaseRequest(request_id=rid, epoch=epoch), timeout=5
        )
        return bool(reply.released)


@asynccontextmanager
async def decoder() -> AsyncIterator[Decoder]:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))

    async def publish(info: WorkerInfo) -> None:
        """No store here: nothing reads heartbeats."""

    worker = Worker(
        engine,
        WorkerSettings(role="decode", worker_id="decode-0"),
        publish,
        receiver=tcp_receiver(TransportSettings(), engine.info.model_spec()),
        runner=SimRunner(engine),
    )
    clients = WorkerClients()
    await worker.start()
    d = Decoder(engine, clients.get(worker.address), worker.kv_address)
    try:
        yield d
    finally:
        await d.sender.close()
        await clients.close()
        await worker.stop()


async def _replayed_after_decode() -> None:
    async with decoder() as d:
        ids = d.engine.tokenize("a prompt whose KV is replayed")
        first = await d.send("r", 3, ids)
        assert len(await d.decode("r", 3, ids, first)) >= 1
        with pytest.raises(errors.StaleEpochError, match="replay"):
            await d.send("r", 3, ids)  # the same transfer again: refused before any payload
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await d.decode("r", 3, ids, first)  # and nothing to take a second time
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert time.monotonic() - started < 5.0  # at once, not after kv_timeout_s
        first = await d.send("r", 4, ids)  # the next attempt is fine
        assert len(await d.decode("r", 4, ids, first)) >= 1


async def _released() -> None:
    async with decoder() as d:
        ids = d.engine.tokenize("a prompt released before its KV arrives")
        assert not await d.release("late", 2)  # nothing held yet...
        with pytest.raises(errors.StaleEpochError):
            await d.send("late", 2, ids)  # ...but the attempt is over: its KV is refused
        first = await d.send("newer", 5, ids)
        assert not await d.release("newer", 4)  # a previous attempt's late Release
        assert len(await d.decode("newer", 5, ids, first)) >= 1  # left the KV in place
        await d.send("held", 1, ids)
        assert await d.release("held", 1)
        with pytest.raises(errors.StaleEpochError):
            await d.send("held", 1, ids)


@pytest.mark.parametrize("scenario", [_replayed_after_decode, _released])
def test_decode_worker_kv_inbox(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))
