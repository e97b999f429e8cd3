"""Shared by the vLLM tests: vLLM's own offline outputs (computed once per session, in
its own process) and helpers to drive an orchestrator and compare with them."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

if importlib.util.find_spec("vllm") is None:
    # `make test`'s first run (`-m "not vllm"`, in .venv) has no vLLM: a test module that
    # imports vLLM at module level is collected only in .venv-vllm, where it runs.
    collect_ignore = ["test_vllm_sampler.py"]

MAX_TOKENS = 24
Request = orchestrator_pb2.GenerateRequest
Run = list[dict[str, Any]]
"""One offline run: per prompt, its text, prompt ids, output ids and finish reason."""


def model_dir() -> Path:
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415

    return ensure_smollm2()


SEEDED = (0.8, 7)
"""Temperature and seed of the seeded-sampling comparison."""


@pytest.fixture(scope="session")
def offline_runs() -> tuple[Run, Run]:
    """vLLM's own outputs for the 20 shipped prompts, greedy and seeded (each run one batch,
    as a user runs it), from one engine in its own process."""
    argv = [sys.executable, "-m", "orchestrator.workers.vllm.offline",
            "--model-dir", str(model_dir()), "--max-tokens", str(MAX_TOKENS),
            "--sampling", "0:0", "--sampling", f"{SEEDED[0]}:{SEEDED[1]}"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    greedy_run, seeded_run = json.loads(proc.stdout.strip().splitlines()[-1])["runs"]
    assert len(greedy_run) == len(seeded_run) == 20
    return greedy_run, seeded_run


@pytest.fixture(scope="session")
def offline(
    offline_runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """vLLM's own greedy outputs for the 20 shipped prompts."""
    return offline_runs[0]


def greedy(
    ids: list[int], rid: str, temperature: float = 0.0, seed: int = 0
) -> orchestrator_pb2.GenerateRequest:
    """A request for prompt ``ids`` (greedy unless a temperature is given)."""
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=seed)
    req = orchestrator_pb2.GenerateRequest(request_id=rid, max_tokens=MAX_TOKENS, sampling=sampling)
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
