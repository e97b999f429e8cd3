"""Issue 17 through the gRPC API on the local cluster (real Redis): request ids that named
another request's Redis keys (``V:journal`` was V's journal, ``Z:owner`` Z's lease) run side
by side with that request, and Redis's own error text never reaches a client.

Tenants that named another tenant's keys (``T:live``) need a tenant limit:
``tests/integration/test_admission.py``.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import redis

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster, connect
from orchestrator.store.keys import Keys
from tests.integration.conftest import collect, request, run

SUFFIXES = (":journal", ":owner", ":client")


def _assert_contiguous(chunks: list[orchestrator_pb2.GenerateChunk], rid: str) -> int:
    """Chunks of one stream start where the previous ended, and the stream finished; its
    token count."""
    with_tokens = [c for c in chunks if c.token_ids]
    lengths = [len(c.token_ids) for c in with_tokens]
    assert [c.index for c in with_tokens] == [sum(lengths[:i]) for i in range(len(lengths))], rid
    assert chunks[-1].finish_reason, rid
    assert {c.request_id for c in chunks} == {rid}
    return sum(lengths)


def test_ids_naming_another_requests_keys_run_side_by_side(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    tag = uuid.uuid4().hex[:8]
    victims = [f"hn-{tag}", f"{{hn-{tag}}}", f"hn:{tag}-日本🙂"]
    attackers = [v + s for v in victims for s in SUFFIXES]

    async def scenario() -> None:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            streams = {}
            for v in victims:  # running (a first chunk relayed) when the others arrive
                it = aiter(
                    stub.Generate(request("victim", max_tokens=24, request_id=v), timeout=60)
                )
                streams[v] = (it, [await anext(it)])
            done = await asyncio.gather(
                *(collect(address, request("other", max_tokens=8, request_id=a)) for a in attackers)
            )
            counts = {
                a: _assert_contiguous(c, a) for a, (_, _, c) in zip(attackers, done, strict=True)
            }
            for v, (it, chunks) in streams.items():
                chunks += [c async for c in it]
                counts[v] = _assert_contiguous(chunks, v)
            for rid, n in counts.items():  # every record is its own, finished, and readable
                info = await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid))
                assert (info.request_id, info.state, info.output_tokens) == (rid, "done", n)

    run(scenario())


def test_redis_error_text_never_reaches_a_client(cluster: LocalCluster) -> None:
    """A key of the wrong type (written behind the store's back, as a colliding id once
    did) is UNAVAILABLE with pdorch's words: WRONGTYPE and script names stay in the log."""
    address = cluster.orchestrator_addresses[0]
    rid = f"hn-poked-{uuid.uuid4().hex[:8]}"
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        client.set(Keys().request(rid), "not a record", ex=60)
    finally:
        client.close()

    async def scenario() -> None:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as got:
                await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid))
            with pytest.raises(grpc.aio.AioRpcError) as generated:
                async for _ in stub.Generate(request("x", request_id=rid), timeout=30):
                    pass
        for err in (got.value, generated.value):
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            details = err.details() or ""
            assert "request store error" in details
            for leaked in ("WRONGTYPE", "script", "user_script", "redis"):
                assert leaked not in details

    run(scenario())
