"""The one client of `pdorch bench serving`: streamed ``POST /v1/completions`` calls to an
OpenAI-compatible server (vLLM's, pdorch's gateway, the NIXL proxy), closed loop.

Each request sends its prompt as token ids, greedy, ``stream_options.include_usage`` (the
closing usage object gives the exact number of completion tokens), and its own request id
in ``x-request-id`` (pdorch keeps it as the request's id, so its record can be read
afterwards). Timing rules are `orchestrator.bench.serving`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from orchestrator.bench.serving import Sample, tpot

REQUEST_ID_HEADER = "x-request-id"


@dataclass(frozen=True, slots=True)
class Call:
    request_id: str
    prompt: list[int]
    max_tokens: int


async def one(
    client: httpx.AsyncClient, url: str, model: str, call: Call, timeout_s: float
) -> Sample:
    body = {
        "model": model,
        "prompt": call.prompt,
        "max_tokens": call.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {REQUEST_ID_HEADER: call.request_id}
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp,
        ):
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return Sample(ok=False, error=f"HTTP {resp.status_code}: {text}")
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return Sample(ok=False, error=f"error event: {event['error']}")
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
    except (httpx.HTTPError, TimeoutError, ValueError) as exc:
        return Sample(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    if not done or not first:
        return Sample(ok=False, error="stream ended without [DONE] or without text")
    return Sample(
        ok=True,
        ttft_ms=(first - started) * 1000,
        tpot_ms=tpot(first, last, tokens),
        tokens=tokens,
    )


async def run_level(
    url: str,
    model: str,
    calls: Sequence[Call],
    concurrency: int,
    timeout_s: float,
) -> tuple[list[tuple[Call, Sample]], float]:
    """Send ``calls``, ``concurrency`` at a time; (call, sample) pairs and the wall time."""
    queue = list(reversed(calls))
    out: list[tuple[Call, Sample]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def slot() -> None:
            while queue:
                call = queue.pop()
                out.append((call, await one(client, url, model, call, timeout_s)))

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for k in range(min(concurrency, len(calls))):
                group.create_task(slot(), name=f"pdorch-bench-serving-slot-{k}")
        wall = time.perf_counter() - started
    return out, wall


def make_calls(
    prompt_for: Callable[[int], list[int]], first: int, count: int, max_tokens: int, tag: str
) -> list[Call]:
    """``count`` calls numbered from ``first``; request ids ``bench-<tag>-<n>``."""
    return [
        Call(f"bench-{tag}-{n}", prompt_for(n), max_tokens) for n in range(first, first + count)
    ]
