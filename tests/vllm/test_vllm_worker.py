"""`pdorch worker --engine vllm` through the real gRPC API (Redis, orchestrator, one vLLM
worker as processes), checked against vLLM on its own.

Runs in the ``vllm`` extra's environment (`make venv-vllm`; ``pytest -m vllm tests/vllm``).
One vLLM worker serves the module (aggregated: no prefill pool); vLLM's offline ``LLM``
runs once per session in its own process for the reference outputs (`conftest`). Each
vLLM start costs ~20-40 s on a 2-core machine, so the tests share both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.api import orchestrator_pb2
from orchestrator.cluster import LocalCluster
from tests.integration.conftest import wait_for, workers
from tests.vllm.conftest import (
    SEEDED,
    generate,
    greedy,
    logprob_errors,
    mismatches,
    prompt_ids,
    scored_stream,
    token_ids,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="smollm2", engine="vllm", transport="tcp", prefill_workers=0, decode_workers=1,
        ready_timeout_s=600,
    )  # fmt: skip
    with c:
        yield c


def test_greedy_through_pdorch_equals_vllm_offline(
    cluster: LocalCluster, offline: list[dict[str, Any]]
) -> None:
    """The 20 prompts one at a time through orchestrator → vLLM worker: vLLM's own tokens;
    the heartbeat reports vLLM's block pool, and it is all free again afterwards."""
    reqs = [greedy(list(r["prompt_ids"]), f"seq-{i}") for i, r in enumerate(offline)]
    streams = asyncio.run(generate(cluster.orchestrator_addresses[0], reqs, 1))
    assert mismatches(offline, streams) == []
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
        generate(address, [greedy(list(chosen[0]["prompt_ids"]), f"alone-{concurrency}")], 1)
    )
    reqs = [greedy(list(r["prompt_ids"]), f"c{concurrency}-{i}") for i, r in enumerate(chosen)]
    together = asyncio.run(generate(address, reqs, concurrency))
    assert mismatches(chosen, together) == []
    assert cost(alone[0]) > 0
    per_token_alone = cost(alone[0]) / len(token_ids(alone[0]))
    per_token = sum(cost(s) for s in together) / sum(len(token_ids(s)) for s in together)
    assert per_token < 0.6 * per_token_alone, (per_token, per_token_alone)


def test_seeded_sampling_through_pdorch_equals_vllm_offline(
    cluster: LocalCluster,
    offline_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """Temperature and seed reach pdorch's sampler inside vLLM: a seeded request, aggregated
    on one vLLM worker, gives the tokens vLLM on its own draws with pdorch's sampler for that
    seed (and they are not the greedy ones); `test_vllm_pd` checks the same split in two."""
    greedy_run, seeded_run = offline_runs
    chosen = seeded_run[:8]
    temperature, seed = SEEDED
    reqs = [
        greedy(list(r["prompt_ids"]), f"seeded-{i}", temperature, seed)
        for i, r in enumerate(chosen)
    ]
    streams = asyncio.run(generate(cluster.orchestrator_addresses[0], reqs, 4))
    assert mismatches(chosen, streams) == []
    assert [r["output_ids"] for r in chosen] != [r["output_ids"] for r in greedy_run[:8]]


def test_aggregated_log_probabilities_equal_transformers(cluster: LocalCluster) -> None:
    """Aggregated on one vLLM worker, seeded (pdorch's draw inside vLLM): the prompt's
    log-probabilities (first token unscored) and each output token's, with 5 alternatives,
    are the log-softmax of transformers' raw logits within 1e-3; `test_vllm_pd`
    checks the prefill/decode split."""
    prompt = prompt_ids("The capital of France is")
    chunks = scored_stream(cluster, prompt, "lp")
    assert chunks[-1].decode_worker == "decode-0"
    assert logprob_errors(prompt, chunks) == []
