"""Shared by the vLLM tests: vLLM's own offline outputs (computed once per session, in
its own process) and helpers to drive an orchestrator and compare with them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

MAX_TOKENS = 24
Request = orchestrator_pb2.GenerateRequest


def model_dir() -> Path:
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


@pytest.fixture(scope="session")
def offline() -> list[dict[str, Any]]:
    """vLLM's own greedy outputs for the 20 shipped prompts (one batch, as a user runs it)."""
    argv = [sys.executable, "-m", "orchestrator.workers.vllm.offline",
            "--model-dir", str(model_dir()), "--max-tokens", str(MAX_TOKENS)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["requests"]
    assert len(got) == 20
    return list(got)


def greedy(ids: list[int], rid: str) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(
        request_id=rid, max_tokens=MAX_TOKENS, sampling=common_pb2.SamplingParams(temperature=0)
    )
    req.tokens.ids.extend(ids)
    return req


async def generate(
    address: str, reqs: list[orchestrator_pb2.GenerateRequest], concurrency: int
) -> list[list[orchestrator_pb2.GenerateChunk]]:
    """Every request's chunks, ``concurrency`` streams at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one(req: Request) -> list[orchestrator_pb2.GenerateChunk]:
            async with gate:
                return [c async for c in stub.Generate(req, timeout=300)]

        return list(await asyncio.gather(*(one(r) for r in reqs)))


def token_ids(chunks: list[orchestrator_pb2.GenerateChunk]) -> list[int]:
    indices = [c.index for c in chunks if c.token_ids]
    ids = [t for c in chunks for t in c.token_ids]
    expected, at = [], 0
    for c in chunks:
        if c.token_ids:
            expected.append(at)
            at += len(c.token_ids)
    assert indices == expected, "token indices must be contiguous from 0"
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return ids


def mismatches(
    offline: list[dict[str, Any]], streams: list[list[orchestrator_pb2.GenerateChunk]]
) -> list[str]:
    out = []
    for ref, chunks in zip(offline, streams, strict=True):
        got, want = token_ids(chunks), list(ref["output_ids"])
        if got != want:
            pairs = enumerate(zip(got, want, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
            out.append(f"{ref['prompt']!r}: first difference at {first}: {got} != {want}")
    return out
