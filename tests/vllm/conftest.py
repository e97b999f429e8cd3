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
import numpy as np
import pytest

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.cluster import connect

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
    async with connect(address) as channel:
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


LOGPROBS = 5
"""Alternatives asked per token by the log-probability checks."""
LOGPROB_TOL = 1e-3
"""vLLM's float32 CPU forward against transformers' (same weights, float32 CPU)."""


def scored(ids: list[int], rid: str, max_tokens: int = 8) -> orchestrator_pb2.GenerateRequest:
    """A seeded request (pdorch's logits processor draws its tokens inside vLLM) asking
    ``LOGPROBS`` alternatives for every output and prompt token."""
    sampling = common_pb2.SamplingParams(
        temperature=SEEDED[0], seed=SEEDED[1], logprobs=LOGPROBS, prompt_logprobs=LOGPROBS
    )
    req = orchestrator_pb2.GenerateRequest(request_id=rid, max_tokens=max_tokens, sampling=sampling)
    req.tokens.ids.extend(ids)
    return req


def logprob_errors(prompt: list[int], chunks: list[orchestrator_pb2.GenerateChunk]) -> list[str]:
    """Where a stream's log-probabilities (prompt's and outputs') differ from the log-softmax
    of transformers' raw logits for the same tokens (`orchestrator.core.logprobs`, the
    reference engine's computation): each token's and each alternative's value within
    `LOGPROB_TOL`, the alternatives the ``LOGPROBS`` most probable, most probable first."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from orchestrator.core.logprobs import log_softmax  # noqa: PLC0415

    output = token_ids(chunks)
    seq = prompt + output
    model = AutoModelForCausalLM.from_pretrained(str(model_dir()), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].numpy()
    lp = log_softmax(logits)
    got_prompt = [p for c in chunks for p in c.prompt_logprobs]
    got_output = [p for c in chunks for p in c.logprobs]
    errors: list[str] = []
    if [p.token_id for p in got_prompt] != prompt:
        errors.append(f"prompt log-probabilities for {[p.token_id for p in got_prompt]}")
    if [p.token_id for p in got_output] != output:
        errors.append(f"output log-probabilities for {[p.token_id for p in got_output]}")
    if errors:
        return errors
    if got_prompt[0].HasField("logprob") or got_prompt[0].top:
        errors.append("the first prompt token is scored")
    for pos, item in enumerate(got_prompt[1:] + got_output, start=1):
        row = lp[pos - 1]  # the logits after tokens 0..pos-1 score token pos
        if abs(item.logprob - row[item.token_id]) > LOGPROB_TOL:
            errors.append(f"token {pos}: {item.logprob} != {row[item.token_id]}")
        top = [t.logprob for t in item.top]
        kth = np.sort(row)[-LOGPROBS]
        if len(top) != LOGPROBS or top != sorted(top, reverse=True) or min(top) < kth - LOGPROB_TOL:
            errors.append(f"token {pos}: alternatives {top}, the top {LOGPROBS} end at {kth}")
        errors += [
            f"token {pos}: alternative {t.token_id}: {t.logprob} != {row[t.token_id]}"
            for t in item.top
            if abs(t.logprob - row[t.token_id]) > LOGPROB_TOL
        ]
    return errors


def scored_stream(
    cluster: Any, prompt: list[int], rid: str
) -> list[orchestrator_pb2.GenerateChunk]:
    """`scored`'s stream through ``cluster`` (a `LocalCluster`); a failure shows the workers'
    logs."""
    try:
        (chunks,) = asyncio.run(
            generate(cluster.orchestrator_addresses[0], [scored(prompt, rid)], 1)
        )
    except grpc.RpcError as exc:
        logs = "\n".join(f"--- {n}\n{p.tail(4000)}" for n, p in cluster.procs.items() if "-" in n)
        pytest.fail(f"{exc}\n{logs}")
    return chunks


def prompt_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    return list(tokenizer.encode(text, add_special_tokens=False))
