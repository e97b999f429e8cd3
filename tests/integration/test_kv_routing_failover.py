"""Issue 20 item 5: failover keeps its guarantees with KV-cache-aware routing on. The
workers holding a conversation's prefix (simulated, ``--sim-prefix-cache``, one process
each) are SIGKILLed between turns. The next turn completes on the survivors with
contiguous tokens: at once (the index still lists the dead: failover), or once their
heartbeats lapse (the index forgot them: placed on survivors, re-prefilled in full). With
suffix-only transfer (on by default), turn 2 moves only the KV after turn 1's blocks, and
turn 3 on the survivors the whole KV."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster, connect
from orchestrator.core.prefix import block_keys, decode_keys
from orchestrator.store.keys import Keys
from orchestrator.workers.sim_engine import SIM_BLOCK
from tests.integration.conftest import (
    collect,
    outlive_the_workers_listing,
    request,
    run,
    wait_for,
    workers,
)

pytestmark = pytest.mark.failover  # starts real processes (Redis, workers, orchestrators)

SIM = "llama-3-8b@H100"
Info = orchestrator_pb2.RequestInfo


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0)
    with c:
        for i in range(2):  # one process per worker: each can be killed alone
            c.start_sim_workers("prefill", 1, SIM, i, "--sim-prefix-cache")
            c.start_sim_workers("decode", 1, SIM, i, "--sim-prefix-cache")
        c.wait_live_workers(2, 2, timeout_s=60)
        c.start_orchestrator(0, 0, "--aggregate-below", "0")
        yield c


def _proc(worker_id: str) -> str:
    """``prefill-s1`` (the only worker of process 1) -> the process ``prefill-sim-1``."""
    role, index = worker_id.split("-")
    return f"{role}-sim-{index[1:]}"


async def _info(address: str, rid: str) -> Info:
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10)


def _reported(cluster: LocalCluster, worker_id: str, tokens: list[int]) -> bool:
    for w in workers(cluster):
        if w.worker_id == worker_id:
            return set(block_keys(tokens, SIM_BLOCK)) <= set(decode_keys(w.kv_prefix))
    return False


def _turn(cluster: LocalCluster, tokens: list[int], rid: str) -> tuple[list[int], Info]:
    address = cluster.orchestrator_addresses[0]
    ids, _, chunks = cast(
        "tuple[list[int], str, list[orchestrator_pb2.GenerateChunk]]",
        run(collect(address, request(tokens, max_tokens=8, request_id=rid))),
    )
    produced = 0
    for c in chunks:  # contiguous: each chunk starts where the previous one ended
        if c.token_ids:
            assert c.index == produced, (c.index, produced)
            produced += len(c.token_ids)
    assert len(ids) == 8
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return ids, cast("Info", run(_info(address, rid)))


def _field(cluster: LocalCluster, rid: str, name: str) -> str:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return client.hget(Keys().request(rid), name) or ""
    finally:
        client.close()


def _cost(cluster: LocalCluster, rid: str) -> dict[str, Any]:
    return cast("dict[str, Any]", json.loads(_field(cluster, rid, "cost") or "{}"))


def _kv_per_token(cluster: LocalCluster) -> int:
    return next(w.kv_bytes_per_token for w in workers(cluster) if w.role == "decode")


def _kill_holders(cluster: LocalCluster) -> tuple[list[int], set[str]]:
    """Two turns of a chat (the second reusing the first's cache), then SIGKILL to the
    workers holding it; the third turn's prompt and the dead workers' ids."""
    system = list(range(100, 100 + 10 * SIM_BLOCK))
    turn1 = [*system, *range(5000, 5020)]
    ids1, first = _turn(cluster, turn1, "chat-1")
    for holder in (first.prefill_worker, first.decode_worker):
        wait_for(lambda h=holder: _reported(cluster, h, turn1), 10, f"{holder}'s blocks")
    outlive_the_workers_listing()
    turn2 = [*turn1, *ids1, *range(7000, 7030)]
    ids2, second = _turn(cluster, turn2, "chat-2")
    # Routing on: turn 2 went where turn 1 is cached, and reused it.
    assert (second.prefill_worker, second.decode_worker) == (
        first.prefill_worker,
        first.decode_worker,
    )
    assert "prefill reuses" in second.placement, second.placement
    assert _cost(cluster, "chat-2")["prefill_reused_tokens"] > 0
    # ... and its decode worker was sent only the KV after turn 1's 11 whole blocks.
    assert "KV suffix only" in second.placement, second.placement
    assert second.kv_bytes == (len(turn2) - 11 * SIM_BLOCK) * _kv_per_token(cluster)
    dead = {second.prefill_worker, second.decode_worker}
    for holder in dead:
        cluster.procs[_proc(holder)].signal(signal.SIGKILL)
    return [*turn2, *ids2, *range(9000, 9010)], dead


def test_a_stale_index_fails_over_to_the_survivors(cluster: LocalCluster) -> None:
    """Turn 3 sent at once, while the index still lists the dead holders: the attempts on
    them fail over, and the request completes on the survivors, tokens contiguous."""
    turn3, dead = _kill_holders(cluster)
    per_token = _kv_per_token(cluster)  # before the dead drop out
    _, third = _turn(cluster, turn3, "chat-3")
    assert third.state == "done", third.error
    assert third.prefill_worker not in dead
    assert third.decode_worker not in dead
    assert int(_field(cluster, "chat-3", "failovers") or 0) >= 1  # it did try a dead one
    # The survivor holds none of it: the whole KV moved (no suffix claimed of the dead).
    assert "suffix" not in third.placement, third.placement
    assert third.kv_bytes == len(turn3) * per_token


def test_the_index_forgets_dead_holders(cluster: LocalCluster) -> None:
    """Once the dead holders' heartbeats lapse, their prefixes leave the index: turn 3 is
    placed on the survivors with no claim of reuse, no failover, and re-prefilled in full."""
    turn3, dead = _kill_holders(cluster)
    wait_for(lambda: not dead & {w.worker_id for w in workers(cluster)}, 15, "heartbeats gone")
    outlive_the_workers_listing()
    _, third = _turn(cluster, turn3, "chat-3")
    assert third.state == "done", third.error
    assert {third.prefill_worker, third.decode_worker}.isdisjoint(dead)
    assert "reuses" not in third.placement, third.placement
    assert "holds" not in third.placement, third.placement
    assert "suffix" not in third.placement, third.placement
    assert third.kv_bytes == len(turn3) * _kv_per_token(cluster)
    assert int(_field(cluster, "chat-3", "failovers") or 0) == 0
    assert _cost(cluster, "chat-3")["prefill_reused_tokens"] == 0
    assert _cost(cluster, "chat-3")["reuse_saved_usd"] == 0.0
