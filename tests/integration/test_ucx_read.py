"""``--transport ucx-read`` end to end: a real fleet (an orchestrator, 2 prefill and 2 decode
reference workers: the chaos scenarios' shape with one orchestrator fewer, to keep the
suite's time down) whose prefill workers move KV by UCX one-sided reads. Tokens equal the
aggregated run's (what ``ucx`` and ``tcp`` give, `test_end_to_end`); the chaos scenarios
that hit either side of a read in flight — decode-kill, prefill-kill-sending (the side
read from SIGKILLed mid-transfer), prefill-stop-zombie (SIGSTOPped, back after its
requests moved on) — lose, duplicate and skip nothing and leak no KV on it; a decode
worker on ``tcp`` refuses their KV at once with a clear error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from orchestrator.api import common_pb2, worker_pb2, worker_pb2_grpc
from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner, cluster_for, shareable
from orchestrator.cluster import LocalCluster, connect
from tests.integration.conftest import LATE_BOUND_S, collect, request, run, workers
from tests.integration.test_end_to_end import PROMPTS, _tokenize, check_split_equals_aggregated
from transport.backend_names import TCP, UCX_READ
from transport.backends import make_receiver
from transport.base import TransportSettings
from transport.security import load_dir
from transport.ucx import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]


def _on_this_fleet(name: str) -> sc.Scenario:
    """The shipped scenario ``name`` over ``ucx-read``, with one orchestrator."""
    shipped = sc.with_transport(sc.load(name), UCX_READ)
    return replace(
        shipped, cluster=replace(shipped.cluster, orchestrators=1), late_bound_s=LATE_BOUND_S
    )


DECODE_KILL = _on_this_fleet("decode-kill")
READ_FAULTS = [_on_this_fleet(n) for n in ("prefill-kill-sending", "prefill-stop-zombie")]


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalCluster]:
    with cluster_for(DECODE_KILL.cluster) as cluster:
        yield cluster


def test_every_worker_runs_ucx_read(fleet: LocalCluster) -> None:
    for name in ("prefill-0", "decode-0", "decode-1"):
        argv = fleet.procs[name].args
        assert argv[argv.index("--transport") + 1] == UCX_READ, name
    # A decode worker's receiver is UCX's, which takes either UCX sender; a prefill worker
    # publishes its sender's, which placement pairs with receivers that take it.
    assert {w.transport for w in workers(fleet) if w.role == "decode"} == {"ucx"}
    assert {w.transport for w in workers(fleet) if w.role == "prefill"} == {"ucx"}


def test_tokens_over_ucx_read_equal_the_aggregated_run(fleet: LocalCluster) -> None:
    address = fleet.orchestrator_addresses[0]
    decode = next(w for w in workers(fleet) if w.role == "decode")
    prompts = PROMPTS[:8]

    async def main() -> None:
        results = await asyncio.gather(*(collect(address, request(p)) for p in prompts))
        for prompt, (ids, _text, chunks) in zip(prompts, results, strict=True):
            await check_split_equals_aggregated(decode.address, prompt, ids, chunks)

    run(main())


@pytest.mark.slow
@pytest.mark.failover
@pytest.mark.timeout(300)
def test_decode_kill_on_ucx_read_loses_nothing(fleet: LocalCluster, tmp_path: Path) -> None:
    """The chaos scenario decode-kill (the busiest decode worker SIGKILLed mid-stream,
    restarted 3 s later; its workload and fault), seed 0, on this fleet through the
    runner's API."""
    assert shareable(DECODE_KILL, fleet)
    runner = ChaosRunner(DECODE_KILL, seed=0, out_dir=tmp_path, pictures=False, cluster=fleet)
    result = asyncio.run(runner.run())
    report = result.to_json()
    print("decode-kill on ucx-read", json.dumps(report))
    assert report["requests"] == DECODE_KILL.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert (report["mismatched"], report["failed"]) == (0, 0), report
    assert result.violations == []  # no_leaks included: every worker's KV back to 0
    assert report["faults"] == 1
    assert report["recoveries"] > 0  # the kill did hit streams


@pytest.mark.slow
@pytest.mark.failover
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", READ_FAULTS, ids=lambda s: s.name)
def test_the_side_read_from_failing_mid_transfer_loses_nothing(
    scenario: sc.Scenario, fleet: LocalCluster, tmp_path: Path
) -> None:
    """A prefill worker SIGKILLed with a transfer in flight (decode reading its registered
    memory), or SIGSTOPped and continued after its requests moved on (its late KV of a
    superseded epoch): every request completes once, contiguous, equal to the reference
    tokens; every worker's KV back to 0; the fault did hit (failovers)."""
    assert shareable(scenario, fleet)
    runner = ChaosRunner(scenario, seed=0, out_dir=tmp_path, pictures=False, cluster=fleet)
    result = asyncio.run(runner.run())
    report = result.to_json()
    print(scenario.name, "on ucx-read", json.dumps(report))
    assert report["requests"] == scenario.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert (report["mismatched"], report["failed"]) == (0, 0), report
    assert result.violations == []  # no_leaks included
    assert report["faults"] == len(scenario.faults)
    assert report["failovers"] > 0  # the fault met transfers


def test_a_tcp_receiver_refuses_ucx_read_kv_at_once(fleet: LocalCluster) -> None:
    """A misconfigured decode side (a TCP receiver, as ``pdorch worker --transport tcp``
    builds it, with the decode identity) behind a ``ucx-read`` prefill worker: the transfer
    fails at once with DATA_LOSS naming the reason (a retryable status: the orchestrator
    re-prefills elsewhere), not a hang, and the receiver holds nothing; the same prefill
    still moves KV to the fleet's UCX decode worker."""
    ws = {w.worker_id: w for w in workers(fleet)}
    prefill, ucx_decode = ws["prefill-0"], ws["decode-0"]

    async def prefill_to(target: str, rid: str) -> worker_pb2.PrefillResponse:
        tokens = await _tokenize(prefill.address, PROMPTS[0])
        async with connect(prefill.address) as channel:
            return await worker_pb2_grpc.PrefillServiceStub(channel).Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid, epoch=1, token_ids=tokens, kv_target=target,
                    sampling=common_pb2.SamplingParams(),
                ),
                timeout=30,
            )  # fmt: skip

    async def main() -> None:
        tls = load_dir(fleet.tls_dir, "decode")
        receiver = make_receiver(TCP, TransportSettings(), tls=tls)
        address = await receiver.start("127.0.0.1", 0)
        try:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await prefill_to(address, "mismatch-1")
            took = time.monotonic() - started
            assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value
            # Over TLS the prefill is an authenticated peer, told the reason.
            assert "tcp has no one-sided path" in (info.value.details() or ""), info.value
            assert took < 5.0, took  # tokenize and prefill included; the refusal takes ms
            assert receiver.inbox.bytes_in_use == 0
        finally:
            await receiver.close()
        ok = await prefill_to(ucx_decode.kv_address, "mismatch-2")
        assert ok.kv_bytes > 0

    run(main())


def test_simulated_workers_on_ucx_read_give_tcps_tokens() -> None:
    """``pdorch worker --sim … --transport ucx-read``: simulated workers honour a named
    transport (their default is tcp) and produce the same tokens as over tcp."""
    prompts = [f"simulated prompt {i} about {w}" for i, w in enumerate(("cats", "GPUs", "tea"))]
    outputs = {}
    for transport in (TCP, UCX_READ):
        with LocalCluster(engine="sim", transport=transport, decode_workers=1) as cluster:
            (decode,) = (w for w in workers(cluster) if w.role == "decode")
            assert decode.transport == ("tcp" if transport == TCP else "ucx")
            address = cluster.orchestrator_addresses[0]

            async def main(address: str = address) -> list[list[int]]:
                results = await asyncio.gather(
                    *(collect(address, request(p, max_tokens=8)) for p in prompts)
                )
                for _ids, _text, chunks in results:
                    assert chunks[-1].kv_bytes > 0
                    assert chunks[-1].decode_worker == "decode-0"
                return [ids for ids, _, _ in results]

            outputs[transport] = run(main())
    assert outputs[UCX_READ] == outputs[TCP]
    assert all(len(ids) == 8 for ids in outputs[TCP])
