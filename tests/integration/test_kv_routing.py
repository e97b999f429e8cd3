"""KV-cache-aware routing end to end: simulated workers with a prefix cache
(``--sim-prefix-cache``) heartbeat their blocks into Redis; a real orchestrator routes a
conversation's second turn to the workers that hold its first, and says so on the record;
with ``--kv-routing off`` it ignores them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import grpc
import pytest

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster
from orchestrator.core.prefix import block_keys, decode_keys
from orchestrator.workers.sim_engine import SIM_BLOCK
from tests.integration.conftest import collect, request, run, wait_for, workers

SIM = "llama-3-8b@H100"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0)
    with c:
        c.start_sim_workers("prefill", 3, SIM, 0, "--sim-prefix-cache")
        c.start_sim_workers("decode", 3, SIM, 0, "--sim-prefix-cache")
        c.wait_live_workers(3, 3, timeout_s=60)
        c.start_orchestrator(0, 0, "--aggregate-below", "0")
        c.start_orchestrator(1, 0, "--aggregate-below", "0", "--kv-routing", "off")
        yield c


async def _info(address: str, rid: str) -> orchestrator_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10)


def _reported(cluster: LocalCluster, worker_id: str, tokens: list[int]) -> bool:
    for w in workers(cluster):
        if w.worker_id == worker_id:
            return set(block_keys(tokens, SIM_BLOCK)) <= set(decode_keys(w.kv_prefix))
    return False


Info = orchestrator_pb2.RequestInfo


def _turns(cluster: LocalCluster, address: str, tag: str) -> tuple[Info, Info]:
    system = list(range(100, 100 + 10 * SIM_BLOCK))  # a 160-token system prompt
    turn1 = [*system, *range(5000, 5020)]
    ids, _, _ = cast(
        "tuple[list[int], str, object]",
        run(collect(address, request(turn1, max_tokens=8, request_id=f"{tag}-1"))),
    )
    first = cast("Info", run(_info(address, f"{tag}-1")))
    # Turn 2 waits for the heartbeats that carry turn 1's blocks (a beat a second).
    wait_for(lambda: _reported(cluster, first.prefill_worker, turn1), 10, "turn 1's blocks")
    wait_for(lambda: _reported(cluster, first.decode_worker, turn1), 10, "turn 1's blocks")
    turn2 = [*turn1, *ids, *range(7000, 7030)]
    run(collect(address, request(turn2, max_tokens=8, request_id=f"{tag}-2")))
    return first, cast("Info", run(_info(address, f"{tag}-2")))


def test_turn_two_goes_where_turn_one_is_cached(cluster: LocalCluster) -> None:
    first, second = _turns(cluster, cluster.orchestrator_addresses[0], "route-on")
    assert second.prefill_worker == first.prefill_worker
    assert second.decode_worker == first.decode_worker
    why = second.placement
    assert "prefill reuses 176/" in why, why  # 11 full blocks of turn 1's 180 tokens
    assert "decode holds " in why, why


def test_routing_off_ignores_the_reports(cluster: LocalCluster) -> None:
    _, second = _turns(cluster, cluster.orchestrator_addresses[1], "route-off")
    assert "cached" not in second.placement
    assert "holds" not in second.placement
