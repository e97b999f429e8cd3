"""End to end through real processes: Redis, orchestrator, prefill and decode workers."""

from __future__ import annotations

import asyncio
import math
import urllib.request

import grpc
import pytest
import redis

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from orchestrator.cluster import LocalCluster, connect, free_port
from orchestrator.store.keys import Keys
from tests.integration.conftest import collect, request, run, wait_for, workers

PROMPTS = [
    f"Prompt number {i}: tell me about {w}."
    for i, w in enumerate(
        [
            "cats",
            "dogs",
            "GPUs",
            "caches",
            "Paris",
            "rivers",
            "tea",
            "snow",
            "Mars",
            "jazz",
            "bread",
            "trains",
            "clouds",
            "chess",
            "bees",
            "glass",
            "salt",
            "maps",
            "owls",
            "ink",
        ]
    )
]


async def _aggregated(
    address: str, tokens: list[int], max_tokens: int, sampling: common_pb2.SamplingParams
) -> list[int]:
    async with connect(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        out: list[int] = []
        async for chunk in stub.Generate(
            worker_pb2.AggregatedRequest(
                request_id="reference",
                epoch=1,
                token_ids=tokens,
                sampling=sampling,
                max_tokens=max_tokens,
                prompt_tokens=len(tokens),
            ),
            timeout=120,
        ):
            out.extend(chunk.token_ids)
        return out


async def _tokenize(address: str, text: str) -> list[int]:
    async with connect(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        return list((await stub.Tokenize(worker_pb2.TokenizeRequest(text=text), timeout=30)).ids)


async def check_split_equals_aggregated(
    decode_address: str, prompt: str, ids: list[int], chunks: list[orchestrator_pb2.GenerateChunk]
) -> None:
    """A 16-token greedy request's stream: split (prefill and decode workers, the KV moved),
    indices contiguous from 0, and the tokens of the same prompt run aggregated."""
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.prefill_worker.startswith("prefill")
    assert last.decode_worker.startswith("decode")
    assert last.kv_bytes > 0
    indices = [c.index for c in chunks if c.token_ids]
    assert indices == sorted(indices)
    assert indices[0] == 0
    tokens = await _tokenize(decode_address, prompt)
    ref = await _aggregated(decode_address, tokens, 16, common_pb2.SamplingParams(temperature=0))
    assert ids == ref, prompt


def test_twenty_prompts_disaggregated_equal_aggregated(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    decode = next(w for w in workers(cluster) if w.role == "decode")

    async def main() -> None:
        results = await asyncio.gather(*(collect(address, request(p)) for p in PROMPTS))
        for prompt, (ids, _text, chunks) in zip(PROMPTS, results, strict=True):
            await check_split_equals_aggregated(decode.address, prompt, ids, chunks)

    run(main())


def test_seeded_sampling_is_identical_disaggregated(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    decode = next(w for w in workers(cluster) if w.role == "decode")

    async def main() -> None:
        req = request(PROMPTS[3], temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
        ids, _, _ = await collect(address, req)
        tokens = await _tokenize(decode.address, PROMPTS[3])
        ref = await _aggregated(decode.address, tokens, 24, req.sampling)
        assert ids == ref

    run(main())


def test_get_request_reports_state_workers_and_timings(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> orchestrator_pb2.RequestInfo:
        await collect(address, request("hello there", request_id="info-1"))
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            return await stub.GetRequest(
                orchestrator_pb2.GetRequestRequest(request_id="info-1"), timeout=10
            )

    info = run(main())
    assert isinstance(info, orchestrator_pb2.RequestInfo)
    assert info.state == "done"
    assert info.epoch == 1
    assert info.mode == "disaggregated"
    assert info.output_tokens == 16
    assert info.kv_bytes > 0
    assert info.timings.ttft_ms > 0
    assert info.timings.prefill_ms > 0
    assert info.timings.transfer_ms > 0
    assert info.timings.tpot_ms > 0


def test_resubmitting_a_request_id_returns_the_same_stream(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> None:
        req = request("idempotent please", request_id="idem-1", max_tokens=12)
        first = await collect(address, req)
        second = await collect(address, req)
        assert first[0] == second[0]
        assert first[1] == second[1]
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            info = await stub.GetRequest(
                orchestrator_pb2.GetRequestRequest(request_id="idem-1"), timeout=10
            )
        assert info.output_tokens == 12  # journalled once: no second generation
        other = request("a different prompt", request_id="idem-1", max_tokens=12)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(address, other)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS

    run(main())


def test_resubmission_while_running_follows_the_live_request(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> None:
        req = request("follow me", request_id="idem-live", max_tokens=40)
        a, b = await asyncio.gather(collect(address, req), collect(address, req))
        assert a[0] == b[0]
        assert len(a[0]) == 40

    run(main())


def test_stop_strings_end_the_stream(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> None:
        _ids, text, _ = await collect(address, request("stop test", max_tokens=40))
        stop = text[5:7]
        assert stop
        _, cut, chunks = await collect(address, request("stop test", max_tokens=40, stop=(stop,)))
        assert stop not in cut
        assert text.startswith(cut)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP

    run(main())


BAD = [
    ("empty prompt", request("   "), "prompt"),
    ("no prompt", orchestrator_pb2.GenerateRequest(max_tokens=4), "prompt"),
    ("prompt beyond context", request(list(range(200)) * 41, max_tokens=8), "prompt"),
    ("token outside vocab", request([1, 2, 99999]), "prompt"),
    ("max_tokens zero", request("hi", max_tokens=0), "max_tokens"),
    ("max_tokens negative", request("hi", max_tokens=-5), "max_tokens"),
    ("max_tokens above limit", request("hi", max_tokens=1_000_000), "max_tokens"),
    ("temperature NaN", request("hi", temperature=math.nan), "temperature"),
    ("temperature negative", request("hi", temperature=-1.0), "temperature"),
    ("top_p zero", request("hi", top_p=0.0), "top_p"),
    ("top_p above one", request("hi", top_p=1.5), "top_p"),
]


@pytest.mark.parametrize(("case", "req", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_and_creates_nothing(
    cluster: LocalCluster, case: str, req: orchestrator_pb2.GenerateRequest, field: str
) -> None:
    address = cluster.orchestrator_addresses[0]
    req.request_id = f"bad-{case.replace(' ', '-')}"

    async def main() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(address, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.GetRequest(
                    orchestrator_pb2.GetRequestRequest(request_id=req.request_id), timeout=10
                )
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    run(main())


def test_cancel_mid_stream_frees_the_decode_workers_kv(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> None:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            call = stub.Generate(request("a long one", request_id="cancel-1", max_tokens=2000))
            got = 0
            async for chunk in call:
                got += len(chunk.token_ids)
                if got >= 5:
                    break
            wait_for(
                lambda: any(w.active > 0 for w in workers(cluster) if w.role == "decode"),
                10,
                "the decode worker to report the sequence",
            )
            resp = await stub.Cancel(orchestrator_pb2.CancelRequest(request_id="cancel-1"))
            assert resp.state == "cancelled"
            call.cancel()
            info = await stub.GetRequest(
                orchestrator_pb2.GetRequestRequest(request_id="cancel-1"), timeout=10
            )
            assert info.state == "cancelled"
            assert info.output_tokens < 2000

    run(main())
    # Within the KV hold lease (30 s) and a heartbeat: a KV an earlier test's failover left
    # unadopted on a decode worker (its Release lost with the link) is freed by that lease.
    wait_for(
        lambda: all(
            w.active == 0 and w.kv_used_bytes == 0 for w in workers(cluster) if w.role == "decode"
        ),
        45,
        "decode workers to free the cancelled request's KV",
    )


def test_cost_per_request_and_tenant_and_prometheus_metrics(cluster: LocalCluster) -> None:
    """The final chunk and GetRequest say what the request cost (engine seconds per pool ×
    the price of the workers' kind, here CPU at $3.60/h), the tenant's totals add up in
    Redis, and /metrics shows the request."""
    port = free_port()
    address = cluster.start_orchestrator(5, 0, "--metrics-port", str(port), "--price", "CPU=3.6")
    tenant = (("x-pdorch-tenant", "team-a"),)

    async def main() -> tuple[list[orchestrator_pb2.GenerateChunk], orchestrator_pb2.RequestInfo]:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            req = request("what does this cost", max_tokens=40, request_id="cost-1")
            chunks = [c async for c in stub.Generate(req, metadata=tenant, timeout=60)]
            info = await stub.GetRequest(
                orchestrator_pb2.GetRequestRequest(request_id="cost-1"), timeout=10
            )
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Generate(
                    request("x"), metadata=(("x-pdorch-tenant", "t" * 100),), timeout=10
                ).read()
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(request("x", max_tokens=0), timeout=10).read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return chunks, info

    try:
        got = run(main())
        assert isinstance(got, tuple)
        chunks, info = got
        final = chunks[-1]
        cost = final.cost
        assert cost.tenant == "team-a"
        assert cost.prefill_gpu_s > 0
        assert cost.decode_gpu_s > 0
        assert (cost.prefill_gpu, cost.decode_gpu) == ("CPU", "CPU")
        assert cost.transfer_bytes == final.kv_bytes > 0
        gpu_s = cost.prefill_gpu_s + cost.decode_gpu_s
        assert cost.usd == pytest.approx(gpu_s * 3.6 / 3600)
        assert gpu_s * 1000 < final.timings.total_ms  # engine time fits in the wall time
        assert info.cost == cost
        client = redis.Redis(port=cluster.redis_port, decode_responses=True)
        try:
            totals = client.hgetall(Keys().tenant_cost("team-a"))
        finally:
            client.close()
        assert int(totals["requests"]) >= 1
        assert float(totals["usd"]) >= cost.usd * (1 - 1e-12)  # Redis keeps 17 digits
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'pdorch_requests_total{reason="length",state="done"}' in text
        assert 'pdorch_cost_usd_total{tenant="team-a"}' in text
        assert "pdorch_transfer_bytes_total" in text
        assert 'pdorch_rejections_total{code="InvalidRequestError"} 1.0' in text
    finally:
        cluster.procs["orchestrator-5"].stop()
