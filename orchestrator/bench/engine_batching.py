"""`pdorch bench engine`: does one worker batch concurrent streams?

Starts Redis, one orchestrator and one worker of the chosen engine (no prefill pool: every
request runs aggregated on that worker) as processes through the `pdorch` CLI, then for
each concurrency level C keeps C streams in flight — ``rounds`` × C requests, each a prompt
of the shipped set (`pdorch bench precision`'s 20) through the real gRPC API — and reports
per level the medians of:

* **TTFT**: client-side, call to the first chunk that carries a token;
* **TPOT**: client-side, (last token's arrival − first token's) / (tokens − 1): the time
  between a stream's tokens once it decodes;
* **engine ms / token**: the cost the worker charged (its share of each step) per token.

An engine that decodes concurrent streams in one batch keeps TPOT nearly flat as C grows
(one step serves all C); one that steps them in turn (the reference engine) multiplies it
by about C. The figure of merit is TPOT(max C) / TPOT(1). Pure summarising is in
`summarize`; the rest is processes and sockets.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.bench.precision import prompts_from_text
from orchestrator.cluster import LocalCluster, connect

if TYPE_CHECKING:
    from orchestrator.api.orchestrator_pb2_grpc import OrchestratorAsyncStub


@dataclass(frozen=True, slots=True)
class EngineBench:
    engine: str = "vllm"
    concurrency: tuple[int, ...] = (1, 4, 8)
    rounds: int = 2
    """Requests per stream slot at each level (C × rounds requests)."""
    max_tokens: int = 64
    model: str = "smollm2"
    warmup: int = 2
    """Unmeasured requests before the first level (the engine's first steps are slower)."""


@dataclass(slots=True)
class Sample:
    ttft_ms: float
    tpot_ms: float | None
    tokens: int
    engine_ms: float


@dataclass(slots=True)
class Level:
    concurrency: int
    requests: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    engine_ms_per_token: float = 0.0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)


def summarize(concurrency: int, samples: Sequence[Sample], wall_s: float) -> Level:
    tpots = [s.tpot_ms for s in samples if s.tpot_ms is not None]
    tokens = sum(s.tokens for s in samples)
    return Level(
        concurrency=concurrency,
        requests=len(samples),
        ttft_ms=statistics.median(s.ttft_ms for s in samples),
        tpot_ms=statistics.median(tpots) if tpots else 0.0,
        engine_ms_per_token=sum(s.engine_ms for s in samples) / max(tokens, 1),
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        samples=list(samples),
    )


def _prompts() -> list[str]:
    text = resources.files("orchestrator.bench").joinpath("precision_prompts.txt").read_text()
    return prompts_from_text(text)


async def _one(stub: OrchestratorAsyncStub, prompt: str, max_tokens: int) -> Sample:
    req = orchestrator_pb2.GenerateRequest(
        max_tokens=max_tokens, sampling=common_pb2.SamplingParams(temperature=0)
    )
    req.chat.messages.add(role="user", content=prompt)
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    engine_s = 0.0
    async for chunk in stub.Generate(req, timeout=600):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(chunk.token_ids)
        if chunk.HasField("cost"):
            engine_s = chunk.cost.aggregated_gpu_s + chunk.cost.decode_gpu_s
    tpot = (last - first) * 1000 / (tokens - 1) if tokens > 1 else None
    return Sample((first - started) * 1000, tpot, tokens, engine_s * 1000)


async def _level(address: str, c: int, bench: EngineBench, offset: int) -> Level:
    prompts = _prompts()
    queue = [prompts[(offset + i) % len(prompts)] for i in range(c * bench.rounds)]
    samples: list[Sample] = []
    async with connect(address) as channel:
        stub: OrchestratorAsyncStub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def slot() -> None:
            while queue:
                samples.append(await _one(stub, queue.pop(), bench.max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(c)))
        wall = time.perf_counter() - started
    return summarize(c, samples, wall)


async def _drive(address: str, bench: EngineBench, progress: Callable[[str], None]) -> list[Level]:
    async with connect(address) as channel:
        stub: OrchestratorAsyncStub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for i in range(bench.warmup):
            await _one(stub, _prompts()[i % 20], 8)
    levels = []
    for i, c in enumerate(bench.concurrency):
        progress(f"{c} stream(s): {c * bench.rounds} requests of {bench.max_tokens} tokens")
        levels.append(await _level(address, c, bench, i * 7))
        progress(f"{c} stream(s): TPOT p50 {levels[-1].tpot_ms:.1f} ms")
    return levels


def run_bench(
    bench: EngineBench,
    log_level: str = "WARNING",
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """``progress``: one line per phase (cluster start, each concurrency level)."""
    cluster = LocalCluster(
        model=bench.model,
        engine=bench.engine,
        transport="tcp",
        prefill_workers=0,
        decode_workers=1,
        ready_timeout_s=900,
        log_level=log_level,
    )
    progress(f"starting one {bench.engine} worker with {bench.model} (vLLM: a minute or more)")
    started = time.perf_counter()
    with cluster:
        progress(f"cluster up in {time.perf_counter() - started:.0f} s")
        levels = asyncio.run(_drive(cluster.orchestrator_addresses[0], bench, progress))
    low, high = levels[0], levels[-1]
    return {
        "engine": bench.engine,
        "model": bench.model,
        "max_tokens": bench.max_tokens,
        "levels": [{k: v for k, v in asdict(lv).items() if k != "samples"} for lv in levels],
        "tpot_ratio": high.tpot_ms / low.tpot_ms if low.tpot_ms else None,
        "tpot_ratio_of": [low.concurrency, high.concurrency],
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"engine {result['engine']} ({result['model']}, {result['max_tokens']} tokens), "
        "one worker, aggregated",
        f"{'streams':>8} {'requests':>9} {'TTFT ms':>9} {'TPOT ms':>9} {'engine ms/tok':>14} "
        f"{'tok/s':>7}",
    ]
    for lv in result["levels"]:
        lines.append(
            f"{lv['concurrency']:>8} {lv['requests']:>9} {lv['ttft_ms']:>9.1f} "
            f"{lv['tpot_ms']:>9.1f} {lv['engine_ms_per_token']:>14.1f} {lv['tokens_per_s']:>7.1f}"
        )
    low, high = result["tpot_ratio_of"]
    ratio = result["tpot_ratio"]
    lines.append(f"TPOT at {high} / TPOT at {low}: {ratio:.2f}" if ratio else "no TPOT")
    return "\n".join(lines)
