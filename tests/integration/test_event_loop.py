"""The server processes run on the event loop `cli.event_loop` chooses — the orchestrator on
uvloop unless told otherwise, workers on asyncio's — and serve on it: TLS both ways, a
stream relayed, a cancelled stream, a graceful stop. (Every other integration test runs its
orchestrators on uvloop too.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.api import orchestrator_pb2_grpc
from orchestrator.bench.load import prompt
from orchestrator.cli.event_loop import FALLBACK_WARNING
from orchestrator.cluster import ClusterError, LocalCluster, Proc, connect
from tests.integration.conftest import collect, request, wait_for

UVLOOP = "uvloop.Loop"
ASYNCIO = "asyncio.unix_events._UnixSelectorEventLoop"
pytestmark = pytest.mark.slow  # starts orchestrators and workers, ~20 s

READY = re.compile(r" ready on \S+ .*\(event loop ([\w.]+)\)")


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0)
    with c:
        c.start_sim_workers("prefill", 1, "llama-3-8b@H100")
        c.start_sim_workers("decode", 1, "llama-3-8b@L4")
        c.wait_live_workers(1, 1, timeout_s=60)
        yield c


def loops(proc: Proc) -> list[str]:
    """The event loop of each ``ready on`` line ``proc`` printed."""
    return READY.findall(proc.tail(100_000))


def relays(address: str) -> None:
    """A 24-token stream through ``address`` over mutual TLS, indices contiguous from 0."""
    ids, _, chunks = asyncio.run(collect(address, request(prompt(1, 20), max_tokens=24)))
    assert len(ids) == 24
    position = 0
    for c in chunks:
        if c.token_ids:
            assert c.index == position
            position += len(c.token_ids)


def cancels(address: str) -> None:
    """A client that cancels its stream after the first chunk: the orchestrator ends the
    request (its record says cancelled) and goes on serving."""

    async def main() -> None:
        async with connect(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            call = stub.Generate(request(prompt(2, 20), max_tokens=200), timeout=60)
            async for _chunk in call:
                break
            call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED

    asyncio.run(main())


def stops_gracefully(proc: Proc) -> None:
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=60) == 0, proc.tail()
    assert "Traceback" not in proc.tail(100_000)


def test_the_orchestrator_runs_on_uvloop_by_default(sim_cluster: LocalCluster) -> None:
    address = sim_cluster.start_orchestrator(0)
    proc = sim_cluster.procs["orchestrator-0"]
    assert loops(proc) == [UVLOOP]
    for name in ("prefill-sim-0", "decode-sim-0"):  # workers: asyncio's unless told
        assert set(loops(sim_cluster.procs[name])) == {ASYNCIO}, name
    relays(address)
    cancels(address)
    relays(address)
    stops_gracefully(proc)


def test_loop_asyncio_runs_on_asyncios_loop(sim_cluster: LocalCluster) -> None:
    address = sim_cluster.start_orchestrator(1, 0, "--loop", "asyncio")
    proc = sim_cluster.procs["orchestrator-1"]
    assert loops(proc) == [ASYNCIO]
    relays(address)
    stops_gracefully(proc)


@contextlib.contextmanager
def uvloop_hidden(cluster: LocalCluster, tmp_path: Path) -> Iterator[None]:
    """The processes ``cluster`` starts meanwhile find a ``uvloop`` that fails to import."""
    shim = tmp_path / "no-uvloop"
    shim.mkdir()
    (shim / "uvloop.py").write_text('raise ImportError("hidden by the test")\n')
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    cluster.env["PYTHONPATH"] = path
    try:
        yield
    finally:
        del cluster.env["PYTHONPATH"]


def test_without_uvloop_the_orchestrator_says_so_once_and_runs_on_asyncio(
    sim_cluster: LocalCluster, tmp_path: Path
) -> None:
    with uvloop_hidden(sim_cluster, tmp_path):
        address = sim_cluster.start_orchestrator(2)
    proc = sim_cluster.procs["orchestrator-2"]
    assert loops(proc) == [ASYNCIO]
    assert proc.tail(100_000).count(FALLBACK_WARNING) == 1
    relays(address)
    stops_gracefully(proc)


def test_loop_uvloop_without_uvloop_is_one_line_and_exit_1(
    sim_cluster: LocalCluster, tmp_path: Path
) -> None:
    with uvloop_hidden(sim_cluster, tmp_path), pytest.raises(ClusterError):
        sim_cluster.start_orchestrator(3, 0, "--loop", "uvloop")
    proc = sim_cluster.procs["orchestrator-3"]
    wait_for(lambda: proc.popen.poll() is not None, 30, "the orchestrator to exit")
    assert proc.popen.returncode == 1
    assert "--loop uvloop: uvloop is not installed" in proc.tail()
    assert "Traceback" not in proc.tail()


def test_a_worker_runs_on_uvloop_when_told(sim_cluster: LocalCluster) -> None:
    proc = sim_cluster.start_sim_workers("decode", 1, "llama-3-8b@L4", 1, "--loop", "uvloop")
    try:
        wait_for(lambda: bool(loops(proc)), 60, "the worker's ready line")
        assert loops(proc) == [UVLOOP]
    finally:
        proc.stop()


def test_a_fleet_on_uvloop_moves_kv_over_tls_under_load() -> None:
    """Prefill and decode workers on uvloop, KV links over mutual TLS, 50 requests at once
    (each prefill worker opening links to the decode worker in a burst): every request is
    disaggregated and none fails over. The KV receiver used to accept plaintext and upgrade
    it to TLS; uvloop had already read the senders' ClientHellos, the handshakes stalled and
    requests failed over ("KV transfer failed: connect to … timed out")."""
    from orchestrator.bench.load import LoadSpec, run_load  # noqa: PLC0415 - grpc

    c = LocalCluster(transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0)
    assert c.tls
    with c:
        prefill = c.start_sim_workers("prefill", 2, "llama-3-8b@H100", 0, "--loop", "uvloop")
        decode = c.start_sim_workers("decode", 2, "llama-3-8b@L4", 0, "--loop", "uvloop")
        c.wait_live_workers(2, 2, timeout_s=60)
        assert set(loops(prefill)) == set(loops(decode)) == {UVLOOP}
        address = c.start_orchestrator(0)
        spec = LoadSpec((address,), requests=100, concurrency=50, max_tokens=16)
        result = asyncio.run(run_load(spec, tls=c.credentials()))
        summary = result.summary()
        assert summary["completed"] == 100, summary
        assert summary["aggregated"] == 0, summary  # a failed-over request ends aggregated
        log = c.procs["orchestrator-0"].tail(1_000_000)
        assert "KV transfer failed" not in log
        assert "failover" not in log
