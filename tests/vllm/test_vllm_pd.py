"""Prefill/decode disaggregation with vLLM on both pools: a prefill worker and a decode
worker (`pdorch worker --engine vllm`), the prompt's KV moved by pdorch's connector through
pdorch's transport, checked against vLLM on its own (greedy, the 20 shipped prompts; seeded,
with pdorch's sampler in both); and log probabilities across the split (issue 17 defect 13:
the prefill's response carries the prompt's and the first token's, the decode stream the
rest), equal to the log-softmax of transformers' raw logits on the same model."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from orchestrator.cluster import LocalCluster, connect
from orchestrator.core.prefix import block_keys, decode_keys
from tests.integration.conftest import wait_for, workers
from tests.vllm.conftest import (
    MAX_TOKENS,
    SEEDED,
    generate,
    greedy,
    logprob_errors,
    mismatches,
    prompt_ids,
    scored_stream,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def pd_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="smollm2", engine="vllm", transport="tcp", prefill_workers=1, decode_workers=1,
        ready_timeout_s=900,
    )  # fmt: skip
    with c:
        yield c


def test_pd_greedy_equals_vllm_offline_and_blocks_come_back(
    pd_cluster: LocalCluster, offline: list[dict[str, Any]]
) -> None:
    """Every request is split (prefill on one engine, KV pushed, decode on the other) and
    yields vLLM's own tokens; afterwards the decode worker holds no KV and every block of
    its pool is free again."""
    reqs = [greedy(list(r["prompt_ids"]), f"pd-{i}") for i, r in enumerate(offline)]
    streams = asyncio.run(generate(pd_cluster.orchestrator_addresses[0], reqs, 2))
    for r, chunks in zip(offline, streams, strict=True):
        final = chunks[-1]
        assert final.prefill_worker == "prefill-0", r["prompt"]
        assert final.decode_worker == "decode-0"
        blocks = -(-len(r["prompt_ids"]) // 128)  # only the request's blocks move
        assert 0 < final.kv_bytes <= blocks * 128 * 46080
    assert mismatches(offline, streams) == []

    def settled() -> bool:
        decode = [w for w in workers(pd_cluster) if w.role == "decode"]
        return bool(decode) and decode[0].active == 0 and decode[0].kv_used_bytes == 0

    wait_for(settled, 15, "the decode worker's blocks and held KV to return to zero")
    # Both publish the backend they move KV with: placement pairs them by it.
    assert {w.role: w.transport for w in workers(pd_cluster)} == {"prefill": "tcp", "decode": "tcp"}


def test_pd_seeded_equals_the_uninterrupted_request(
    pd_cluster: LocalCluster,
    offline_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """Seeded requests split across two vLLM engines — the prefill samples output token 0 in
    one vLLM request, the decode continues in another — draw the tokens of the uninterrupted
    request (vLLM on its own, the 20 prompts in one batch, pdorch's sampler); vLLM's own
    seeded sampling would restart its generator in the decode's request. `test_vllm_worker`
    checks the same reference aggregated on one vLLM worker."""
    chosen = offline_runs[1][:6]
    reqs = [greedy(list(r["prompt_ids"]), f"pd-seeded-{i}", *SEEDED) for i, r in enumerate(chosen)]
    streams = asyncio.run(generate(pd_cluster.orchestrator_addresses[0], reqs, 3))
    for chunks in streams:
        assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-0")
    assert mismatches(chosen, streams) == []


def test_pd_log_probabilities_equal_transformers(pd_cluster: LocalCluster) -> None:
    """Split in two (prefill on one vLLM engine, decode on the other), seeded: the prompt's
    log-probabilities (first token unscored) and each output token's, with 5 alternatives,
    are transformers' within 1e-3 (`test_vllm_worker` checks the aggregated path,
    `test_logprob_conversion` the mapping of vLLM's results to pdorch's ranking)."""
    prompt = prompt_ids("The capital of France is")
    chunks = scored_stream(pd_cluster, prompt, "lp")
    assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-0")
    assert logprob_errors(prompt, chunks) == []


BLOCK = 128
"""vLLM's CPU block size: the unit of the prefix cache, and of what moves."""
KV_PER_BLOCK = BLOCK * 46080
"""SmolLM2-135M fp32: 46,080 bytes of KV per token."""


async def _record(address: str, rid: str) -> orchestrator_pb2.RequestInfo:
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10)


def _turn(cluster: LocalCluster, address: str, ids: list[int], rid: str) -> tuple[list[int], Any]:
    """The request's greedy output and its record."""
    (chunks,) = asyncio.run(generate(address, [greedy(ids, rid)], 1))
    assert (chunks[-1].prefill_worker, chunks[-1].decode_worker) == ("prefill-0", "decode-0")
    return [t for c in chunks for t in c.token_ids], asyncio.run(_record(address, rid))


def test_pd_turn_two_moves_only_the_kv_the_decode_lacks(pd_cluster: LocalCluster) -> None:
    """Issue 20 item 3 with vLLM: turn 2 of a conversation goes to the decode worker that
    served turn 1, which holds turn 1's whole blocks in vLLM's prefix cache; the prefill
    pushes only the blocks after them (the header names that prefix, the decode connector
    checks its cache holds it), and the output is the whole transfer's (an orchestrator
    with ``--kv-suffix off``, same prompt, same workers)."""
    on = pd_cluster.orchestrator_addresses[0]
    off = pd_cluster.start_orchestrator(1, 0, "--kv-suffix", "off")
    words = " ".join(f"Rule {i}: answer in {i + 2} words about the {w}." for i, w in
                     enumerate(["sea", "sky", "town", "road", "forest", "river"] * 4))  # fmt: skip
    turn1 = prompt_ids(f"{words} Now tell me about the moon.")
    assert 2 * BLOCK < len(turn1) < 3 * BLOCK
    out1, _ = _turn(pd_cluster, on, turn1, "suffix-1")
    held = turn1[: 2 * BLOCK]

    def reported() -> bool:
        decode = [set(decode_keys(w.kv_prefix)) for w in workers(pd_cluster) if w.role == "decode"]
        return bool(decode) and set(block_keys(held, BLOCK)) <= decode[0]

    wait_for(reported, 15, "the decode worker's report of turn 1's blocks")
    turn2 = [*turn1, *out1, *prompt_ids(" And about the sun?")]
    cached = (len(turn1) + len(out1) - 1) // BLOCK * BLOCK  # computed by turn 1's decode
    sent = len(turn2) - cached
    out2, second = _turn(pd_cluster, on, turn2, "suffix-2")
    assert f"KV suffix only: {sent}/{len(turn2)} tokens sent" in second.placement
    assert second.kv_bytes == -(-sent // BLOCK) * KV_PER_BLOCK, second.placement
    whole_out, whole = _turn(pd_cluster, off, turn2, "suffix-2-whole")
    assert whole.kv_bytes == -(-len(turn2) // BLOCK) * KV_PER_BLOCK
    assert "suffix" not in whole.placement
    assert out2 == whole_out
    print(f"turn 2 ({len(turn2)} tokens): {second.kv_bytes} KV bytes sent, whole {whole.kv_bytes}")
    # A prefix the decode's cache does not hold (a stale index): refused before any payload,
    # the whole KV follows at the same epoch, same output.
    resp, out = asyncio.run(_split(pd_cluster, turn2, "suffix-stale", hashlib.sha256().digest()))
    assert (resp.kv_prefix_refused, resp.kv_prefix_tokens) == (True, 0)
    assert resp.kv_bytes == whole.kv_bytes
    assert out == out2


async def _split(
    cluster: LocalCluster, prompt: list[int], rid: str, digest: bytes
) -> tuple[worker_pb2.PrefillResponse, list[int]]:
    """A Prefill naming a one-block decode prefix of ``digest``, then the Decode."""
    (prefill,) = [w for w in workers(cluster) if w.role == "prefill"]
    (decode,) = [w for w in workers(cluster) if w.role == "decode"]
    sampling = common_pb2.SamplingParams()
    async with (
        connect(prefill.address) as pc,
        connect(decode.address) as dc,
    ):
        resp = await worker_pb2_grpc.PrefillServiceStub(pc).Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, epoch=1, token_ids=prompt, sampling=sampling,
                kv_target=decode.kv_address, decode_prefix_tokens=BLOCK, decode_prefix_hash=digest,
            ),
            timeout=120,
        )  # fmt: skip
        out: list[int] = []  # the stream opens with the prefill's token
        async for chunk in worker_pb2_grpc.DecodeServiceStub(dc).Decode(
            worker_pb2.DecodeRequest(
                request_id=rid, epoch=1, token_ids=prompt, last_token=resp.first_token,
                generated=1, sampling=sampling, max_tokens=MAX_TOKENS, kv_timeout_s=60,
                prompt_tokens=len(prompt),
            ),
            timeout=120,
        ):  # fmt: skip
            out += chunk.token_ids
    return resp, out
