"""Simulated workers: in one process over real gRPC and TCP KV (fast), and at scale behind
the real orchestrator and Redis (slow)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from orchestrator.api import common_pb2, worker_pb2, worker_pb2_grpc
from orchestrator.bench.load import LoadSpec, prompt, run_load
from orchestrator.cluster import LocalCluster
from orchestrator.core.records import WorkerInfo
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.fleet import SharedSender, WorkerFleet, member_settings
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec
from tests.integration.conftest import collect, request
from transport.base import TransportSettings
from transport.tcp import TcpDataPlane, tcp_receiver

PREFILL = "llama-3-8b@H100"
DECODE = "llama-3-8b@L4"


def expected_tokens(
    engine: SimEngine, ids: list[int], n: int, sampling: SamplingParams
) -> list[int]:
    """What any correct run produces: the engine's tokens computed right here."""
    r = engine.prefill(ids, sampling)
    state = engine.start_decode(r.kv, ids, r.first_token, 1, sampling)
    out = [r.first_token]
    while len(out) < n:
        out += engine.decode_step([state])
    return out


async def _fleet_round_trip() -> None:
    engine = SimEngine(SimSpec.parse(DECODE))
    published: list[WorkerInfo] = []

    async def publish(info: WorkerInfo) -> None:
        published.append(info)

    ts = TransportSettings()
    sender = SharedSender(TcpDataPlane(), ts, users=2)
    prefill = [
        Worker(
            engine,
            member_settings(WorkerSettings(role="prefill"), i, 2),
            publish,
            sender=sender,
            runner=SimRunner(engine),
        )
        for i in range(2)
    ]
    decode = Worker(
        engine,
        WorkerSettings(role="decode", worker_id="decode-0"),
        publish,
        receiver=tcp_receiver(ts, engine.info.model_spec()),
        runner=SimRunner(engine),
    )
    fleet = WorkerFleet([*prefill, decode])
    await fleet.start()
    try:
        assert {i.worker_id for i in published} == {"prefill-0", "prefill-1", "decode-0"}
        assert published[0].kv_bytes_per_token == 512
        ids = engine.tokenize("a prompt of seven words for you")
        sampling = common_pb2.SamplingParams(temperature=0.7, seed=5)
        want = expected_tokens(engine, ids, 8, SamplingParams(0.7, 1.0, 5))
        got: list[list[int]] = []
        for i, p in enumerate(prefill):  # both share one sender and its links
            rid = f"r{i}"
            async with (
                grpc.aio.insecure_channel(p.address) as pc,
                grpc.aio.insecure_channel(decode.address) as dc,
            ):
                resp = await worker_pb2_grpc.PrefillServiceStub(pc).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=rid,
                        epoch=1,
                        token_ids=ids,
                        sampling=sampling,
                        kv_target=decode.kv_address,
                    ),
                    timeout=10,
                )
                assert resp.kv_bytes == len(ids) * 512
                # Simulated time: the perfmodel's prefill on an L4, at least.
                assert resp.prefill_ms >= engine.spec.prefill_s(len(ids)) * 1000 - 5
                out = [resp.first_token]
                async for chunk in worker_pb2_grpc.DecodeServiceStub(dc).Decode(
                    worker_pb2.DecodeRequest(
                        request_id=rid,
                        epoch=1,
                        token_ids=ids,
                        last_token=resp.first_token,
                        generated=1,
                        sampling=sampling,
                        max_tokens=8,
                        prompt_tokens=len(ids),
                    ),
                    timeout=10,
                ):
                    out += [t for t in chunk.token_ids if chunk.index > 0]
                got.append(out)
            async with grpc.aio.insecure_channel(decode.address) as dc:
                aggregated = [
                    t
                    async for chunk in worker_pb2_grpc.WorkerServiceStub(dc).Generate(
                        worker_pb2.AggregatedRequest(
                            request_id=f"agg{i}",
                            epoch=1,
                            token_ids=ids,
                            sampling=sampling,
                            max_tokens=8,
                            prompt_tokens=len(ids),
                        ),
                        timeout=10,
                    )
                    for t in chunk.token_ids
                ]
            assert aggregated == want
        assert got == [want, want]
    finally:
        await fleet.stop()


def test_sim_workers_split_equals_aggregated_in_one_process() -> None:
    asyncio.run(_fleet_round_trip())


# ------------------------------------------------------------------------- at scale


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0)
    with c:
        c.start_sim_workers("prefill", 10, PREFILL)
        c.start_sim_workers("decode", 10, DECODE)
        c.wait_live_workers(10, 10, timeout_s=60)
        c.start_orchestrator(0)
        yield c


@pytest.mark.slow
def test_two_hundred_concurrent_requests_through_twenty_sim_workers(
    sim_cluster: LocalCluster,
) -> None:
    address = sim_cluster.orchestrator_addresses[0]
    engine = SimEngine(SimSpec.parse(DECODE))

    async def main() -> list[tuple[list[int], list[int]]]:
        async def one(n: int) -> tuple[list[int], list[int]]:
            text = prompt(n, 20)
            ids, _, chunks = await collect(address, request(text, max_tokens=12))
            position = 0
            for c in chunks:  # indices contiguous from 0
                if c.token_ids:
                    assert c.index == position
                    position += len(c.token_ids)
            assert position == 12
            assert chunks[-1].prefill_worker.startswith("prefill-s0-")
            assert chunks[-1].decode_worker.startswith("decode-s0-")
            return ids, expected_tokens(engine, engine.tokenize(text), 12, SamplingParams())

        return await asyncio.gather(*(one(n) for n in range(200)))

    for got, want in asyncio.run(main()):
        assert got == want


@pytest.mark.slow
def test_load_generator_against_the_sim_cluster(sim_cluster: LocalCluster) -> None:
    spec = LoadSpec(tuple(sim_cluster.orchestrator_addresses), requests=100, concurrency=50)
    summary = asyncio.run(run_load(spec, tls=sim_cluster.credentials())).summary()
    assert summary["completed"] == 100
    assert summary["not_contiguous"] == 0
    overhead = summary["overhead_ms"]
    assert isinstance(overhead, dict)
    assert 0 < overhead["p50"] <= overhead["p99"]


@pytest.mark.slow
def test_bench_control_plane_json() -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "orchestrator.cli", "bench", "control-plane",
            "--workers", "20", "--concurrency", "100", "--requests", "300",
            "--clients", "1", "--warmup", "40", "--max-tokens", "8", "--json",
            # The scale options: a Redis Cluster of one primary (joined by hand: redis-cli
            # refuses fewer than 3), replica and shard pinned to cores. Every key on one
            # node: 10 simulated workers in a process heartbeat there at once at start.
            "--redis-shards", "1", "--pin", "on",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )  # fmt: skip
    r = json.loads(out.stdout)
    assert "measuring:" not in out.stderr  # progress lines are quiet under --json
    assert r["workers"] == {"prefill": 10, "decode": 10, "processes_per_role": 1}
    assert r["requests"] == r["admitted"] == r["completed"] == 300
    assert r["not_contiguous"] == 0
    assert r["admitted_per_s"] > 0
    for key in ("overhead_ms", "client_ttft_ms", "worker_ttft_ms"):
        assert 0 < r[key]["p50"] <= r[key]["p99"]
    # The workers' TTFT includes at least an H100 prefill of the prompt.
    assert r["worker_ttft_ms"]["p50"] >= 5
    assert 0 < r["orchestrator_cpu_ms_per_request"] < 1000
    assert set(r["cpu_ms_per_request"]) >= {"orchestrators", "prefill_fleet", "decode_fleet"}
    assert set(r["cpu_per_process"]) == {
        "orchestrator-0", "redis-0", "prefill_fleet", "decode_fleet", "clients",
    }  # fmt: skip
    assert r["tokens"] == 300 * 8
    assert r["hiredis"] is True
    assert set(r["pinning"]["cores"]) == {"orchestrator-0", "redis-0"}
    for tier, processes in (("orchestrators", 1), ("redis", 1)):
        projected = r["projection"][tier]
        assert projected["processes"] == processes
        assert projected["us_per_token"] > 0
        assert projected["tokens_per_s_per_core"] > 0
