"""Client load for the control-plane benchmark: many concurrent Generate streams, each timed.

``concurrency`` client slots each run one request after another (a closed loop) until
``requests`` have been sent, over real gRPC channels (``channels`` HTTP/2 connections per
orchestrator, requests spread round-robin over them). Each request's prompt is distinct
(``prompt_words`` words of text; the orchestrator tokenizes it on a worker).

What is measured per request, in milliseconds:

* **client TTFT**: from just before the client calls ``Generate`` to the arrival of the
  first chunk that carries a token;
* **worker TTFT**: the time the workers spent on that first token, from the timings of the
  final chunk: ``prefill_ms`` (the prefill worker, from the call reaching its engine queue to
  the first token) + ``transfer_ms`` (the KV sent and verified by the decode worker). Only
  for disaggregated requests (an aggregated one reports no prefill time);
* **overhead** = client TTFT − worker TTFT: everything the control plane adds before the
  first token — both gRPC hops, validation, the Tokenize call, placement, the store's writes
  (record, transitions, the first journal append), the Prefill call's and the Decode
  stream's own latency, the relay — and any wait for a CPU in those processes.

The clock starts once every channel is connected (TCP, TLS and HTTP/2 set up: the load's
own start-up, reported apart as ``connect_ms``), so the first requests' TTFT is not a
handshake's. A closed loop of equal requests started together stays in step: every
request of a wave ends together and the next ``concurrency`` arrive at once, a burst each
time. ``ramp_s`` spreads the slots' first requests over that many seconds, and the waves
with them, for arrivals that are not a burst.

A request is *admitted* unless the orchestrator refused it up front (``RESOURCE_EXHAUSTED``,
or ``UNAVAILABLE`` before any chunk); it *completed* when its stream ended with a finish
reason. Every completed stream's token indices are checked to be contiguous from 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import grpc

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.api.tls import Tls
from orchestrator.bench.stats import percentile
from orchestrator.rpc import client
from orchestrator.rpc.many_client import ManyClient, StreamFailed, status_of

if TYPE_CHECKING:
    from orchestrator.api.orchestrator_pb2_grpc import OrchestratorAsyncStub

STREAMS_PER_CHANNEL = 100
"""HTTP/2 streams per connection before the client opens another one (servers commonly
advertise 100 concurrent streams)."""

_WORDS = [
    "alpha",
    "bravo",
    "cache",
    "decode",
    "epoch",
    "fence",
    "gather",
    "heartbeat",
    "index",
    "journal",
    "kernel",
    "lease",
    "memory",
    "node",
    "orchestrator",
    "prefill",
    "queue",
    "replica",
    "stream",
    "token",
    "worker",
    "yield",
    "zone",
]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    targets: tuple[str, ...]
    """Orchestrator addresses (host:port); requests are spread over them round-robin."""
    requests: int = 1000
    concurrency: int = 100
    max_tokens: int = 16
    prompt_words: int = 100
    timeout_s: float = 300.0
    """Per request, the whole stream."""
    offset: int = 0
    """First request number (distinct prompts across client processes)."""
    ramp_s: float = 0.0
    """Spread the slots' first requests over this many seconds (`slot_delay`); 0: every
    slot starts at once (arrivals in bursts of ``concurrency``)."""
    connect_timeout_s: float = 10.0
    """How long the load waits for its channels to connect before it starts anyway (a
    target that does not answer then fails the requests, which say why)."""
    chunk_window_ms: int = 0
    """The chunk window each request asks (``GenerateRequest.chunk_window_ms``; 0: the
    orchestrator's)."""
    ramp_phase: float = 0.0
    """Where in its turn, in [0, 1), this process's slots start: load processes sharing a
    ramp (``bench control-plane``: process i of n at i / n) interleave their arrivals."""
    generate_many: bool = False
    """Send the requests on ``GenerateMany`` calls, one per channel (`rpc.many_client`), as
    a gateway multiplexing its users would; False: one ``Generate`` call each."""


@dataclass(slots=True)
class Sample:
    start: float
    """Wall-clock seconds (time.time) when the request was sent."""
    end: float
    code: str = "OK"
    """gRPC status code name of the call ("OK" when the stream ended normally)."""
    admitted: bool = True
    completed: bool = False
    contiguous: bool = True
    tokens: int = 0
    messages: int = 0
    """Stream messages received (chunks, the final one included): the orchestrator's
    relay cost is per message, so tokens per message says what a figure per token means."""
    client_ttft_ms: float | None = None
    worker_ttft_ms: float | None = None
    server_ttft_ms: float | None = None
    """The orchestrator's own TTFT (from admission to relaying the first token)."""
    total_ms: float = 0.0

    @property
    def overhead_ms(self) -> float | None:
        if self.client_ttft_ms is None or self.worker_ttft_ms is None:
            return None
        return self.client_ttft_ms - self.worker_ttft_ms


@dataclass(slots=True)
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU seconds the load process(es) used."""
    connect_ms: float = 0.0
    """How long the channels took to connect, before the first request (the longest of
    the load processes')."""

    def to_json(self) -> str:
        samples = [asdict(s) for s in self.samples]
        return json.dumps({"samples": samples, "cpu_s": self.cpu_s, "connect_ms": self.connect_ms})

    @classmethod
    def from_json(cls, text: str) -> LoadResult:
        data = json.loads(text)
        return cls(
            [Sample(**s) for s in data["samples"]],
            float(data.get("cpu_s", 0.0)),
            float(data.get("connect_ms", 0.0)),
        )

    @classmethod
    def merge(cls, results: Iterable[LoadResult]) -> LoadResult:
        results = list(results)
        return cls(
            [s for r in results for s in r.samples],
            sum(r.cpu_s for r in results),
            max((r.connect_ms for r in results), default=0.0),
        )

    def summary(self) -> dict[str, object]:
        s = self.samples
        admitted = [x for x in s if x.admitted]
        completed = [x for x in s if x.completed]
        window = (max(x.end for x in s) - min(x.start for x in s)) if s else 0.0
        codes: dict[str, int] = {}
        for x in s:
            if not x.completed:
                codes[x.code] = codes.get(x.code, 0) + 1
        overheads = [o for x in completed if (o := x.overhead_ms) is not None]
        return {
            "requests": len(s),
            "connect_ms": round(self.connect_ms, 1),
            "admitted": len(admitted),
            "completed": len(completed),
            "not_completed_by_code": codes,
            "not_contiguous": sum(1 for x in completed if not x.contiguous),
            "aggregated": sum(1 for x in completed if x.worker_ttft_ms is None),
            "messages": sum(x.messages for x in s),
            "duration_s": round(window, 3),
            "admitted_per_s": round(len(admitted) / window, 1) if window else 0.0,
            "completed_per_s": round(len(completed) / window, 1) if window else 0.0,
            "overhead_ms": distribution(overheads),
            "client_ttft_ms": distribution(
                [t for x in completed if (t := x.client_ttft_ms) is not None]
            ),
            "worker_ttft_ms": distribution(
                [t for x in completed if (t := x.worker_ttft_ms) is not None]
            ),
            "server_ttft_ms": distribution(
                [t for x in completed if (t := x.server_ttft_ms) is not None]
            ),
            "total_ms": distribution([x.total_ms for x in completed]),
        }


def distribution(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": round(percentile(values, 50), 2),
        "p90": round(percentile(values, 90), 2),
        "p99": round(percentile(values, 99), 2),
        "max": round(max(values), 2),
        "mean": round(sum(values) / len(values), 2),
    }


def slot_delay(slot: int, spec: LoadSpec) -> float:
    """Seconds slot ``slot`` (of ``spec.concurrency``) waits before its first request: the
    slots start evenly over ``spec.ramp_s``, this process's shifted by ``ramp_phase`` of a
    turn."""
    if spec.ramp_s <= 0:
        return 0.0
    return spec.ramp_s * (slot + spec.ramp_phase) / spec.concurrency


def prompt(n: int, words: int) -> str:
    """Request ``n``'s prompt: distinct per request, ``words`` + 2 words long."""
    body = " ".join(_WORDS[(n * 7 + j * 3) % len(_WORDS)] for j in range(words))
    return f"request {n}: {body}"


def _chunks(
    stub: OrchestratorAsyncStub | ManyClient, req: orchestrator_pb2.GenerateRequest, spec: LoadSpec
) -> AsyncIterable[orchestrator_pb2.GenerateChunk]:
    if isinstance(stub, ManyClient):
        return stub.generate(req, spec.timeout_s)
    return stub.Generate(req, timeout=spec.timeout_s)


async def _one(stub: OrchestratorAsyncStub | ManyClient, n: int, spec: LoadSpec) -> Sample:
    req = orchestrator_pb2.GenerateRequest(
        text=prompt(n, spec.prompt_words),
        max_tokens=spec.max_tokens,
        chunk_window_ms=spec.chunk_window_ms,
    )
    sample = Sample(start=time.time(), end=0.0)
    started = time.perf_counter()
    chunks = 0
    try:
        async for chunk in _chunks(stub, req, spec):
            chunks += 1
            if chunk.token_ids:
                if sample.client_ttft_ms is None:
                    sample.client_ttft_ms = (time.perf_counter() - started) * 1000
                if chunk.index != sample.tokens:
                    sample.contiguous = False
                sample.tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                t = chunk.timings
                sample.completed = True
                sample.server_ttft_ms = t.ttft_ms
                if chunk.prefill_worker:
                    sample.worker_ttft_ms = t.prefill_ms + t.transfer_ms
    except (grpc.aio.AioRpcError, StreamFailed) as exc:
        code, _ = status_of(exc)
        sample.code = code.name
        refused = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
        sample.admitted = not (chunks == 0 and code in refused)
    sample.messages = chunks
    sample.total_ms = (time.perf_counter() - started) * 1000
    sample.end = time.time()
    return sample


async def run_load(spec: LoadSpec, token: str | None = None, tls: Tls | None = None) -> LoadResult:
    """Send ``spec.requests`` requests, ``spec.concurrency`` at a time; one sample each
    (authenticated as ``token``, if given, over TLS with ``tls``: `rpc.client`)."""
    per_target = max(1, math.ceil(spec.concurrency / STREAMS_PER_CHANNEL / len(spec.targets)))
    channels = [
        # A local subchannel pool: otherwise channels to one target share one connection.
        client.channel(t, token, options=[("grpc.use_local_subchannel_pool", 1)], tls=tls)
        for t in spec.targets
        for _ in range(per_target)
    ]
    stubs: list[OrchestratorAsyncStub | ManyClient] = [
        orchestrator_pb2_grpc.OrchestratorStub(c) for c in channels
    ]
    if spec.generate_many:
        stubs = [ManyClient(stub) for stub in stubs]
    cpu_before = time.process_time()
    numbers = itertools.count(spec.offset)
    last = spec.offset + spec.requests
    result = LoadResult()

    async def slot(k: int) -> None:
        await asyncio.sleep(slot_delay(k, spec))
        while (n := next(numbers)) < last:
            result.samples.append(await _one(stubs[n % len(stubs)], n, spec))

    try:
        connecting = time.perf_counter()
        with contextlib.suppress(TimeoutError):  # the load's start-up, not a request's
            async with asyncio.timeout(spec.connect_timeout_s):
                await asyncio.gather(*(c.channel_ready() for c in channels))
        result.connect_ms = (time.perf_counter() - connecting) * 1000
        async with asyncio.TaskGroup() as group:
            for k in range(min(spec.concurrency, spec.requests)):
                group.create_task(slot(k), name=f"pdorch-load-slot-{k}")
    finally:
        for stub in stubs:
            if isinstance(stub, ManyClient):
                await stub.close()
        for channel in channels:
            await channel.close(None)
    result.cpu_s = time.process_time() - cpu_before
    return result
