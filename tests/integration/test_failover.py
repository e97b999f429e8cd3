"""Failover with real processes killed and stopped: 2 prefill + 2 decode workers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from orchestrator.cluster import LocalCluster, connect
from tests.integration.conftest import collect, request, run, wait_for, workers
from transport.ucx import ucx_available

pytestmark = pytest.mark.failover


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="tiny",
        transport="ucx" if ucx_available() else "tcp",
        prefill_workers=2,
        decode_workers=2,
        orchestrators=2,
        redis_aof=True,
    )
    with c:
        yield c


def _restore(cluster: LocalCluster) -> None:
    """Bring every worker back (restart killed ones, continue stopped ones)."""
    for name, proc in list(cluster.procs.items()):
        if not name.startswith(("prefill", "decode")):
            continue
        proc.signal(signal.SIGCONT)
        if proc.popen.poll() is not None:
            role, index = name.split("-")
            cluster.start_worker(role, int(index))
    cluster.wait_workers(2, 2, timeout_s=60)


async def _info(address: str, rid: str) -> orchestrator_pb2.RequestInfo:
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        return await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid))


def test_decode_worker_killed_mid_stream_continues_elsewhere(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    prompt = "a story about a lighthouse keeper"
    reference, _, _ = run(collect(address, request(prompt, max_tokens=300)))  # type: ignore[misc]

    async def main() -> tuple[list[orchestrator_pb2.GenerateChunk], float]:
        chunks: list[orchestrator_pb2.GenerateChunk] = []
        killed_at = 0.0
        recovery = 0.0
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            req = request(prompt, max_tokens=300, request_id="fo-decode-kill")
            async for chunk in stub.Generate(req, timeout=120):
                chunks.append(chunk)
                got = sum(len(c.token_ids) for c in chunks)
                if killed_at and chunk.token_ids and not recovery:
                    recovery = time.monotonic() - killed_at
                if got >= 20 and not killed_at:
                    info = await _info(address, "fo-decode-kill")
                    cluster.procs[info.decode_worker].signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        return chunks, recovery

    try:
        chunks, recovery = run(main())  # type: ignore[misc]
        ids = [t for c in chunks for t in c.token_ids]
        starts = [c.index for c in chunks if c.token_ids]
        lengths = [len(c.token_ids) for c in chunks if c.token_ids]
        # contiguous indices: every chunk starts where the previous ended
        assert starts == [sum(lengths[:i]) for i in range(len(lengths))]
        assert len(ids) == 300
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        info = run(_info(address, "fo-decode-kill"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.state == "done"
        assert info.epoch >= 2
        assert info.output_tokens == 300
        assert recovery < 10.0
        # Not asserted: re-prefilling prompt + generated tokens may round differently from
        # incremental decoding; the note reports how often the text differs.
        print(f"recovery {recovery * 1000:.0f} ms; identical to no-failure run: {ids == reference}")
    finally:
        _restore(cluster)


def test_stalled_prefill_worker_is_detected_and_bypassed(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    chosen = min(w.worker_id for w in workers(cluster) if w.role == "prefill")
    cluster.procs[chosen].signal(signal.SIGSTOP)  # its heartbeat key lives on for up to 3 s
    try:
        started = time.monotonic()
        ids, _, _chunks = run(  # type: ignore[misc]
            collect(address, request("stall me", max_tokens=8, request_id="fo-prefill-stop"))
        )
        elapsed = time.monotonic() - started
        assert len(ids) == 8
        info = run(_info(address, "fo-prefill-stop"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.state == "done"
        assert info.epoch >= 2
        assert info.prefill_worker != chosen
        assert elapsed < 10.0  # heartbeat TTL (3 s) + watch interval, not a 120 s timeout
        # The zombie wakes up: whatever it still sends carries epoch 1 and must not be used.
        cluster.procs[chosen].signal(signal.SIGCONT)
        wait_for(lambda: cluster.registered().get("prefill", 0) == 2, 15, "the zombie's return")
        wait_for(
            lambda: all(w.kv_used_bytes == 0 for w in workers(cluster) if w.role == "decode"),
            10,
            "no decode worker to hold the zombie's KV",
        )
        after = run(_info(address, "fo-prefill-stop"))
        assert isinstance(after, orchestrator_pb2.RequestInfo)
        assert (after.state, after.epoch, after.output_tokens) == ("done", info.epoch, 8)
    finally:
        _restore(cluster)


def test_prefill_pool_down_runs_aggregated_then_disaggregates_again(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_addresses[0]
    try:
        for name in ("prefill-0", "prefill-1"):
            cluster.procs[name].signal(signal.SIGKILL)
        wait_for(lambda: cluster.registered().get("prefill", 0) == 0, 10, "prefill pool gone")
        ids, _, _ = run(collect(address, request("pool down", request_id="fo-agg")))  # type: ignore[misc]
        assert len(ids) == 16
        info = run(_info(address, "fo-agg"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.mode == "aggregated"
        assert info.decode_worker.startswith("decode")
    finally:
        _restore(cluster)
    run(collect(address, request("pool back", request_id="fo-disagg")))
    info = run(_info(address, "fo-disagg"))
    assert isinstance(info, orchestrator_pb2.RequestInfo)
    assert info.mode == "disaggregated"


def test_both_pools_down_is_unavailable_quickly(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    try:
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            cluster.procs[name].signal(signal.SIGKILL)
        wait_for(lambda: sum(cluster.registered().values()) == 0, 10, "all workers gone")
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            run(collect(address, request("nobody home")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 2.0
    finally:
        _restore(cluster)


def test_concurrent_requests_survive_a_decode_kill(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]

    async def main() -> list[list[int]]:
        tasks = [
            asyncio.create_task(
                collect(address, request(f"c{i}", max_tokens=400, request_id=f"fo-many-{i}"))
            )
            for i in range(6)
        ]
        deadline = time.monotonic() + 20
        while not any(w.active for w in workers(cluster) if w.role == "decode"):
            assert time.monotonic() < deadline, "decoding never started"
            await asyncio.sleep(0.05)  # polling a condition while the requests run
        cluster.procs["decode-0"].signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        return [r[0] for r in results]

    try:
        outputs = run(main())
        assert isinstance(outputs, list)
        assert all(len(o) == 400 for o in outputs)
    finally:
        _restore(cluster)


def test_orchestrator_killed_client_resumes_on_the_other_replica(cluster: LocalCluster) -> None:
    first, second = cluster.orchestrator_addresses[:2]
    req = request("resume me elsewhere", max_tokens=1500, request_id="fo-orch-kill")

    async def main() -> tuple[list[orchestrator_pb2.GenerateChunk], float]:
        received: list[orchestrator_pb2.GenerateChunk] = []
        async with connect(first) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for chunk in stub.Generate(req, timeout=120):
                    received.append(chunk)
                    if sum(len(c.token_ids) for c in received) >= 30:
                        cluster.procs["orchestrator-0"].signal(signal.SIGKILL)
                        killed = time.monotonic()
        have = sum(len(c.token_ids) for c in received)
        req.resume_from_index = have
        recovery = 0.0
        async with connect(second) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            async for chunk in stub.Generate(req, timeout=120):
                if chunk.token_ids and not recovery:
                    recovery = time.monotonic() - killed
                received.append(chunk)
        return received, recovery

    try:
        chunks, recovery = run(main())  # type: ignore[misc]
        with_tokens = [c for c in chunks if c.token_ids]
        starts = [c.index for c in with_tokens]
        lengths = [len(c.token_ids) for c in with_tokens]
        assert starts == [sum(lengths[:i]) for i in range(len(lengths))]  # no dup, no gap
        assert sum(lengths) == 1500
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        info = run(_info(second, "fo-orch-kill"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.state == "done"
        assert info.epoch >= 2
        assert recovery < 10.0
        print(f"orchestrator takeover: next token {recovery * 1000:.0f} ms after the kill")
    finally:
        cluster.start_orchestrator(0)


def test_redis_restart_in_flight_stream_survives_and_admissions_fail_fast(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_addresses[1]
    req = request("through a redis restart", max_tokens=1500, request_id="fo-redis")

    async def main() -> tuple[list[orchestrator_pb2.GenerateChunk], grpc.StatusCode, float]:
        chunks: list[orchestrator_pb2.GenerateChunk] = []
        refused = grpc.StatusCode.OK
        refused_in = 0.0
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            async for chunk in stub.Generate(req, timeout=120):
                chunks.append(chunk)
                if sum(len(c.token_ids) for c in chunks) >= 30 and refused == grpc.StatusCode.OK:
                    cluster.procs["redis"].signal(signal.SIGKILL)
                    cluster.procs["redis"].popen.wait()
                    started = time.monotonic()
                    try:
                        await collect(address, request("admit me during the outage"))
                    except grpc.aio.AioRpcError as exc:
                        refused = exc.code()
                    refused_in = time.monotonic() - started
                    cluster.start_redis(appendonly=True)
        return chunks, refused, refused_in

    chunks, refused, refused_in = run(main())  # type: ignore[misc]
    with_tokens = [c for c in chunks if c.token_ids]
    lengths = [len(c.token_ids) for c in with_tokens]
    assert [c.index for c in with_tokens] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert sum(lengths) == 1500
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert refused_in < 3.0
    info = run(_info(address, "fo-redis"))
    assert isinstance(info, orchestrator_pb2.RequestInfo)
    assert info.state == "done"
    assert info.output_tokens == 1500  # the journal caught up after the restart
    cluster.wait_workers(2, 2, timeout_s=30)


def test_prefill_worker_killed_during_the_kv_transfer_is_re_prefilled(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_addresses[0]
    # prefill-0 stalls (for 30 s) in the middle of every KV it sends; prefill-1 is stopped
    # so that the request surely starts on prefill-0.
    cluster.start_worker("prefill", 0, "--inject-kv-stall", "30")
    cluster.wait_workers(2, 2, timeout_s=60)
    cluster.procs["prefill-1"].signal(signal.SIGSTOP)
    wait_for(lambda: cluster.registered().get("prefill", 0) == 1, 10, "prefill-1 to drop out")

    async def main() -> list[int]:
        task = asyncio.create_task(
            collect(address, request("mid-transfer", max_tokens=8, request_id="fo-xfer"))
        )
        deadline = time.monotonic() + 20
        while not (
            await _exists(address, "fo-xfer")
            and (await _info(address, "fo-xfer")).state == "prefilling"
        ):
            assert time.monotonic() < deadline, "the request never reached prefill"
            await asyncio.sleep(0.05)  # polling a condition while the request runs
        cluster.procs["prefill-1"].signal(signal.SIGCONT)
        await asyncio.sleep(0.5)  # well inside the 30 s stall: the KV is half-sent
        cluster.procs["prefill-0"].signal(signal.SIGKILL)
        ids, _, _ = await task
        return ids

    try:
        ids = run(main())
        assert isinstance(ids, list)
        assert len(ids) == 8
        info = run(_info(address, "fo-xfer"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.state == "done"
        assert info.epoch >= 2
        if info.epoch == 2:  # re-prefilled at once, on the other prefill worker
            assert info.prefill_worker == "prefill-1"
        else:  # prefill-1 failed it too (seen in CI: its TLS handshake, just after SIGCONT,
            # failed under load): never credited to the killed worker, run aggregated
            assert info.prefill_worker != "prefill-0"
        wait_for(
            lambda: all(w.kv_used_bytes == 0 for w in workers(cluster) if w.role == "decode"),
            15,
            "the decode workers to hold no KV (the partial transfer discarded)",
        )
    finally:
        cluster.start_worker("prefill", 0)  # without the fault
        _restore(cluster)


async def _exists(address: str, rid: str) -> bool:
    try:
        await _info(address, rid)
    except grpc.aio.AioRpcError:
        return False
    return True


def test_decode_pool_down_runs_aggregated_on_the_prefill_pool(cluster: LocalCluster) -> None:
    address = cluster.orchestrator_addresses[0]
    try:
        for name in ("decode-0", "decode-1"):
            cluster.procs[name].signal(signal.SIGKILL)
        wait_for(lambda: cluster.registered().get("decode", 0) == 0, 10, "decode pool gone")
        ids, _, _ = run(collect(address, request("no decoders", request_id="fo-agg-p")))  # type: ignore[misc]
        assert len(ids) == 16
        info = run(_info(address, "fo-agg-p"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert info.mode == "aggregated"
        assert info.decode_worker.startswith("prefill")  # the prefill worker ran it all
    finally:
        _restore(cluster)


def test_kv_nobody_decodes_is_freed_after_its_hold_lease(cluster: LocalCluster) -> None:
    """The orchestrator died (or the client left) between prefill and decode: the KV sent
    to the decode worker is freed after its hold lease, not kept forever."""
    cluster.start_worker("decode", 1, "--kv-hold", "2")
    cluster.wait_workers(2, 2, timeout_s=60)
    by_id = {w.worker_id: w for w in workers(cluster)}
    decode, prefill = by_id["decode-1"], by_id["prefill-0"]

    async def prefill_only() -> int:
        async with connect(prefill.address) as channel:
            stub = worker_pb2_grpc.PrefillServiceStub(channel)
            resp = await stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="orphan",
                    epoch=1,
                    token_ids=list(range(1, 200)),
                    sampling=common_pb2.SamplingParams(),
                    kv_target=decode.kv_address,
                ),
                timeout=30,
            )
        return int(resp.kv_bytes)

    try:
        kv_bytes = run(prefill_only())
        assert isinstance(kv_bytes, int)
        assert kv_bytes > 0
        held = lambda: next(  # noqa: E731
            w.kv_used_bytes for w in workers(cluster) if w.worker_id == "decode-1"
        )
        wait_for(lambda: held() >= kv_bytes, 5, "the decode worker to report the held KV")
        wait_for(lambda: held() == 0, 10, "the hold lease to free the orphaned KV")
    finally:
        cluster.start_worker("decode", 1)
        _restore(cluster)


def test_client_disconnect_then_resume_on_the_other_replica(cluster: LocalCluster) -> None:
    """The client's connection breaks (not the replica): the request keeps running, and the
    client resumes on the other replica from the index it has — no cancel, no duplicate."""
    first, second = cluster.orchestrator_addresses[:2]
    req = request("walk away and come back", max_tokens=600, request_id="fo-detach")

    async def main() -> list[orchestrator_pb2.GenerateChunk]:
        received: list[orchestrator_pb2.GenerateChunk] = []
        async with connect(first) as channel:
            call = orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(req, timeout=60)
            async for chunk in call:
                received.append(chunk)
                if sum(len(c.token_ids) for c in received) >= 20:
                    call.cancel()  # the client goes away mid-stream
                    break
        req.resume_from_index = sum(len(c.token_ids) for c in received)
        async with connect(second) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            received += [c async for c in stub.Generate(req, timeout=60)]
        return received

    chunks = run(main())
    assert isinstance(chunks, list)
    with_tokens = [c for c in chunks if c.token_ids]
    lengths = [len(c.token_ids) for c in with_tokens]
    assert [c.index for c in with_tokens] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert sum(lengths) == 600
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    info = run(_info(second, "fo-detach"))
    assert isinstance(info, orchestrator_pb2.RequestInfo)
    assert (info.state, info.output_tokens) == ("done", 600)


def test_request_whose_client_never_returns_is_cancelled_after_the_grace(
    cluster: LocalCluster,
) -> None:
    address = cluster.start_orchestrator(2, 0, "--detach-grace", "1")
    try:

        async def main() -> None:
            async with connect(address) as channel:
                stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
                call = stub.Generate(
                    request("nobody waits", max_tokens=2000, request_id="fo-gone"), timeout=60
                )
                async for chunk in call:
                    if chunk.token_ids:
                        call.cancel()
                        break

        run(main())
        started = time.monotonic()

        def cancelled() -> bool:
            info = run(_info(address, "fo-gone"))
            assert isinstance(info, orchestrator_pb2.RequestInfo)
            return info.state == "cancelled"

        wait_for(cancelled, 15, "the abandoned request to be cancelled")
        elapsed = time.monotonic() - started
        assert elapsed >= 0.5  # not at once: the client had its grace to come back
        wait_for(
            lambda: all(w.kv_used_bytes == 0 for w in workers(cluster) if w.role == "decode"),
            10,
            "the decode workers to free the abandoned request's KV",
        )
    finally:
        cluster.procs["orchestrator-2"].stop()


def test_sigterm_drains_then_hands_requests_off(cluster: LocalCluster) -> None:
    """An orchestrator told to stop (SIGTERM, as Kubernetes does) lets streams run for its
    drain grace, then hands its requests to the other replicas instead of cancelling them:
    the client resumes elsewhere and the request completes."""
    address = cluster.start_orchestrator(2, 0, "--drain-grace", "0.5")
    other = cluster.orchestrator_addresses[0]
    # Long enough (seconds on the tiny model) that it can't finish inside the drain grace
    # even when a busy machine delays the client's reads. The tiny model is greedy and
    # deterministic: this prompt runs past 2,048 tokens (the cap) without an EOS ("drain me" stopped
    # at 716, inside the grace on a fast run, and the hand-off was never exercised).
    req = request("drain me slowly", max_tokens=2048, request_id="fo-drain")

    async def main() -> list[orchestrator_pb2.GenerateChunk]:
        received: list[orchestrator_pb2.GenerateChunk] = []
        signalled = False
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for chunk in stub.Generate(req, timeout=60):
                    received.append(chunk)
                    if not signalled and sum(len(c.token_ids) for c in received) >= 20:
                        # Once, as Kubernetes does: a chunk read from the client's buffer
                        # after the process left its event loop would meet SIGTERM's default
                        # action (a CI run saw the exit code -15).
                        cluster.procs["orchestrator-2"].signal(signal.SIGTERM)
                        signalled = True
        req.resume_from_index = sum(len(c.token_ids) for c in received)
        async with connect(other) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            received += [c async for c in stub.Generate(req, timeout=60)]
        return received

    try:
        chunks = run(main())
        assert isinstance(chunks, list)
        assert cluster.procs["orchestrator-2"].popen.wait(15) == 0  # a clean exit
        with_tokens = [c for c in chunks if c.token_ids]
        lengths = [len(c.token_ids) for c in with_tokens]
        assert [c.index for c in with_tokens] == [sum(lengths[:i]) for i in range(len(lengths))]
        info = run(_info(other, "fo-drain"))
        assert isinstance(info, orchestrator_pb2.RequestInfo)
        assert chunks[-1].finish_reason in {
            common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS
        }  # fmt: skip
        assert sum(lengths) > 20  # tokens after the drain came through the other replica
        assert (info.state, info.output_tokens) == ("done", sum(lengths))
        assert info.epoch >= 2  # taken over by a peer, not finished by the drained replica
    finally:
        cluster.procs["orchestrator-2"].stop()
