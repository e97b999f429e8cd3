"""``GenerateMany`` (`rpc.many`, `rpc.many_client`): many requests on one call, each read as
its own ``Generate`` call would be. The real server (`rpc.service.server`, its interceptors
included) on loopback, over an in-process orchestrator with `MemoryStore` and the fake
worker fleet of `tests.unit.control_fakes`. Every scenario runs under a deadline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc
import pytest

from orchestrator.api import orchestrator_pb2 as pb
from orchestrator.api import orchestrator_pb2_grpc
from orchestrator.chaos.history import History
from orchestrator.chaos.scenario import Workload
from orchestrator.chaos.workload import Clients, make_requests
from orchestrator.control.orchestrator import Orchestrator
from orchestrator.core.admission import AdmissionPolicy
from orchestrator.rpc.many import ManyCalls
from orchestrator.rpc.many_client import ManyClient, StreamFailed
from orchestrator.rpc.service import RETRY_AFTER_KEY, server
from orchestrator.store.memory import MemoryStore
from tests.unit.control_fakes import FakeFleet, FakeWorker
from tests.unit.test_control_plane import FAST

LIMIT_S = 20.0


@dataclass
class Replica:
    orch: Orchestrator
    stub: orchestrator_pb2_grpc.OrchestratorStub
    many: ManyClient
    calls: ManyCalls
    channel: grpc.aio.Channel
    address: str


Scenario = Callable[[Replica, MemoryStore], Awaitable[None]]


def serve(scenario: Scenario, delay_s: float = 0.01, max_inflight: int = 0) -> None:
    """Run ``scenario`` against one orchestrator's gRPC server, one prefill and one decode
    fake worker (``delay_s`` per decoded token)."""

    async def main() -> None:
        store = MemoryStore()
        workers = [FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", delay_s=delay_s)]
        for w in workers:
            await store.heartbeat(w.info, 1e6)
        settings = FAST
        if max_inflight:
            settings = replace(FAST, admission=AdmissionPolicy(max_inflight=max_inflight))
        orch = Orchestrator(store, FakeFleet(*workers).as_clients(), settings, "r0")
        calls = ManyCalls()
        srv = server(orch, calls=calls)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        await orch.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        address = f"127.0.0.1:{port}"
        replica = Replica(orch, stub, ManyClient(stub), calls, channel, address)
        try:
            await asyncio.wait_for(scenario(replica, store), LIMIT_S)
        finally:
            await replica.many.close()
            await channel.close()
            await orch.stop()
            # A grace for the calls the scenario cut to finish: a call the server stops
            # cancels has grpc.aio log an ERROR ("Exception not handled …").
            await srv.stop(1.0)

    asyncio.run(main())


def gen(rid: str, max_tokens: int = 8, text: str = "hello") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, text=text, max_tokens=max_tokens)


async def drain(chunks: AsyncIterable[pb.GenerateChunk]) -> list[pb.GenerateChunk]:
    return [c async for c in chunks]


async def until(condition: Callable[[], bool], limit_s: float = 5.0) -> None:
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


def tokens(chunks: list[pb.GenerateChunk]) -> list[int]:
    out: list[int] = []
    for c in chunks:
        assert c.index == len(out)  # contiguous from 0
        out.extend(c.token_ids)
    return out


def final(chunks: list[pb.GenerateChunk]) -> pb.GenerateChunk:
    last = chunks[-1]
    assert last.finish_reason != 0
    return last


def test_requests_on_one_call_read_as_their_generate_calls_and_share_messages() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        n = 8
        many = await asyncio.gather(
            *(drain(r.many.generate(gen(f"m{i}", 12, f"prompt {i}"), 10)) for i in range(n))
        )
        alone = await asyncio.gather(
            *(drain(r.stub.Generate(gen(f"g{i}", 12, f"prompt {i}"), timeout=10)) for i in range(n))
        )
        for i in range(n):
            assert tokens(many[i]) == tokens(alone[i])
            a, b = final(many[i]), final(alone[i])
            assert a.request_id == f"m{i}"
            assert (a.finish_reason, a.prompt_tokens, a.decode_worker, a.epoch) == (
                b.finish_reason,
                b.prompt_tokens,
                b.decode_worker,
                b.epoch,
            )
            assert a.timings.ttft_ms > 0
        chunks = sum(len(c) for c in many)
        assert r.many.batches < chunks  # messages were shared
        # a resubmission on the call attaches to the request, as a second Generate would
        again = await drain(r.many.generate(gen("m0", 12, "prompt 0"), 10))
        assert tokens(again) == tokens(many[0])

    serve(scenario)


def test_a_requests_error_is_its_generate_calls_and_fails_it_alone() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        bad = pb.GenerateRequest(request_id="bad", max_tokens=4)  # no prompt
        with pytest.raises(grpc.aio.AioRpcError) as alone:
            await drain(r.stub.Generate(bad, timeout=5))
        good = asyncio.ensure_future(drain(r.many.generate(gen("good", 20), 10)))
        with pytest.raises(StreamFailed) as many:
            await drain(r.many.generate(bad, 5))
        assert many.value.code == alone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert many.value.details == alone.value.details()
        assert len(tokens(await good)) == 20  # the call and its other request go on
        for rid in ("a b", "x" * 300):
            with pytest.raises(StreamFailed) as refused:
                await drain(r.many.generate(gen(rid), 5))
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

    serve(scenario)


def test_a_refusal_for_load_carries_its_retry_after() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        first = asyncio.ensure_future(drain(r.many.generate(gen("first", 30), 10)))
        await until(lambda: "first" in r.orch.local.tasks)
        with pytest.raises(StreamFailed) as refused:
            await drain(r.many.generate(gen("second"), 5))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing)[RETRY_AFTER_KEY] == "1.000"
        assert len(tokens(await first)) == 30

    serve(scenario, max_inflight=1)


def test_a_requests_deadline_fails_it_alone() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        slow = asyncio.ensure_future(drain(r.many.generate(gen("slow", 200), 0.3)))
        fine = await drain(r.many.generate(gen("fine", 5), 10))
        assert len(tokens(fine)) == 5
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamFailed) as late:
            await slow
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert asyncio.get_running_loop().time() - started < 1.0  # at its deadline, not after
        # detached, as a Generate call cut by its deadline: a client may resume it
        rest = await drain(r.stub.Generate(gen("slow", 200), timeout=10))
        assert rest[-1].finish_reason != 0

    serve(scenario, delay_s=0.01)


def test_a_stopped_request_detaches_and_resumes_from_the_journal() -> None:
    async def scenario(r: Replica, store: MemoryStore) -> None:
        seen: list[pb.GenerateChunk] = []
        async for chunk in r.many.generate(gen("s", 40), 10):
            seen.append(chunk)
            if sum(len(c.token_ids) for c in seen) >= 3:
                break  # the stop command goes out
        have = sum(len(c.token_ids) for c in seen)
        assert "s" in r.orch.local.tasks  # still driven: detached, not cancelled
        resume = pb.GenerateRequest(request_id="s", text="hello", max_tokens=40)
        resume.resume_from_index = have
        rest = await drain(r.many.generate(resume, 10))
        assert rest[0].index == have
        assert have + sum(len(c.token_ids) for c in rest) == 40
        record = await store.get("s")
        assert record is not None
        assert record.output_tokens == 40

    serve(scenario)


def test_a_call_cut_by_its_client_detaches_its_requests() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        call = r.stub.GenerateMany()
        await call.write(pb.GenerateCommand(stream=1, start=gen("cut", 100), timeout_s=10))
        await call.read()
        call.cancel()
        await asyncio.sleep(0.2)
        assert "cut" in r.orch.local.tasks  # detached for the grace, resumable
        assert not r.calls._calls
        rest = await drain(r.stub.Generate(gen("cut", 100), timeout=10))
        assert rest[-1].finish_reason != 0

    serve(scenario)


def test_draining_refuses_new_requests_and_ends_the_call_after_its_last() -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        running = asyncio.ensure_future(drain(r.many.generate(gen("running", 30), 10)))
        await until(lambda: "running" in r.orch.local.tasks)
        r.calls.drain()
        with pytest.raises(StreamFailed) as refused:
            await drain(r.many.generate(gen("new"), 5))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(tokens(await running)) == 30
        await until(lambda: not r.calls._calls)  # the call ends once its last request has

    serve(scenario)


def test_an_undecodable_command_refuses_the_call(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(r: Replica, _store: MemoryStore) -> None:
        bidi = r.channel.stream_stream("/pdorch.v1.Orchestrator/GenerateMany")
        command = pb.GenerateCommand(stream=1, start=gen("ab")).SerializeToString()
        call = bidi(timeout=5)
        await call.write(command.replace(b"hello", b"hel\xfflo"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "UTF-8" in (refused.value.details() or "")
        # an empty command fails its request alone
        call2 = r.stub.GenerateMany()
        await call2.write(pb.GenerateCommand(stream=7))
        batch = await call2.read()
        assert batch.events[0].stream == 7
        assert batch.events[0].failure.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        call2.cancel()
        await until(lambda: not r.calls._calls)

    with caplog.at_level(logging.INFO):
        serve(scenario)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_chaos_clients_can_multiplex_their_requests() -> None:
    """`pdorch chaos`'s clients with a ``generate-many`` workload (the shipped
    orchestrator-kill-many scenario): every request on the replica's one call, each
    recorded as a Generate stream would be."""

    async def scenario(r: Replica, _store: MemoryStore) -> None:
        history = History(run=0, seed=1)
        workload = Workload(requests=6, concurrency=6, output_tokens=(5, 9))
        clients = Clients(
            [r.address], history, 0.0, concurrency=6, timeout_s=10, prefix="chaos", many=True
        )
        try:
            done = await clients.run(make_requests(workload, seed=1))
        finally:
            await clients.close()
        assert len(done) == 6
        oks = [op for op in history.ops if op.type == "ok"]
        assert len(oks) == 6
        assert clients._many is not None
        assert sum(c.batches for c in clients._many.values()) < sum(len(t) for t in done.values())

    serve(scenario)
