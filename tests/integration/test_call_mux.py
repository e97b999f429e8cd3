"""Many unary calls on one call (``CallMany``): the orchestrator's `control.calls` against a
real worker's gRPC server (`workers.server`, `workers.calls`) over loopback, the host a
scripted one so each call's answer, failure and cancellation are known.

What it must keep: a call reads exactly as its unary call would (the response; errors with
their code, details and trailing metadata, so failover blames the same worker), calls share
messages, a failure, a cancel or a deadline touches one call only and stops it on the
worker, the call failing fails every call on it the way a unary call fails, a draining
worker finishes its calls and refuses new ones, and a worker without ``CallMany`` gets
unary calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.api.protocol import BLAME_KEY, BLAME_KV_TARGET
from orchestrator.control.calls import CallMux
from orchestrator.control.clients import WorkerClients, translated
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo
from orchestrator.workers.host import Context
from orchestrator.workers.server import Worker, WorkerSettings
from tests.integration.test_decode_mux import ScriptHost, info_of, publish

LIMIT_S = 30.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class PrefillHost(ScriptHost):
    """Tokenizes text to its words' lengths. Prefills in ``step_s``, answering the first
    token ``len(token_ids)``; a request id starting with ``stale`` is refused as a stale
    epoch, one starting with ``blamed`` fails naming the KV's receiver, one starting with
    ``slow`` takes a minute."""

    def __init__(self, step_s: float = 0.01) -> None:
        super().__init__(step_s)
        self.prefilled: list[str] = []

    async def tokenize(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        self.started.append(rid)
        if rid.startswith("stale"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rid}: stale epoch")
        if rid.startswith("blamed"):
            context.set_trailing_metadata(((BLAME_KEY, BLAME_KV_TARGET),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{rid}: KV receiver lost")
        try:
            await asyncio.sleep(60 if rid.startswith("slow") else self.step_s)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        self.prefilled.append(rid)
        return worker_pb2.PrefillResponse(first_token=len(request.token_ids), kv_bytes=64)


def ask(rid: str, n: int = 3) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, epoch=1, token_ids=list(range(1, n + 1)))


async def serving(host: ScriptHost, **settings: Any) -> Worker:
    worker = Worker(host, WorkerSettings(role="prefill", **settings), publish)
    await worker.start()
    return worker


async def failure(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_calls_on_one_call_answer_as_their_unary_calls_in_shared_messages() -> None:
    async def main() -> None:
        worker = await serving(PrefillHost())
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                mux = CallMux(worker_pb2_grpc.WorkerServiceStub(channel))
                prefill = worker_pb2_grpc.PrefillServiceStub(channel)
                general = worker_pb2_grpc.WorkerServiceStub(channel)
                shared = await asyncio.gather(
                    *(mux.prefill(ask(f"r{n}", n), 10) for n in range(1, 9))
                )
                # sent in one loop turn: one message; done together: their replies batched
                assert mux.messages_sent == 1
                assert mux.batches <= 4, mux.batches
                alone = [await prefill.Prefill(ask(f"a{n}", n)) for n in range(1, 9)]
                assert shared == alone  # each its own answer, the unary call's
                text = worker_pb2.TokenizeRequest(text="one three fifteen")
                said = await mux.tokenize(text, 10)
                assert said == await general.Tokenize(text)
                assert list(said.ids) == [3, 5, 7]
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_one_calls_failure_is_its_own_and_reads_as_its_unary_call_would() -> None:
    async def main() -> None:
        worker = await serving(PrefillHost())
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                mux = CallMux(worker_pb2_grpc.WorkerServiceStub(channel))
                stub = worker_pb2_grpc.PrefillServiceStub(channel)
                good = mux.prefill(ask("good"), 10)
                beyond = ask("beyond")
                beyond.token_ids.append(5000)  # past the vocabulary: the servicer refuses it
                for rid, request in (("stale-1", ask("stale-1")), ("blamed-1", ask("blamed-1")),
                                     ("beyond", beyond)):  # fmt: skip
                    got = await failure(mux.prefill(request, 10))
                    alone = await failure(stub.Prefill(request))
                    assert (got.code(), got.details()) == (alone.code(), alone.details()), rid
                    assert got.trailing_metadata() == alone.trailing_metadata()
                    seen = before = None
                    for error in (got, alone):
                        with pytest.raises(errors.PdorchError) as caught:
                            async with translated("w", "prefill", kv_target="receiver"):
                                raise error
                        seen, before = caught.value, seen
                    assert type(seen) is type(before)
                    assert str(seen) == str(before)
                    if rid.startswith("blamed"):
                        assert isinstance(seen, errors.WorkerError)
                        assert seen.worker == "receiver"
                assert (await good).first_token == 3  # untouched by the others
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_a_cancelled_or_expired_call_stops_on_the_worker_and_no_other() -> None:
    async def main() -> None:
        host = PrefillHost(step_s=0.2)
        worker = await serving(host)
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                mux = CallMux(worker_pb2_grpc.WorkerServiceStub(channel))
                leaving = mux.prefill(ask("slow-leaving"), 10)
                expiring = mux.prefill(ask("slow-expiring"), 0.3)
                staying = mux.prefill(ask("staying"), 10)
                await until(lambda: len(host.started) == 3, "the calls never started")
                leaving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leaving
                late = await failure(expiring)
                assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert (await staying).first_token == 3
                await until(lambda: len(host.cancelled) == 2, "the worker kept prefilling")
                assert sorted(host.cancelled) == ["slow-expiring", "slow-leaving"]
                # a task awaiting a call, cancelled, stops it too
                waiting = asyncio.create_task(asyncio.wait_for(mux.prefill(ask("slow-w"), 10), 0.1))
                with pytest.raises(TimeoutError):
                    await waiting
                await until(lambda: "slow-w" in host.cancelled, "the worker kept prefilling")
                assert (await mux.prefill(ask("after"), 10)).first_token == 3  # the call lives on
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_the_call_failing_fails_every_call_as_it_fails_a_unary_call() -> None:
    """The worker's server gone mid-call (stopped without grace): every call on the shared
    call fails with the code a unary call made beside them gets, and failover retries it."""

    async def main() -> None:
        host = PrefillHost()
        worker = await serving(host)
        async with grpc.aio.insecure_channel(worker.address) as channel:
            mux = CallMux(worker_pb2_grpc.WorkerServiceStub(channel))
            shared = [mux.prefill(ask(f"slow-{i}"), 20) for i in range(3)]
            alone = worker_pb2_grpc.PrefillServiceStub(channel).Prefill(ask("slow-alone"))
            await until(lambda: len(host.started) == 4, "the calls never started")
            assert worker._server is not None
            await worker._server.stop(None)
            baseline = await failure(alone)
            for call in shared:
                got = await failure(call)
                assert got.code() == baseline.code(), (got, baseline)
            with pytest.raises(errors.WorkerError) as caught:
                async with translated("w", "prefill"):
                    raise got
            assert caught.value.retryable_instance  # failed over, not failed
            await mux.close()
        await worker.host.close()

    run(main())


def test_a_draining_worker_finishes_its_calls_and_refuses_new_ones() -> None:
    async def main() -> None:
        host = PrefillHost(step_s=0.5)
        worker = await serving(host, drain_grace_s=20.0)
        async with grpc.aio.insecure_channel(worker.address) as channel:
            mux = CallMux(worker_pb2_grpc.WorkerServiceStub(channel))
            running = mux.prefill(ask("running"), 10)
            await until(lambda: host.started == ["running"], "the call never started")
            started = time.monotonic()
            stopping = asyncio.create_task(worker.stop())
            await until(lambda: worker._draining, "the worker never drained")
            refused = await failure(mux.prefill(ask("late"), 10))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.details() or "")
            assert (await running).first_token == 3  # ran to its end
            await stopping
            assert time.monotonic() - started < 10  # not the whole grace: the call ended
            await mux.close()

    run(main())


class _OldWorker(worker_pb2_grpc.WorkerServiceServicer, worker_pb2_grpc.PrefillServiceServicer):
    """A worker of an earlier version: unary calls only (``CallMany`` is UNIMPLEMENTED)."""

    def __init__(self, host: PrefillHost) -> None:
        self.host = host

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.PrefillResponse:
        return await self.host.prefill(request, context)

    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.TokenizeResponse:
        return worker_pb2.TokenizeResponse(ids=await self.host.tokenize(request.text))


async def _alive(_worker: WorkerInfo) -> bool:
    return True


def test_a_worker_without_call_many_gets_unary_calls() -> None:
    async def main() -> None:
        host = PrefillHost()
        server = grpc.aio.server()
        old_worker = _OldWorker(host)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(old_worker, server)
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(old_worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clients = WorkerClients()
        legs = WorkerLegs(clients, ControlSettings(), _alive)
        try:
            old = info_of("old", f"127.0.0.1:{port}")
            said = await legs.tokenize(worker_pb2.TokenizeRequest(text="a bb"), [old])
            assert list(said.ids) == [1, 2]
            for n in range(2):  # the second goes straight to a unary call
                answer = await legs.prefill(old, old, ask(f"r{n}"), lambda: None)
                assert answer.first_token == 3
            assert host.prefilled == ["r0", "r1"]  # each prefilled once: no call was lost
            assert not clients.get(old.address).calls.supported
        finally:
            await clients.close()
            await server.stop(None)

    run(main())


def test_a_call_is_the_same_whether_shared_or_alone() -> None:
    """The legs send a request's calls through the mux by default; with ``call_mux`` off as
    unary calls: same answers."""

    async def main() -> None:
        host = PrefillHost()
        worker = await serving(host)
        clients = WorkerClients()
        try:
            info = info_of("w", worker.address)
            answers = []
            for shared in (True, False):
                legs = WorkerLegs(clients, ControlSettings(call_mux=shared), _alive)
                said = await legs.tokenize(worker_pb2.TokenizeRequest(text="abc de"), [info])
                answer = await legs.prefill(info, info, ask(f"r-{shared}", 4), lambda: None)
                answers.append((list(said.ids), answer.first_token))
            assert answers == [([3, 2], 4)] * 2
            assert clients.get(worker.address).calls.batches == 2  # the shared ones were shared
        finally:
            await clients.close()
            await worker.stop()

    run(main())
