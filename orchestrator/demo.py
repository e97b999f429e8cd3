"""`pdorch demo`: a local cluster, prompts disaggregated, checked against aggregated runs.

Starts Redis, one prefill and two decode workers and an orchestrator as separate processes
on loopback; sends the prompts concurrently through the orchestrator (prefill on one worker,
KV over the transport, decode on another), and runs each prompt again *aggregated* on a
single worker as the reference. Prints, per request, TTFT, TPOT, KV bytes, transfer time and
rate, and whether the disaggregated text equals the aggregated one. With ``--serve`` the
cluster then stays up, its orchestrator serving the OpenAI-compatible gateway on a local port
(printed), until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import redis

from orchestrator.api import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from orchestrator.cluster import ClusterError, LocalCluster, connect
from orchestrator.store.keys import Keys

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Explain the difference between prefill and decode in one sentence.",
    "List three prime numbers.",
    "What does a KV cache store?",
    "Say hello in Spanish.",
)


FIGURES = """\
How to read it: TTFT runs from admission to the first token and includes queueing — the six
prompts arrive together at one prefill worker, so later ones wait for earlier ones. xfer ms
is one KV's whole transfer (set-up, header, checksums, landing in the decode worker): a KV
of kilobytes to a few MB is almost all fixed cost, so its GB/s is far below the link's
(3-4 GB/s over UCX at 64 MiB on a 2-core VM: README "Transport performance"). out stops at
--max-tokens or end of text."""

SHOWN_CHARS = 100
"""Of each output, in the table."""

TRUNCATED = "\N{HORIZONTAL ELLIPSIS}"


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """An output for the table: on one line, at most ``limit`` characters. A replacement
    character at the end — a multi-byte character whose last bytes the ``--max-tokens``
    cut kept out — is dropped and the cut marked, as is one at ``limit``."""
    one_line = " ".join(text.split())
    cut = len(one_line) > limit or one_line.endswith("\ufffd")
    body = one_line[:limit].rstrip("\ufffd").rstrip()
    return f"{body}{TRUNCATED}" if cut else body


@dataclass
class DemoResult:
    id: str
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float
    kv_bytes: int
    transfer_ms: float
    matches_aggregated: bool
    text: str = ""


async def _one(
    stub: orchestrator_pb2_grpc.OrchestratorAsyncStub,
    rid: str,
    prompt: str,
    max_tokens: int,
    chat: bool,
    progress: dict[str, int],
) -> tuple[list[int], str, orchestrator_pb2.GenerateChunk]:
    req = orchestrator_pb2.GenerateRequest(
        request_id=rid, max_tokens=max_tokens, sampling=common_pb2.SamplingParams(temperature=0)
    )
    if chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.text = prompt
    ids: list[int] = []
    text = ""
    final = orchestrator_pb2.GenerateChunk()
    async for chunk in stub.Generate(req, timeout=600):
        ids.extend(chunk.token_ids)
        text += chunk.text
        progress[rid] = len(ids)
        if chunk.finish_reason:
            final = chunk
    return ids, text, final


async def _reference(address: str, rid: str, tokens: list[int], max_tokens: int) -> list[int]:
    """The same prompt run aggregated on one worker (prefill and decode in one process)."""
    async with connect(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        out: list[int] = []
        async for chunk in stub.Generate(
            worker_pb2.AggregatedRequest(
                request_id=f"{rid}-ref",
                epoch=1,
                token_ids=tokens,
                sampling=common_pb2.SamplingParams(temperature=0),
                max_tokens=max_tokens,
                prompt_tokens=len(tokens),
            ),
            timeout=600,
        ):
            out.extend(chunk.token_ids)
        return out


async def _tokens(address: str, prompt: str, chat: bool) -> list[int]:
    async with connect(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        req = worker_pb2.TokenizeRequest()
        if chat:
            req.chat.messages.add(role="user", content=prompt)
        else:
            req.text = prompt
        return list((await stub.Tokenize(req, timeout=60)).ids)


async def _run(cluster: LocalCluster, max_tokens: int, live: bool) -> list[DemoResult]:
    chat = cluster.model != "tiny"
    progress: dict[str, int] = {}
    async with cluster.channel(cluster.orchestrator_addresses[0]) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        stamp = int(time.time())
        rids = [f"demo-{stamp}-{i}" for i in range(len(PROMPTS))]
        tasks = [
            asyncio.create_task(_one(stub, rid, p, max_tokens, chat, progress), name=rid)
            for rid, p in zip(rids, PROMPTS, strict=True)
        ]
        while not all(t.done() for t in tasks):
            if live:
                done = sum(t.done() for t in tasks)
                line = " ".join(f"{progress.get(r, 0):>3}" for r in rids)
                sys.stderr.write(f"\r  tokens per request: {line}   ({done}/{len(tasks)} done)")
                sys.stderr.flush()
            await asyncio.wait(tasks, timeout=0.2)
        if live:
            sys.stderr.write("\n")
        outcomes = [t.result() for t in tasks]
    worker = _a_decode_worker(cluster)
    results = []
    for rid, prompt, (ids, text, final) in zip(rids, PROMPTS, outcomes, strict=True):
        tokens = await _tokens(worker, prompt, chat)
        ref = await _reference(worker, rid, tokens, max_tokens)
        results.append(
            DemoResult(
                id=rid,
                prompt_tokens=final.prompt_tokens,
                output_tokens=len(ids),
                ttft_ms=round(final.timings.ttft_ms, 1),
                tpot_ms=round(final.timings.tpot_ms, 2),
                kv_bytes=final.kv_bytes,
                transfer_ms=round(final.timings.transfer_ms, 2),
                matches_aggregated=ids == ref,
                text=text,
            )
        )
    return results


def _a_decode_worker(cluster: LocalCluster) -> str:
    return str(_heartbeat(cluster, "decode-0")["address"])


def _heartbeat(cluster: LocalCluster, worker: str) -> dict[str, object]:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        raw = client.get(Keys().worker(worker))
    finally:
        client.close()
    if raw is None:
        raise ClusterError(f"{worker} is not registered")
    return dict(json.loads(raw))


def run_demo(
    *,
    model: str,
    transport: str,
    as_json: bool,
    model_cache: Path | None,
    max_tokens: int,
    serve: bool = False,
    http_port: int = 0,
    engine: str = "reference",
    step: Callable[[str], AbstractContextManager[None]] | None = None,
) -> int:
    """Run the demo; with ``serve``, keep the cluster up afterwards with the OpenAI-compatible
    gateway on ``http_port`` (0: a free one) until SIGINT or SIGTERM. ``engine`` "vllm": the
    workers host vLLM (one decode worker: each vLLM engine holds its own block pool).
    ``step(what)``: a context the cluster's start runs in (the CLI's timed progress line)."""
    step = step or (lambda _what: contextlib.nullcontext())
    decode_workers = 1 if engine == "vllm" else 2

    def say(text: str) -> None:
        if not as_json:
            print(text, file=sys.stderr)

    cluster = LocalCluster(
        model=model,
        transport=transport,
        engine=engine,
        decode_workers=decode_workers,
        model_cache=model_cache,
        gateway=serve,
        gateway_port=http_port,
    )
    try:
        what = (
            f"starting Redis, 1 prefill + {decode_workers} decode workers ({model} on "
            f"{engine}, KV over {transport}) and an orchestrator"
        )
        with step(what):
            cluster.start()
        try:
            say(f"cluster up (logs in {cluster.workdir}); sending {len(PROMPTS)} prompts")
            results = asyncio.run(
                _run(cluster, max_tokens, live=not as_json and sys.stderr.isatty())
            )
            served = _served(cluster) if serve else None
            all_match = _report(results, as_json, served)
            if served is not None:
                say(f"serving until Ctrl-C (SIGINT) or SIGTERM; try:\n{_example(*served)}")
                if not serve_until_signalled(cluster, "pdorch demo"):
                    return 1
                say("pdorch demo: stopping the cluster")
        finally:
            cluster.stop()
    except (ClusterError, grpc.RpcError) as exc:
        print(f"pdorch demo: {exc}\n(every process's log: {cluster.workdir})", file=sys.stderr)
        return 1
    return 0 if all_match else 1


def _report(results: list[DemoResult], as_json: bool, served: tuple[str, str] | None) -> bool:
    """Print the results (and the gateway, when serving); whether all matched."""
    all_match = all(r.matches_aggregated for r in results)
    if as_json:
        keys = (
            "id",
            "prompt_tokens",
            "output_tokens",
            "ttft_ms",
            "tpot_ms",
            "kv_bytes",
            "transfer_ms",
            "matches_aggregated",
        )
        report: dict[str, object] = {
            "requests": [{k: asdict(r)[k] for k in keys} for r in results],
            "all_match": all_match,
        }
        if served is not None:
            report |= {"gateway": served[0], "model": served[1]}
        print(json.dumps(report), flush=True)
        return all_match
    print(
        f"{'request':<18}{'prompt':>7}{'out':>5}{'TTFT ms':>9}{'TPOT ms':>9}"
        f"{'KV bytes':>11}{'xfer ms':>9}{'GB/s':>7}  match"
    )
    for r in results:
        rate = r.kv_bytes / (r.transfer_ms / 1000) / 1e9 if r.transfer_ms else 0.0
        print(
            f"{r.id[-18:]:<18}{r.prompt_tokens:>7}{r.output_tokens:>5}{r.ttft_ms:>9.1f}"
            f"{r.tpot_ms:>9.2f}{r.kv_bytes:>11}{r.transfer_ms:>9.2f}{rate:>7.2f}  "
            f"{'yes' if r.matches_aggregated else 'NO'}"
        )
        print(f"    {shown(r.text)}")
    print(
        "all outputs identical to aggregated runs"
        if all_match
        else "SOME OUTPUTS DIFFER from the aggregated runs"
    )
    print(FIGURES)
    if served is not None:
        print(f"OpenAI-compatible gateway: {served[0]}  (model {served[1]!r})", flush=True)
    return all_match


def _served(cluster: LocalCluster) -> tuple[str, str]:
    """(the gateway's base URL for OpenAI clients, the model it serves)."""
    return f"{cluster.gateway_urls[0]}/v1", str(_heartbeat(cluster, "decode-0")["model"])


def _example(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    return f"  curl -s {base_url}/chat/completions -H 'Content-Type: application/json' -d '{body}'"


WORKER_ROLES = ("prefill", "decode")
"""A process whose name starts with one of these is a worker: the cluster serves on
without it (its requests fail over to the others)."""


def serve_until_signalled(
    cluster: LocalCluster, who: str, stops_the_rest: str = "Ctrl-C stops the rest"
) -> bool:
    """Wait for SIGINT/SIGTERM/SIGHUP (True), or for Redis or an orchestrator to exit
    (False: nothing serves without them). A worker that exits is told in one line and the
    cluster serves on without it: its requests fail over to the workers left, and its
    process (its group: what it started) is stopped with the rest. ``stops_the_rest`` says
    how (that line's end). The cluster's processes lead their own process groups: a Ctrl-C
    or a closed terminal reaches this process only, which then stops them all."""
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in signals}
    told: set[str] = set()
    try:
        while not stop.wait(0.5):  # checks the processes twice a second
            for name, proc in list(cluster.procs.items()):
                how = proc.exit_status()  # not reaped: `stop` still reaches its group
                if how is None or name in told or stop.is_set():
                    continue
                if not name.startswith(WORKER_ROLES):
                    print(f"{who}: {name} exited ({how}); stopping", file=sys.stderr)
                    return False
                told.add(name)
                print(
                    f"{who}: {name} exited ({how}); the cluster serves on without it "
                    f"\N{EM DASH} {stops_the_rest}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return True
