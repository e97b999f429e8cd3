"""KV dtype negotiation end to end: a prefill worker of kind H100, a decode worker of kind T4.

One orchestrator, restarted once per policy (replicas with different policies would take
each other's requests over): ``native`` (float32, the reference),
``auto`` (the float32 KV travels as fp16, half the bytes) and ``fp8`` (e4m3
with per-head scales: a quarter, plus the scales). Every request completes; the request
record names the dtype and why; the tiny model's tokens are compared with native.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from orchestrator.api import orchestrator_pb2
from orchestrator.cluster import LocalCluster
from orchestrator.store.keys import Keys
from orchestrator.workers.model_files import tiny_engine
from tests.integration.conftest import collect, request, run
from transport.ucx import ucx_available

PROMPTS = ["Tell me about cats.", "What is a GPU?", "Rivers flow to the sea because", "Hi"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny",
        transport="ucx" if ucx_available() else "tcp",
        decode_workers=1,
        orchestrators=1,  # auto, the default
        worker_extra={"prefill": ["--gpu-kind", "H100"], "decode": ["--gpu-kind", "T4"]},
    )
    with c:
        yield c


def with_policy(cluster: LocalCluster, policy: str) -> str:
    """Restart the cluster's one orchestrator with ``--kv-dtype policy``; its address."""
    cluster.procs["orchestrator-0"].stop()
    return cluster.start_orchestrator(0, 0, "--kv-dtype", policy)


def generate_all(address: str, tag: str) -> list[tuple[list[int], orchestrator_pb2.GenerateChunk]]:
    async def main() -> list[tuple[list[int], orchestrator_pb2.GenerateChunk]]:
        out = []
        for i, prompt in enumerate(PROMPTS):
            req = request(prompt, max_tokens=MAX_TOKENS, request_id=f"{tag}-{i}")
            ids, _, chunks = await collect(address, req)
            out.append((ids, chunks[-1]))
        return out

    return run(main())


def record_dtype(cluster: LocalCluster, rid: str) -> str:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return str(client.hget(Keys().request(rid), "kv_dtype"))
    finally:
        client.close()


def test_h100_to_t4_sends_fp16_by_default_and_fp8_on_request(pair: LocalCluster) -> None:
    ref = generate_all(with_policy(pair, "native"), "native")
    half = generate_all(with_policy(pair, "auto"), "auto")
    quarter = generate_all(with_policy(pair, "fp8"), "fp8")
    info = tiny_engine().info
    scale_bytes = 2 * info.n_layers * info.kv_heads * 4  # K and V, one float32 per head
    for i, prompt in enumerate(PROMPTS):
        (ref_ids, ref_last), (h_ids, h_last), (q_ids, q_last) = ref[i], half[i], quarter[i]
        for ids, last in (ref[i], half[i], quarter[i]):
            assert last.finish_reason or len(ids) == MAX_TOKENS, prompt
            assert last.kv_bytes > 0
        assert ref_last.kv_bytes == info.kv_bytes_per_token() * ref_last.prompt_tokens
        assert h_last.kv_bytes * 2 == ref_last.kv_bytes
        assert q_last.kv_bytes * 4 == ref_last.kv_bytes + 4 * scale_bytes
        # The transfer bytes (cost uses them) are the smaller payload's.
        assert h_last.cost.transfer_bytes == h_last.kv_bytes
        assert q_last.cost.transfer_bytes == q_last.kv_bytes
        # Token 0 comes from the prefill, before any conversion; fp16 keeps the tiny
        # model's greedy tokens (`pdorch bench precision --model tiny --dtype fp16`: 100%).
        assert h_ids[0] == q_ids[0] == ref_ids[0]
        assert h_ids == ref_ids, prompt
    assert record_dtype(pair, "native-0") == "float32 (policy native)"
    assert record_dtype(pair, "auto-0") == ("float16 (H100→T4: float32 narrowed to fp16)")
    assert record_dtype(pair, "fp8-0").startswith("float8_e4m3 (policy fp8: H100 quantizes")
