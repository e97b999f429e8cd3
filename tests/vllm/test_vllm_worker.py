"""`pdorch worker --engine vllm` through the real gRPC API (Redis, orchestrator, one vLLM
worker as processes), checked against vLLM on its own.

Runs in the ``vllm`` extra's environment (`make venv-vllm`; ``pytest -m vllm tests/vllm``).
One vLLM worker serves the module (aggregated: no prefill pool); vLLM's offline ``LLM``
runs once in its own process for the reference outputs. Each vLLM start costs ~20-40 s on
a 2-core machine, so the tests share both.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster
from tests.integration.conftest import wait_for, workers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 24
Request = orchestrator_pb2.GenerateRequest


def _model_dir() -> Path:
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


@pytest.fixture(scope="module")
def offline() -> list[dict[str, Any]]:
    """vLLM's own greedy outputs for the 20 shipped prompts (one batch, as a user runs it)."""
    argv = [sys.executable, "-m", "orchestrator.workers.vllm.offline",
            "--model-dir", str(_model_dir()), "--max-tokens", str(MAX_TOKENS)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["requests"]
    assert len(got) == 20
    return list(got)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="smollm2", engine="vllm", transport="tcp", prefill_workers=0, decode_workers=1,
        ready_timeout_s=600,
    )  # fmt: skip
    with c:
        yield c


def _request(ids: list[int], rid: str) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(
        request_id=rid, max_tokens=MAX_TOKENS, sampling=common_pb2.SamplingParams(temperature=0)
    )
    req.tokens.ids.extend(ids)
    return req


async def _generate(
    address: str, reqs: list[orchestrator_pb2.GenerateRequest], concurrency: int
) -> list[list[orchestrator_pb2.GenerateChunk]]:
    """Every request's chunks, ``concurrency`` streams at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one(req: Request) -> list[orchestrator_pb2.GenerateChunk]:
            async with gate:
                return [c async for c in stub.Generate(req, timeout=300)]

        return list(await asyncio.gather(*(one(r) for r in reqs)))


def _ids(chunks: list[orchestrator_pb2.GenerateChunk]) -> list[int]:
    indices = [c.index for c in chunks if c.token_ids]
    ids = [t for c in chunks for t in c.token_ids]
    expected, at = [], 0
    for c in chunks:
        if c.token_ids:
            expected.append(at)
            at += len(c.token_ids)
    assert indices == expected, "token indices must be contiguous from 0"
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return ids


def _mismatches(
    offline: list[dict[str, Any]], streams: list[list[orchestrator_pb2.GenerateChunk]]
) -> list[str]:
    out = []
    for ref, chunks in zip(offline, streams, strict=True):
        got, want = _ids(chunks), list(ref["output_ids"])
        if got != want:
            pairs = enumerate(zip(got, want, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
            out.append(f"{ref['prompt']!r}: first difference at {first}: {got} != {want}")
    return out


def test_greedy_through_pdorch_equals_vllm_offline(
    cluster: LocalCluster, offline: list[dict[str, Any]]
) -> None:
    """The 20 prompts one at a time through orchestrator → vLLM worker: vLLM's own tokens;
    the heartbeat reports vLLM's block pool, and it is all free again afterwards."""
    reqs = [_request(list(r["prompt_ids"]), f"seq-{i}") for i, r in enumerate(offline)]
    streams = asyncio.run(_generate(cluster.orchestrator_addresses[0], reqs, 1))
    assert _mismatches(offline, streams) == []
    text = "".join(c.text for c in streams[0])
    assert text.strip(), "text deltas are streamed"
    wait_for(lambda: workers(cluster)[0].active == 0, 10, "a heartbeat after the requests")
    (info,) = workers(cluster)
    assert info.fingerprint.startswith("vllm-llama-30L-float32-")
    # SmolLM2: 30 layers x 3 KV heads x 64 x float32 x (K, V); 1 GiB of blocks of 128 tokens
    assert info.kv_bytes_per_token == 46080
    assert info.kv_capacity_bytes % (128 * 46080) == 0
    assert 0.9 * (1 << 30) < info.kv_capacity_bytes <= 1 << 30
    assert info.kv_used_bytes == 0
    assert info.active == 0


@pytest.mark.parametrize("concurrency", [4, 8])
def test_concurrent_streams_batch_and_match(
    cluster: LocalCluster, offline: list[dict[str, Any]], concurrency: int
) -> None:
    """``concurrency`` streams at once on the one worker: still vLLM's greedy tokens, and
    they decode in one batch — each request is charged its share of the steps it was in, so
    a request costs far less engine time than alone (serial decoding would cost as much)."""
    chosen = offline[:concurrency]
    address = cluster.orchestrator_addresses[0]

    def cost(chunks: list[orchestrator_pb2.GenerateChunk]) -> float:
        c = chunks[-1].cost
        return c.aggregated_gpu_s + c.prefill_gpu_s + c.decode_gpu_s

    alone = asyncio.run(
        _generate(address, [_request(list(chosen[0]["prompt_ids"]), f"alone-{concurrency}")], 1)
    )
    reqs = [_request(list(r["prompt_ids"]), f"c{concurrency}-{i}") for i, r in enumerate(chosen)]
    together = asyncio.run(_generate(address, reqs, concurrency))
    assert _mismatches(chosen, together) == []
    assert cost(alone[0]) > 0
    per_token_alone = cost(alone[0]) / len(_ids(alone[0]))
    per_token = sum(cost(s) for s in together) / sum(len(_ids(s)) for s in together)
    assert per_token < 0.6 * per_token_alone, (per_token, per_token_alone)
