"""KV-cache-aware routing end to end: simulated workers with a prefix cache
(``--sim-prefix-cache``) heartbeat their blocks into Redis; a real orchestrator routes a
conversation's second turn to the workers that hold its first, and says so on the record;
with ``--kv-routing off`` it ignores them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from orchestrator.cli import main
from orchestrator.cluster import LocalCluster, connect
from orchestrator.core.hardware import PRICED_KINDS, get_gpu
from orchestrator.core.prefix import block_digests, block_keys, decode_keys
from orchestrator.core.records import WorkerInfo
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

pytestmark = pytest.mark.slow  # starts real processes (Redis, workers, orchestrators)

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
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10)


def _reported(cluster: LocalCluster, worker_id: str, tokens: list[int]) -> bool:
    for w in workers(cluster):
        if w.worker_id == worker_id:
            return set(block_keys(tokens, SIM_BLOCK)) <= set(decode_keys(w.kv_prefix))
    return False


Info = orchestrator_pb2.RequestInfo


def _turns(cluster: LocalCluster, address: str, tag: str, start: int = 100) -> tuple[Info, Info]:
    first, second, _, _ = _conversation(cluster, address, tag, start)
    return first, second


def _conversation(
    cluster: LocalCluster, address: str, tag: str, start: int = 100
) -> tuple[Info, Info, list[int], list[int]]:
    """Two turns; (turn 1's record, turn 2's, turn 2's prompt, turn 2's output)."""
    system = list(range(start, start + 10 * SIM_BLOCK))  # a 160-token system prompt
    turn1 = [*system, *range(5000, 5020)]
    ids, _, _ = cast(
        "tuple[list[int], str, object]",
        run(collect(address, request(turn1, max_tokens=8, request_id=f"{tag}-1"))),
    )
    first = cast("Info", run(_info(address, f"{tag}-1")))
    # Turn 2 waits for the heartbeats that carry turn 1's blocks (a beat a second).
    wait_for(lambda: _reported(cluster, first.prefill_worker, turn1), 10, "turn 1's blocks")
    wait_for(lambda: _reported(cluster, first.decode_worker, turn1), 10, "turn 1's blocks")
    outlive_the_workers_listing()
    turn2 = [*turn1, *ids, *range(7000, 7030)]
    out = _ids(address, turn2, f"{tag}-2")
    return first, cast("Info", run(_info(address, f"{tag}-2"))), turn2, out


def _ids(address: str, prompt: list[int], rid: str) -> list[int]:
    got = cast(
        "tuple[list[int], str, object]",
        run(collect(address, request(prompt, max_tokens=8, request_id=rid))),
    )
    return got[0]


def test_turn_two_goes_where_turn_one_is_cached(cluster: LocalCluster) -> None:
    first, second = _turns(cluster, cluster.orchestrator_addresses[0], "route-on")
    assert second.prefill_worker == first.prefill_worker
    assert second.decode_worker == first.decode_worker
    why = second.placement
    assert "prefill reuses 176/" in why, why  # 11 full blocks of turn 1's 180 tokens
    assert "decode holds " in why, why


def _record_cost(cluster: LocalCluster, rid: str) -> dict[str, Any]:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return cast("dict[str, Any]", json.loads(client.hget(Keys().request(rid), "cost") or "{}"))
    finally:
        client.close()


def test_turn_two_costs_show_the_reused_prefill(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 20 item 4: the prefill worker says how many prompt tokens its cache held; the
    record's cost carries them and what computing them would have cost, and `pdorch cost`
    sums them per tenant."""
    _turns(cluster, cluster.orchestrator_addresses[0], "cost", start=2000)  # a new prompt
    first, second = _record_cost(cluster, "cost-1"), _record_cost(cluster, "cost-2")
    assert first["prefill_reused_tokens"] == 0  # a cold cache: all computed
    assert first["reuse_saved_usd"] == 0.0
    # Turn 2 (218 tokens) found turn 1's 11 full blocks (176 tokens) in the worker's cache.
    assert second["prefill_reused_tokens"] == 11 * SIM_BLOCK
    assert second["reuse_saved_gpu_s"] > 0
    assert second["reuse_saved_usd"] > 0
    # Priced like the bill: the simulated H100's price per GPU-second.
    price = get_gpu(PRICED_KINDS, second["prefill_gpu"]).price_per_hour
    assert second["prefill_gpu"] == "H100"
    assert second["reuse_saved_usd"] == pytest.approx(second["reuse_saved_gpu_s"] * price / 3600)
    assert main(["cost", "--json", "--redis", f"redis://127.0.0.1:{cluster.redis_port}"]) == 0
    totals = json.loads(capsys.readouterr().out)["default"]
    assert totals["prefill_reused_tokens"] >= 11 * SIM_BLOCK
    assert totals["reuse_saved_usd"] >= second["reuse_saved_usd"] * (1 - 1e-12)
    assert main(["cost", "--redis", f"redis://127.0.0.1:{cluster.redis_port}"]) == 0
    assert "saved USD" in capsys.readouterr().out


def test_routing_off_ignores_the_reports(cluster: LocalCluster) -> None:
    _, second = _turns(cluster, cluster.orchestrator_addresses[1], "route-off")
    assert "cached" not in second.placement
    assert "holds" not in second.placement


def _kv_per_token(cluster: LocalCluster) -> int:
    return next(w.kv_bytes_per_token for w in workers(cluster) if w.role == "decode")


def test_turn_two_moves_only_the_suffix(cluster: LocalCluster) -> None:
    """Issue 20 item 3: the decode worker that adopted turn 1 holds its 11 whole blocks; turn
    2's prefill sends only the KV after them (the header names the prefix), and the output
    is the one a whole transfer gives."""
    on, off = cluster.orchestrator_addresses
    first, second, turn2, out = _conversation(cluster, on, "suffix", start=4000)
    assert second.decode_worker == first.decode_worker
    per_token = _kv_per_token(cluster)
    held = 11 * SIM_BLOCK  # turn 1's 180 tokens: 11 whole blocks
    assert len(turn2) == 218
    assert second.kv_bytes == (218 - held) * per_token, second.placement
    assert "KV suffix only: 42/218 tokens sent" in second.placement
    # Routing off: the whole KV moves, the tokens are the same.
    assert _ids(off, turn2, "suffix-2-whole") == out
    whole = cast("Info", run(_info(off, "suffix-2-whole")))
    assert whole.kv_bytes == 218 * per_token
    assert "suffix" not in whole.placement


async def _prefill_and_decode(
    prefill: WorkerInfo, decode: WorkerInfo, rid: str, prompt: list[int], prefix: int
) -> tuple[worker_pb2.PrefillResponse, list[int]]:
    """A Prefill asking a suffix-only transfer of all but ``prefix`` tokens, then the Decode."""
    sampling = common_pb2.SamplingParams()
    async with (
        connect(prefill.address) as pc,
        connect(decode.address) as dc,
    ):
        resp = await worker_pb2_grpc.PrefillServiceStub(pc).Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, epoch=1, token_ids=prompt, sampling=sampling,
                kv_target=decode.kv_address, decode_prefix_tokens=prefix,
                decode_prefix_hash=block_digests(prompt, SIM_BLOCK)[prefix // SIM_BLOCK - 1],
            ),
            timeout=10,
        )  # fmt: skip
        out: list[int] = []  # the stream opens with the prefill's token
        async for chunk in worker_pb2_grpc.DecodeServiceStub(dc).Decode(
            worker_pb2.DecodeRequest(
                request_id=rid, epoch=1, token_ids=prompt, last_token=resp.first_token,
                generated=1, sampling=sampling, max_tokens=8, kv_timeout_s=10,
                prompt_tokens=len(prompt),
            ),
            timeout=10,
        ):  # fmt: skip
            out += chunk.token_ids
    return resp, out


def test_a_decode_worker_lacking_the_prefix_refuses_and_gets_the_whole_kv(
    cluster: LocalCluster,
) -> None:
    """The receiver checks the prefix the header names: a decode worker that does not hold
    it refuses before any payload moves, and the prefill sends the whole KV (same epoch);
    the output is the same. Once it holds the prefix, the suffix alone is taken."""
    ws = workers(cluster)
    prefill = next(w for w in ws if w.role == "prefill")
    decode = next(w for w in ws if w.role == "decode")
    per_token = _kv_per_token(cluster)
    prompt = list(range(9000, 9000 + 3 * SIM_BLOCK + 5))  # new: no worker holds it
    resp, out = cast(
        "tuple[worker_pb2.PrefillResponse, list[int]]",
        run(_prefill_and_decode(prefill, decode, "refused-1", prompt, 3 * SIM_BLOCK)),
    )
    assert resp.kv_prefix_refused
    assert resp.kv_prefix_tokens == 0
    assert resp.kv_bytes == len(prompt) * per_token
    expected = _ids(cluster.orchestrator_addresses[1], prompt, "refused-1-whole")
    assert out == expected
    # The decode worker adopted it: its cache now holds the 3 blocks.
    resp, out = cast(
        "tuple[worker_pb2.PrefillResponse, list[int]]",
        run(_prefill_and_decode(prefill, decode, "refused-2", prompt, 3 * SIM_BLOCK)),
    )
    assert not resp.kv_prefix_refused
    assert resp.kv_prefix_tokens == 3 * SIM_BLOCK
    assert resp.kv_bytes == 5 * per_token
    assert out == expected
