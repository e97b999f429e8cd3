"""`pdorch bench kv-routing`: a multi-turn chat workload with KV-aware routing off, on, and
on with suffix-only KV transfers.

The workload (`chat_workload`, pure): ``conversations`` chats of ``turns`` turns, all
opening with one shared system prompt; turn *n+1*'s prompt is turn *n*'s prompt, its reply
and a new user message — so a worker that served turn *n* holds all but the new tokens. Plus
``one_shot`` unrelated single requests. Prompts are token ids (no tokenizer involved).

Each mode runs on a fresh cluster of its own (Redis, simulated workers with a prefix cache —
``pdorch worker --sim ... --sim-prefix-cache``, one orchestrator per `MODES`: ``--kv-routing
off``; ``on`` with ``--kv-suffix off`` (the whole KV moves); ``on`` with ``--kv-suffix on``
(a decode worker holding a prefix of the prompt is sent only the KV after it)), so no mode
inherits another's warm caches. Simulated workers are what this
2-core machine can run several of: their prefill time comes from the performance model
(`orchestrator.core.perfmodel`) for the tokens they do not find cached, so the figures show
what routing does to *placement and prefill work*, not vLLM's kernels. Per mode:

* **prefill tokens computed** per request — machine-independent: each prefill worker's
  cache is replayed here (`SimPrefixCache`, the workers' own) over the prompts it was given,
  in the order they finished; the figure routing exists to lower;
* **KV bytes moved** per request (the records' ``kv_bytes``: what crossed the transport,
  at the simulated scale — 1/256 of Llama-3-8B's real size), machine-independent too: the
  figure suffix-only transfer exists to lower;
* client TTFT p50/p99, prefill milliseconds per request (the records' cost: wall time on
  the worker, its queue included) and cost per request — wall-clock figures, at the mercy
  of whatever else this machine runs;
* how many placements named a reused prefix, and how many transfers sent a suffix only.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.bench.stats import percentile
from orchestrator.cluster import LocalCluster
from orchestrator.workers.sim_engine import SimPrefixCache

if TYPE_CHECKING:
    from orchestrator.api.orchestrator_pb2_grpc import OrchestratorAsyncStub


@dataclass(frozen=True, slots=True)
class ChatBench:
    conversations: int = 16
    turns: int = 4
    system_tokens: int = 512
    """The system prompt every conversation opens with."""
    user_tokens: int = 64
    """Tokens of each user message."""
    one_shot: int = 16
    """Unrelated single requests (system-sized prompts of their own)."""
    max_tokens: int = 16
    concurrency: int = 8
    prefill_workers: int = 4
    decode_workers: int = 4
    prefill_sim: str = "llama-3-8b@H100"
    decode_sim: str = "llama-3-8b@L4"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_ms: float
    prefill_gpu_s: float
    kv_bytes: int
    usd: float
    placement: str
    prefill_worker: str = ""
    prompt: tuple[int, ...] = ()
    computed: int = 0
    """Prefill tokens computed (filled in by `replay`)."""


def chat_workload(b: ChatBench) -> tuple[list[int], list[list[list[int]]], list[list[int]]]:
    """(system prompt, per conversation its user messages, one-shot prompts). Pure."""
    rng = random.Random(b.seed)  # noqa: S311 - a reproducible workload, not a secret

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 30_000) for _ in range(n)]

    system = tokens(b.system_tokens)
    chats = [[tokens(b.user_tokens) for _ in range(b.turns)] for _ in range(b.conversations)]
    one_shots = [tokens(b.system_tokens + b.user_tokens) for _ in range(b.one_shot)]
    return system, chats, one_shots


async def _one(
    stub: OrchestratorAsyncStub, rid: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], Sample]:
    req = orchestrator_pb2.GenerateRequest(
        request_id=rid,
        tokens=orchestrator_pb2.TokenIds(ids=prompt),
        max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(),
    )
    started = time.perf_counter()
    ttft = 0.0
    out: list[int] = []
    async for chunk in stub.Generate(req, timeout=120):
        if chunk.token_ids and not out:
            ttft = (time.perf_counter() - started) * 1000
        out += chunk.token_ids
    info = await stub.GetRequest(orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10)
    sample = Sample(
        ttft, info.cost.prefill_gpu_s, info.kv_bytes, info.cost.usd, info.placement,
        info.prefill_worker, tuple(prompt),
    )  # fmt: skip
    return out, sample


async def drive(address: str, b: ChatBench, tag: str) -> list[Sample]:
    system, chats, one_shots = chat_workload(b)
    gate = asyncio.Semaphore(b.concurrency)
    samples: list[Sample] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub: OrchestratorAsyncStub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def chat(c: int, messages: Sequence[list[int]]) -> None:
            history = list(system)
            for t, user in enumerate(messages):
                history += user
                async with gate:
                    reply, s = await _one(stub, f"{tag}-c{c}-t{t}", history, b.max_tokens)
                samples.append(s)
                history += reply

        async def single(i: int, prompt: list[int]) -> None:
            async with gate:
                _, s = await _one(stub, f"{tag}-o{i}", prompt, b.max_tokens)
            samples.append(s)

        await asyncio.gather(
            *(chat(c, m) for c, m in enumerate(chats)),
            *(single(i, p) for i, p in enumerate(one_shots)),
        )
    return samples


def replay(samples: Sequence[Sample]) -> list[Sample]:
    """``samples`` (in finishing order) with the prefill tokens each computed: every
    prefill worker's prefix cache replayed over the prompts it got (no eviction here: the
    caches hold far more than a run). Pure."""
    caches: dict[str, SimPrefixCache] = {}
    out = []
    for s in samples:
        cache = caches.setdefault(s.prefill_worker, SimPrefixCache(1 << 30))
        reused = min(cache.use(s.prompt), len(s.prompt) - 1)
        out.append(replace(s, computed=len(s.prompt) - reused))
    return out


def summarize(samples: Sequence[Sample]) -> dict[str, float]:
    samples = replay(samples)
    n = len(samples)
    ttft = [s.ttft_ms for s in samples]
    return {
        "requests": n,
        "prefill_tokens_computed_per_request": sum(s.computed for s in samples) / n,
        "prompt_tokens_per_request": sum(len(s.prompt) for s in samples) / n,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "prefill_gpu_ms_per_request": sum(s.prefill_gpu_s for s in samples) / n * 1000,
        "kv_bytes_per_request": sum(s.kv_bytes for s in samples) / n,
        "usd_per_1k_requests": sum(s.usd for s in samples) / n * 1000,
        "routed_to_a_cached_prefix": sum("reuses" in s.placement for s in samples) / n,
        "kv_suffix_only": sum("KV suffix only" in s.placement for s in samples) / n,
    }


MODES: dict[str, tuple[str, ...]] = {
    "off": ("--kv-routing", "off"),
    "on": ("--kv-routing", "on", "--kv-suffix", "off"),
    "suffix": ("--kv-routing", "on", "--kv-suffix", "on"),
}
"""Mode -> the orchestrator's flags: least loaded; routing with whole KV transfers; routing
with suffix-only transfers."""
LABELS = {"off": "routing off", "on": "routing on", "suffix": "+ suffix KV"}


def run_mode(b: ChatBench, mode: str, log_level: str = "WARNING") -> dict[str, float]:
    cluster = LocalCluster(
        transport="tcp", prefill_workers=0, decode_workers=0, orchestrators=0,
        log_level=log_level,
    )  # fmt: skip
    with cluster:
        cluster.start_sim_workers(
            "prefill", b.prefill_workers, b.prefill_sim, 0, "--sim-prefix-cache"
        )
        cluster.start_sim_workers("decode", b.decode_workers, b.decode_sim, 0, "--sim-prefix-cache")
        cluster.wait_live_workers(b.prefill_workers, b.decode_workers, timeout_s=60)
        address = cluster.start_orchestrator(0, 0, *MODES[mode])
        return summarize(asyncio.run(drive(address, b, f"kvr-{mode}")))


def run_bench(
    b: ChatBench, log_level: str = "WARNING", progress: Callable[[str], None] = print
) -> dict[str, dict[str, float]]:
    out = {}
    for mode in MODES:
        progress(f"{LABELS[mode]}: {b.conversations} chats x {b.turns} turns + {b.one_shot}")
        out[mode] = run_mode(b, mode, log_level)
    return out


def format_result(result: dict[str, dict[str, float]]) -> str:
    rows = [
        ("prompt tokens / request", "prompt_tokens_per_request", "{:.0f}"),
        ("prefill tokens computed / request", "prefill_tokens_computed_per_request", "{:.0f}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
        ("prefill ms / request (wall)", "prefill_gpu_ms_per_request", "{:.2f}"),
        ("KV bytes / request (simulated)", "kv_bytes_per_request", "{:,.0f}"),
        ("USD / 1k requests", "usd_per_1k_requests", "{:.4f}"),
        ("placed on a cached prefix", "routed_to_a_cached_prefix", "{:.0%}"),
        ("KV sent as a suffix only", "kv_suffix_only", "{:.0%}"),
    ]
    modes = list(result)
    lines = [f"{'':34s}" + "".join(f"{LABELS.get(m, 'routing ' + m):>14s}" for m in modes)]
    for label, key, fmt in rows:
        lines.append(f"{label:34s}" + "".join(f"{fmt.format(result[m][key]):>14s}" for m in modes))
    return "\n".join(lines)
