"""Failover with vLLM workers: a decode worker SIGKILLed mid-stream (1 prefill + 2 decode
vLLM workers as processes). The orchestrator re-prefills prompt + tokens so far and the
stream continues on the other decode worker — the same guarantee as the reference engine's
`tests/integration/test_failover.py`, now with vLLM's scheduler and block pool underneath:
contiguous indices, vLLM's own greedy tokens, and no block left behind on the survivor."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import LocalCluster, connect
from tests.integration.conftest import wait_for, workers
from tests.vllm.conftest import MAX_TOKENS, SEEDED, greedy, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.failover, pytest.mark.timeout(1200)]

KILL_AFTER = 3
"""Tokens the client has seen when the decode worker is killed: past the prefill's token,
well before the end (vLLM would need ~20 more decode steps to finish)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model="smollm2", engine="vllm", transport="tcp", prefill_workers=1, decode_workers=2,
        ready_timeout_s=900,
    )  # fmt: skip
    with c:
        yield c


def _descendants(pid: int) -> set[int]:
    """Every running process below ``pid``: a vLLM worker's engine core and model worker."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        out.add(child)
        todo.extend(parents.get(child, []))
    return out


def _running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
    return alive


async def _kill_decode_mid_stream(
    cluster: LocalCluster, req: orchestrator_pb2.GenerateRequest
) -> tuple[list[orchestrator_pb2.GenerateChunk], str, orchestrator_pb2.RequestInfo]:
    """Stream ``req``; after ``KILL_AFTER`` tokens SIGKILL the decode worker serving it
    as the chaos tool does (`Proc.signal`: its process group, as a pod dies) and check that
    none of its vLLM engine processes outlive it.
    Returns the chunks, the killed worker and the request's final record."""
    chunks: list[orchestrator_pb2.GenerateChunk] = []
    killed = ""
    orphans: set[int] = set()
    lookup = orchestrator_pb2.GetRequestRequest(request_id=req.request_id)
    async with connect(cluster.orchestrator_addresses[0]) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        async for chunk in stub.Generate(req, timeout=300):
            chunks.append(chunk)
            if not killed and sum(len(c.token_ids) for c in chunks) >= KILL_AFTER:
                killed = (await stub.GetRequest(lookup)).decode_worker
                proc = cluster.procs[killed]
                orphans = _descendants(proc.popen.pid)
                proc.signal(signal.SIGKILL)
        info = await stub.GetRequest(lookup)
    assert orphans, "a vLLM worker runs its engine core in child processes"
    wait_for(lambda: not _running(orphans), 10, "the killed worker's vLLM processes to die")
    return chunks, killed, info


def test_decode_worker_killed_mid_stream_continues_on_the_other_with_no_leaked_blocks(
    cluster: LocalCluster, offline: list[dict[str, Any]]
) -> None:
    """The stream survives the kill with contiguous indices and exactly vLLM's offline
    greedy tokens (re-prefilled prompt + generated tokens on the surviving pair); once it
    ends, the surviving decode worker and the prefill worker hold no KV: their vLLM block
    pools are all free again (no blocks leaked by the interrupted transfer or decode)."""
    ref = next(r for r in offline if len(r["output_ids"]) == MAX_TOKENS)
    chunks, killed, info = asyncio.run(
        _kill_decode_mid_stream(cluster, greedy(list(ref["prompt_ids"]), "vfo-decode-kill"))
    )
    assert killed.startswith("decode-"), killed
    assert info.state == "done"
    assert info.epoch >= 2, "the decode worker finished before it was killed: no failover"
    (survivor,) = {"decode-0", "decode-1"} - {killed}
    assert info.decode_worker == survivor
    assert info.output_tokens == MAX_TOKENS
    assert token_ids(chunks) == list(ref["output_ids"])  # contiguous from 0, vLLM's tokens

    def settled() -> bool:
        live = {w.worker_id: w for w in workers(cluster)}
        return (
            killed not in live
            and {survivor, "prefill-0"} <= live.keys()
            and all(w.active == 0 and w.kv_used_bytes == 0 for w in live.values())
        )

    wait_for(settled, 20, f"{survivor} and prefill-0 to report no request and no KV in use")


def test_seeded_stream_killed_mid_decode_continues_with_the_same_draws(
    cluster: LocalCluster,
    offline_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """Seeded sampling keeps pdorch's contract on vLLM: output token *i* is drawn from
    (seed, i) alone, so a seeded stream continued in a new vLLM request after its decode
    worker died is the stream it would have been uninterrupted (vLLM on its own, pdorch's
    sampler, the same seed). After the test above one decode worker is left: killing it
    continues the request aggregated on the prefill worker (Generate from output index k);
    run alone, on the other decode worker (Prefill at index k, then Decode)."""
    ref = next(r for r in offline_runs[1] if len(r["output_ids"]) == MAX_TOKENS)
    decoders = {w.worker_id for w in workers(cluster) if w.role == "decode"}
    req = greedy(list(ref["prompt_ids"]), "vfo-seeded-kill", *SEEDED)
    chunks, killed, info = asyncio.run(_kill_decode_mid_stream(cluster, req))
    assert killed in decoders
    assert info.state == "done"
    assert info.epoch >= 2, "the decode worker finished before it was killed: no failover"
    if decoders - {killed}:
        assert info.decode_worker in decoders - {killed}
    else:
        assert (info.mode, info.decode_worker) == ("aggregated", "prefill-0")
    assert token_ids(chunks) == list(ref["output_ids"])  # contiguous, the same draws

    def settled() -> bool:
        live = workers(cluster)
        return killed not in {w.worker_id for w in live} and all(
            w.active == 0 and w.kv_used_bytes == 0 for w in live
        )

    wait_for(settled, 20, "the surviving workers to report no request and no KV in use")
