"""Admission with real processes: SLO-aware early rejection with a retry-after, per-tenant
limits across replicas, conditional disaggregation recorded on the request.

One prefill and one decode worker (tiny model). A SIGSTOPped prefill worker holds a request
in its queue, which is what the TTFT estimate of the next request must account for.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import grpc
import pytest
import redis

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster, connect
from orchestrator.store.keys import Keys
from tests.integration.conftest import collect, request, run, wait_for, workers
from transport.ucx import ucx_available

pytestmark = pytest.mark.slow

LONG_PROMPT = [10 + i % 240 for i in range(1500)]  # 1,500 tokens: a prefill the estimate notices


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny",
        transport="ucx" if ucx_available() else "tcp",
        prefill_workers=1,
        decode_workers=1,
        orchestrators=0,
        heartbeat_ttl_s=10.0,  # a stopped worker stays "alive" through each scenario
    )
    with c:
        c.start_orchestrator(
            0, 0, "--ttft-slo-ms", "40", "--tenant-limit", "capped=1", "--aggregate-below", "0"
        )
        c.start_orchestrator(1, 0, "--aggregate-below", "auto", "--tenant-limit", "capped=1")
        c.start_orchestrator(2, 0, "--max-inflight", "1")
        yield c


async def _info(address: str, rid: str) -> orchestrator_pb2.RequestInfo:
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid))


async def _refusal(
    address: str, req: orchestrator_pb2.GenerateRequest, tenant: str = ""
) -> grpc.aio.AioRpcError:
    metadata = (("x-pdorch-tenant", tenant),) if tenant else None
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.Generate(req, timeout=30, metadata=metadata):
                pass
    return exc.value


def _retry_after(err: grpc.aio.AioRpcError) -> float:
    trailing = dict(err.trailing_metadata() or ())
    return float(trailing["retry-after"])


def test_a_request_that_would_miss_the_ttft_slo_is_refused_at_once(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_addresses[0]
    for i in range(6):  # the orchestrator measures the prefill rate on these
        _, _, chunks = run(collect(address, request(LONG_PROMPT, request_id=f"adm-warm-{i}")))
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    prefill = cluster.procs["prefill-0"]
    prefill.signal(signal.SIGSTOP)
    try:

        async def scenario() -> tuple[grpc.aio.AioRpcError, float]:
            held = asyncio.ensure_future(
                collect(address, request(LONG_PROMPT, request_id="adm-held"))
            )
            for _ in range(500):  # until the held request sits in the prefill queue
                with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: not created yet
                    if (await _info(address, "adm-held")).state == "prefilling":
                        break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the held request never reached the prefill worker")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            err = await _refusal(address, request(LONG_PROMPT, request_id="adm-refused"))
            refused_in = loop.time() - t0
            prefill.signal(signal.SIGCONT)
            _, _, chunks = await held
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            return err, refused_in

        err, refused_in = run(scenario())
    finally:
        prefill.signal(signal.SIGCONT)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the SLO of 0.04s" in (err.details() or "")
    assert refused_in < 2.0  # at once, not after queueing
    assert _retry_after(err) > 0
    with pytest.raises(grpc.aio.AioRpcError) as gone:  # nothing was created for it
        run(_info(address, "adm-refused"))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    # Once the queue drained, the same request is admitted.
    _, _, chunks = run(collect(address, request(LONG_PROMPT, request_id="adm-refused")))
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_tenant_at_its_limit_is_refused_on_every_replica(cluster: LocalCluster) -> None:
    first, second = cluster.orchestrator_addresses[:2]
    long_run = request("drain me slowly", max_tokens=2048, request_id="adm-tenant-1")

    async def scenario() -> None:
        async with connect(first) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            call = stub.Generate(long_run, timeout=120, metadata=(("x-pdorch-tenant", "capped"),))
            it = aiter(call)
            await anext(it)  # running: the tenant's one slot is taken
            for address in (first, second):
                err = await _refusal(address, request("hi", request_id=""), tenant="capped")
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "tenant 'capped' has 1 requests in flight" in (err.details() or "")
                assert _retry_after(err) > 0
            # Other tenants are not affected; a resubmission of the running one follows it.
            _, _, chunks = await collect(second, request("hi", request_id="adm-other"))
            assert chunks[-1].finish_reason
            async for _ in it:  # to its end
                pass

    run(scenario())
    # The slot is free again once the request ended.
    _, _, chunks = run(collect(second, request("hi", request_id="adm-tenant-2")))
    assert chunks[-1].finish_reason


def test_a_tenant_naming_another_tenants_keys_leaves_it_be(cluster: LocalCluster) -> None:
    """Issue 17: tenant ``capped:live``'s cost totals were tenant capped's live set (the
    limit's count), and every later request of capped failed with WRONGTYPE."""
    address = cluster.orchestrator_addresses[0]
    tenants = ("capped:live", "capped")
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)

    def finished(tenant: str) -> int:
        return int(float(client.hget(Keys().tenant_cost(tenant), "requests") or 0))

    async def as_tenant(rid: str, tenant: str) -> list[orchestrator_pb2.GenerateChunk]:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            call = stub.Generate(
                request("hi", request_id=rid), timeout=30, metadata=(("x-pdorch-tenant", tenant),)
            )
            return [c async for c in call]

    try:
        before = {t: finished(t) for t in tenants}
        for n, tenant in enumerate(tenants * 2):
            chunks = run(as_tenant(f"adm-named-{n}", tenant))
            assert chunks[-1].finish_reason, tenant
        wait_for(
            lambda: all(finished(t) == before[t] + 2 for t in tenants), 10, "each tenant's totals"
        )
    finally:
        client.close()


def test_conditional_disaggregation_is_decided_and_recorded(cluster: LocalCluster) -> None:
    """Replica 1 runs "auto": before it has measured anything it disaggregates; once it
    knows the rates, a short prompt on an idle decode worker of the same kind is cheaper
    locally (no transfer to pay, no stream to stall) and runs aggregated, reason recorded."""
    address = cluster.orchestrator_addresses[1]
    reasons = []
    for i in range(15):  # 5 to measure, then aggregated once the decode worker is idle
        if i >= 5:  # heartbeats lag: let the decode worker's say it runs nothing now
            wait_for(
                lambda: all(w.active == 0 for w in workers(cluster) if w.role == "decode"),
                10, "an idle decode worker in its heartbeat",
            )  # fmt: skip
        rid = f"adm-cond-{i}"
        _, _, chunks = run(collect(address, request("short", max_tokens=4, request_id=rid)))
        assert chunks[-1].finish_reason
        info = run(_info(address, rid))
        reasons.append((info.mode, info.placement, info.kv_bytes))
        if info.mode == "aggregated":
            break
    assert reasons[0][:2] == ("disaggregated", "disaggregated: rates not measured yet")
    assert reasons[0][2] > 0
    mode, why, kv = reasons[-1]
    assert (mode, kv) == ("aggregated", 0), reasons
    assert why.startswith("aggregated: prompt"), why
    assert "local prefill stalls" in why
    # A fixed threshold on replica 0 ("0": off) always disaggregates, and says so.
    _, _, _ = run(collect(cluster.orchestrator_addresses[0], request("x", request_id="adm-c0")))
    info = run(_info(cluster.orchestrator_addresses[0], "adm-c0"))
    assert (info.mode, info.placement) == (
        "disaggregated", "disaggregated (conditional disaggregation off)"
    )  # fmt: skip


def test_calls_beyond_max_inflight_are_refused_at_the_door(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[2]  # --max-inflight 1
    long_run = request("drain me slowly", max_tokens=2048, request_id="adm-door-1")

    async def scenario() -> None:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            call = stub.Generate(long_run, timeout=120)
            it = aiter(call)
            await anext(it)  # one call in progress: the limit
            err = await _refusal(address, request("hi", request_id="adm-door-2"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "serves 1 calls (limit 1)" in (err.details() or "")
            assert _retry_after(err) > 0
            # A resubmission of the running request is not a new call: it follows it.
            again = stub.Generate(long_run, timeout=120)
            first = await anext(aiter(again))
            assert first.index == 0
            again.cancel()
            async for _ in it:  # to its end
                pass

    run(scenario())
    _, _, chunks = run(collect(address, request("hi", request_id="adm-door-2")))
    assert chunks[-1].finish_reason
