"""The orchestrator's channel to a worker reconnects quickly after its link broke
(`control.clients.RECONNECT_OPTIONS`): a worker back within a few hundred milliseconds
takes calls again, where gRPC's default backoff (1 s, growing to minutes) kept failing
them at once ("failed to connect to all addresses") — and a request's failover attempts
were all spent inside that second (chaos scenario grpc-link-faults). And a connection
attempt that takes long — a loaded worker slow to finish its handshake — is waited for
(`control.clients.CONNECT_ATTEMPT_MS`), not abandoned after 100 ms."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest

from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.chaos.proxy import FaultProxy
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


def test_a_connection_slow_to_set_up_is_waited_for() -> None:
    """Every byte of the worker's link held 400 ms each way (a loaded worker, a slow
    network): setting up the connection takes ~1 s, and the first call still succeeds —
    with gRPC's connect attempts cut to 100 ms (``grpc.min_reconnect_backoff_ms`` is the
    minimum connect timeout) it failed UNAVAILABLE, "timed out before receiving SETTINGS
    frame"."""

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        server = await _serve(address)
        proxy = FaultProxy("slow-worker", address)
        clients = WorkerClients()
        try:
            proxy.faults.delay_s = 0.4
            stub = clients.get(await proxy.start()).general
            ask = worker_pb2.TokenizeRequest(text="abcd")
            assert (await stub.Tokenize(ask, timeout=15)).ids == [4]
        finally:
            await clients.close()
            await proxy.close()
            await server.stop(None)

    run(main())
