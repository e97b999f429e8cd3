"""Hostile and careless clients of the gRPC API (issue 17): the real server (`rpc.service.server`,
its interceptor included) on loopback, over an in-process orchestrator with `MemoryStore` and
the fake worker fleet of `tests.unit.control_fakes`. Every call runs under a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from orchestrator.api import orchestrator_pb2 as pb
from orchestrator.api import orchestrator_pb2_grpc
from orchestrator.control.orchestrator import Orchestrator
from orchestrator.core.idents import MAX_REQUEST_ID_BYTES
from orchestrator.core.records import RequestRecord, WorkerInfo
from orchestrator.core.state import Edge, State
from orchestrator.rpc.service import server
from orchestrator.store.memory import MemoryStore
from tests.unit.control_fakes import FakeFleet, FakeWorker
from tests.unit.test_control_plane import FAST

LIMIT_S = 20.0
CANCELLED = 4  # FINISH_REASON_CANCELLED


@dataclass
class Replica:
    orch: Orchestrator
    stub: orchestrator_pb2_grpc.OrchestratorStub
    channel: grpc.aio.Channel


Scenario = Callable[[list[Replica], MemoryStore], Awaitable[None]]


def serve(scenario: Scenario, replicas: int = 1, delay_s: float = 0.02) -> None:
    """Run ``scenario`` against ``replicas`` orchestrators sharing one store (each its own
    gRPC server), one prefill and one decode fake worker (``delay_s`` per decoded token)."""

    async def main() -> None:
        store = MemoryStore()
        workers = [FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", delay_s=delay_s)]
        for w in workers:
            await store.heartbeat(w.info, 1e6)
        servers, out = [], []
        for i in range(replicas):
            orch = Orchestrator(store, FakeFleet(*workers).as_clients(), FAST, f"r{i}")
            srv = server(orch)
            port = srv.add_insecure_port("127.0.0.1:0")
            await srv.start()
            await orch.start()
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            out.append(Replica(orch, orchestrator_pb2_grpc.OrchestratorStub(channel), channel))
            servers.append(srv)
        try:
            await asyncio.wait_for(scenario(out, store), LIMIT_S)
        finally:
            for r, srv in zip(out, servers, strict=True):
                await r.channel.close()
                await r.orch.stop()
                await srv.stop(0)

    asyncio.run(main())


def gen(rid: str, max_tokens: int = 200) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, text="hello", max_tokens=max_tokens)


async def drain(call: AsyncIterator[pb.GenerateChunk]) -> list[pb.GenerateChunk]:
    return [c async for c in call]


async def code_of(what: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await what
    return err.value.code(), err.value.details() or ""


# ------------------------------------------------------------------ 2: cancelled streams


def test_a_cancel_landing_before_the_drive_starts_ends_the_stream() -> None:
    """A Cancel between the record's creation and the drive task's first step cancelled a
    task that never ran: nothing told the client, whose stream stayed open until its
    deadline. (The store's create hands the window to a cancel, deterministically.)"""

    async def scenario(rs: list[Replica], store: MemoryStore) -> None:
        orch = rs[0].orch
        real_create = store.create

        async def create(record: RequestRecord, tenant_limit: int = 0) -> RequestRecord | None:
            out = await real_create(record, tenant_limit)
            # runs before the drive task's first step, as a Cancel's handler may
            asyncio.get_running_loop().call_soon(orch.local.stop_driving, record.request_id)
            return out

        store.create = create  # type: ignore[method-assign]
        call = rs[0].stub.Generate(gen("early"), timeout=5)
        chunks = await drain(call)
        assert chunks[-1].finish_reason == CANCELLED
        assert await call.code() == grpc.StatusCode.OK
        assert "early" not in orch.local.tasks
        assert orch.ledger.booked() == {}  # its placement, booked at creation, given back

    serve(scenario)


def test_a_cancel_through_another_replica_during_prefill_ends_with_a_cancelled_chunk() -> None:
    """The record was cancelled (through replica 1) while replica 0's drive was between two
    transitions: the next one was refused and the client got FAILED_PRECONDITION, the
    request was logged as failed. It ends as a cancel: a CANCELLED chunk, status OK."""

    async def scenario(rs: list[Replica], store: MemoryStore) -> None:
        real_transition = store.transition

        async def transition(rid: str, edge: Edge, **kw: Any) -> int:
            if edge is Edge.KV_SENT:
                reply = await rs[1].stub.Cancel(pb.CancelRequest(request_id=rid), timeout=5)
                assert reply.state == "cancelled"
            return await real_transition(rid, edge, **kw)

        store.transition = transition  # type: ignore[method-assign]
        call = rs[0].stub.Generate(gen("mid-prefill"), timeout=5)
        chunks = await drain(call)
        assert [c.finish_reason for c in chunks] == [CANCELLED]
        assert await call.code() == grpc.StatusCode.OK
        record = await store.get("mid-prefill")
        assert record is not None
        assert record.state is State.CANCELLED
        assert rs[0].orch.ledger.booked() == {}

    serve(scenario, replicas=2)


def test_a_cancelled_stream_ends_at_its_cancelled_chunk(caplog: pytest.LogCaptureFixture) -> None:
    """...at once, and the Cancel (the client's business) logs no warning: the drive finding
    the end already recorded by the Cancel said "could not record cancelled" at WARNING."""

    async def scenario(rs: list[Replica], _store: MemoryStore) -> None:
        call = rs[0].stub.Generate(gen("c"), timeout=10)
        seen = 0
        started = asyncio.get_running_loop().time()
        async for chunk in call:
            seen += 1
            if seen == 3:
                await rs[0].stub.Cancel(pb.CancelRequest(request_id="c"), timeout=5)
            last = chunk
        assert last.finish_reason == CANCELLED
        assert await call.code() == grpc.StatusCode.OK
        assert asyncio.get_running_loop().time() - started < 2.0  # not the 10 s deadline

    with caplog.at_level(logging.INFO):
        serve(scenario)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -------------------------------------------------------------- 3 and 8: request ids


def test_request_ids_are_bounded_in_bytes_at_the_door() -> None:
    """65 emoji are 65 characters but 260 bytes: past the KV header's bound. They passed a
    128-character check, and the decode worker refused the KV (blaming the prefill worker)."""

    async def scenario(rs: list[Replica], store: MemoryStore) -> None:
        stub = rs[0].stub
        emoji = "\N{SLIGHTLY SMILING FACE}"
        assert len((emoji * 65).encode()) > MAX_REQUEST_ID_BYTES
        code, details = await code_of(drain(stub.Generate(gen(emoji * 65), timeout=5)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in details
        assert "bytes" in details
        assert await store.get(emoji * 65) is None
        fits = emoji * (MAX_REQUEST_ID_BYTES // 4)
        chunks = await drain(stub.Generate(gen(fits, max_tokens=2), timeout=5))
        assert chunks[-1].request_id == fits
        for bad in ("a\x01b", "a\x7fb", "a b", "tab\t"):
            code, _ = await code_of(drain(stub.Generate(gen(bad), timeout=5)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, bad

    serve(scenario)


def test_a_megabyte_id_is_refused_without_being_echoed(caplog: pytest.LogCaptureFixture) -> None:
    """GetRequest/Cancel with a 1 MB id answered NOT_FOUND with the id in the status message
    (the client saw a metadata-size error instead), and the id went to the INFO log whole."""

    async def scenario(rs: list[Replica], _store: MemoryStore) -> None:
        stub = rs[0].stub
        huge = "x" * 1_000_000
        for what in (
            stub.GetRequest(pb.GetRequestRequest(request_id=huge), timeout=5),
            stub.Cancel(pb.CancelRequest(request_id=huge), timeout=5),
            drain(stub.Generate(gen(huge), timeout=5)),
        ):
            code, details = await code_of(what)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert len(details) < 300
        code, details = await code_of(stub.GetRequest(pb.GetRequestRequest(request_id="nope")))
        assert code == grpc.StatusCode.NOT_FOUND
        assert "nope" in details

    with caplog.at_level(logging.INFO):
        serve(scenario)
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


# ----------------------------------------------------------------- 6: undecodable input


def test_invalid_utf8_in_a_string_field_is_invalid_argument(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """protobuf refuses a string field that is not UTF-8 before the servicer runs: grpc.aio
    answered UNKNOWN and logged a traceback per call."""

    async def scenario(rs: list[Replica], _store: MemoryStore) -> None:
        channel = rs[0].channel
        good = pb.GetRequestRequest(request_id="ab").SerializeToString()
        bad = good.replace(b"ab", b"\xff\xfe")
        for method, payload in (
            ("GetRequest", bad),
            (
                "Cancel",
                pb.CancelRequest(request_id="ab").SerializeToString().replace(b"ab", b"\xc3("),
            ),
        ):
            call = channel.unary_unary(f"/pdorch.v1.Orchestrator/{method}")
            code, details = await code_of(call(payload, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "UTF-8" in details
        stream = channel.unary_stream("/pdorch.v1.Orchestrator/Generate")
        payload = gen("ab").SerializeToString().replace(b"hello", b"hel\xfflo")
        code, _ = await code_of(drain(stream(payload, timeout=5)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # the service still answers well-formed calls
        ok = await drain(rs[0].stub.Generate(gen("fine", max_tokens=2), timeout=5))
        assert ok[-1].finish_reason != 0

    with caplog.at_level(logging.INFO):
        serve(scenario)
    refused = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(refused) == 3
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in refused)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------------ 7: expired deadlines


def test_a_call_whose_deadline_passed_creates_and_runs_nothing() -> None:
    """The call's deadline passes while the request is admitted, and gRPC's cancellation of
    the handler is lost on its way — as redis-py's sends lose one under Python 3.11 (CPython
    gh-86296; see `tests/integration/test_cancellation.py`). The request was created anyway
    and generated every token for no one; now it is refused when its deadline has passed."""

    async def scenario(rs: list[Replica], store: MemoryStore) -> None:
        stub = rs[0].stub
        real_workers = store.workers

        async def workers() -> list[WorkerInfo]:
            with contextlib.suppress(asyncio.CancelledError):  # the lost cancel
                await asyncio.sleep(0.3)
            return await real_workers()

        store.workers = workers  # type: ignore[method-assign]
        code, _ = await code_of(drain(stub.Generate(gen("late"), timeout=0.05)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.5)  # the admission is over by now
        assert await store.get("late") is None
        # with time to spare, the same slow admission serves the request
        chunks = await drain(stub.Generate(gen("in-time", max_tokens=2), timeout=5))
        assert chunks[-1].finish_reason != 0

    serve(scenario)


# ------------------------------------------------------------------ 9: tenants' alphabet


def test_tenant_metadata_follows_the_tenant_rule() -> None:
    async def scenario(rs: list[Replica], _store: MemoryStore) -> None:
        stub = rs[0].stub
        for bad in ("t" * 65, " "):
            call = stub.Generate(gen("t"), timeout=5, metadata=(("x-pdorch-tenant", bad),))
            code, details = await code_of(drain(call))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "x-pdorch-tenant" in details
        call = stub.Generate(
            gen("t", max_tokens=2), timeout=5, metadata=(("x-pdorch-tenant", "team a"),)
        )
        assert (await drain(call))[-1].finish_reason != 0

    serve(scenario)
