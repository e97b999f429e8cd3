"""The orchestrator's channel to a worker reconnects quickly after its link broke
(`control.clients.RECONNECT_OPTIONS`): a worker back within a few hundred milliseconds
takes calls again, where gRPC's default backoff (1 s, growing to minutes) kept failing
them at once ("failed to connect to all addresses") — and a request's failover attempts
were all spent inside that second (chaos scenario grpc-link-faults)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest

from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.control.clients import WorkerClients
from orchestrator.ports import free_port

LIMIT_S = 30.0


class _Tokenize(worker_pb2_grpc.WorkerServiceServicer):
    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.TokenizeResponse:
        return worker_pb2.TokenizeResponse(ids=[len(request.text)])


async def _serve(address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_Tokenize(), server)
    server.add_insecure_port(address)
    await server.start()
    return server


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


def test_a_worker_back_after_its_link_broke_takes_calls_within_half_a_second() -> None:
    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        clients = WorkerClients()
        stub = clients.get(address).general
        ask = worker_pb2.TokenizeRequest(text="abc")
        server = await _serve(address)
        try:
            assert (await stub.Tokenize(ask, timeout=5)).ids == [3]
            await server.stop(None)
            for _ in range(3):  # the link is down: the channel backs off
                with pytest.raises(grpc.aio.AioRpcError) as down:
                    await stub.Tokenize(ask, timeout=1)
                assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            server = await _serve(address)
            await asyncio.sleep(0.5)  # gRPC's default would still be backing off (>= 0.8 s)
            assert (await stub.Tokenize(ask, timeout=5)).ids == [3]
        finally:
            await clients.close()
            await server.stop(None)

    run(main())
