"""`pdorch bench serving`: one workload through vLLM alone and through pdorch, side by side.

Systems, one after another on this machine (each started, warmed up, measured at every
concurrency level, stopped before the next starts — two vLLM engines at a time at most):

* ``vllm``: plain ``vllm serve`` (`vllm_serve.VllmServer`) — what users would run instead;
* ``pdorch-agg``: Redis, one orchestrator with its OpenAI gateway, one vLLM worker (no
  prefill pool: every request aggregated on it);
* ``pdorch-pd``: the same with one prefill and one decode vLLM worker, every request
  disaggregated (KV pushed by pdorch's connector over pdorch's transport);
* ``vllm-nixl``: vLLM's own P/D — two ``vllm serve`` with its NixlConnector (pull mode,
  CPU buffers) and `nixl_proxy` in front. Needs the ``nixl`` package (not a dependency:
  its wheels are CUDA builds; ``pip install --no-deps nixl nixl-cu12`` gives one whose UCX
  backend runs CPU-only), importable or under ``nixl_path``; else the row says why not.

All are driven by the same client (`openai_load`), the prompts as token ids, identical
across systems: request *n*'s prompt is "Request n." then a fixed passage, cut to exactly
``prompt_tokens`` tokens (distinct first tokens: no system serves one request's prompt from
another's prefix cache). A system that fails to start or to answer its warm-up requests
gets a "not run: <reason>" row; the others still run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from orchestrator.api import orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.bench.openai_load import make_calls, run_level
from orchestrator.bench.serving import SYSTEMS, Level, Row, Workload, prompt_ids, summarize
from orchestrator.bench.vllm_serve import ServeError, VllmServer, metric_sum_count
from orchestrator.cluster import ClusterError, LocalCluster, connect
from orchestrator.ports import free_port
from orchestrator.workers.vllm.cpu import reserved_cpus_env

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "made books cheap enough for ordinary readers. Within fifty years presses were working "
    "in more than two hundred cities, and the number of books in Europe grew from thousands "
    "to millions. Scholars could compare the same text in many copies, merchants printed "
    "price lists and contracts, and governments printed laws. The new trade needed paper, "
    "ink, metal for type and skilled workers, and it changed how people learned to read. "
)
"""The body every prompt repeats after its distinct first words."""

WARMUP_TOKENS = 8
NIXL_XFER_METRIC = "vllm:nixl_xfer_time_seconds"
NIXL_KV_NOTE = "is the mean of vLLM's nixl_xfer_time_seconds per transfer (not per request)"


class NotRun(Exception):
    """A system could not be measured; the message says why."""


@dataclass(frozen=True, slots=True)
class ServingBench:
    workload: Workload = field(default_factory=Workload)
    systems: tuple[str, ...] = SYSTEMS
    model: str = "smollm2"
    model_cache: Path | None = None
    transport: str = "tcp"
    """pdorch's KV transport backend for ``pdorch-pd`` (`transport.backend_names.BACKENDS`)."""
    nixl_path: str = ""
    """A directory holding the ``nixl`` package, put on the NIXL servers' PYTHONPATH."""
    ready_timeout_s: float = 900.0
    log_level: str = "WARNING"


@dataclass(slots=True)
class _Target:
    """A started system: its OpenAI base URL, the model id its calls name (every system
    serves SmolLM2 under the same one) and how to read KV transfer times."""

    url: str
    model: str
    kv_per_request: Callable[[Sequence[str]], list[float | None]] | None = None
    kv_mean_ms: Callable[[], float | None] | None = None
    kv_note: str = ""


def run(bench: ServingBench, progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    from orchestrator.core.models import SMOLLM2_NAME  # noqa: PLC0415
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415

    if bench.model != "smollm2":
        raise NotRun("only --model smollm2 (vLLM serves it; see README 'vLLM workers')")
    model_dir = ensure_smollm2(bench.model_cache)
    prompt_for = _prompt_maker(model_dir, bench.workload.prompt_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="pdorch-bench-serving-"))
    rows: list[Row] = []
    for system in bench.systems:
        progress(f"{system}: starting")
        row = Row(system)
        try:
            with _started(system, bench, model_dir, SMOLLM2_NAME, workdir) as target:
                row.kv_note = target.kv_note
                row.levels = _measure(target, bench, prompt_for, system, progress)
        except (NotRun, ClusterError, ServeError, OSError, httpx.HTTPError) as exc:
            row.not_run = str(exc).strip().splitlines()[0][:300] if str(exc) else repr(exc)
            progress(f"{system}: not run: {row.not_run}")
        rows.append(row)
    return {
        "model": bench.model,
        "transport": bench.transport,
        "workload": asdict(bench.workload),
        "rows": [r.to_dict() for r in rows],
        "logs": str(workdir),
    }


def _prompt_maker(model_dir: Path, length: int) -> Callable[[int], list[int]]:
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy; only here

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    body = list(tokenizer.encode(PASSAGE, add_special_tokens=False))

    def prompt_for(n: int) -> list[int]:
        prefix = tokenizer.encode(f"Request {n}. ", add_special_tokens=False)
        return prompt_ids(prefix, body, length)

    return prompt_for


def _measure(
    target: _Target,
    bench: ServingBench,
    prompt_for: Callable[[int], list[int]],
    system: str,
    progress: Callable[[str], None],
) -> list[Level]:
    w = bench.workload
    n_levels = len(w.concurrency)
    warm = make_calls(prompt_for, n_levels * w.requests, w.warmup, WARMUP_TOKENS, "warmup")
    pairs, _ = asyncio.run(run_level(target.url, target.model, warm, 1, min(w.timeout_s, 300)))
    failed = [s.error for _, s in pairs if not s.ok]
    if failed:
        raise NotRun(f"warm-up request failed: {failed[0]}")
    levels = []
    for i, c in enumerate(w.concurrency):
        calls = make_calls(prompt_for, i * w.requests, w.requests, w.max_tokens, f"c{c}")
        if target.kv_mean_ms is not None:
            target.kv_mean_ms()  # moves its mark: the mean below is this level's alone
        pairs, wall = asyncio.run(run_level(target.url, target.model, calls, c, w.timeout_s))
        samples = [s for _, s in pairs]
        if target.kv_per_request is not None:
            kv = target.kv_per_request([call.request_id for call, _ in pairs])
            for s, ms in zip(samples, kv, strict=True):
                s.kv_transfer_ms = ms
        level = summarize(c, samples, wall)
        if target.kv_mean_ms is not None:
            level.kv_transfer_ms = target.kv_mean_ms()
        progress(
            f"{system}: concurrency {c}: {level.requests - level.failed}/{level.requests} ok, "
            f"{level.tokens_per_s:.1f} tok/s"
        )
        levels.append(level)
    return levels


@contextlib.contextmanager
def _started(
    system: str, bench: ServingBench, model_dir: Path, served: str, workdir: Path
) -> Iterator[_Target]:
    """``system`` started, serving ``model_dir`` as ``served`` (pdorch's workers serve it
    under that name: `orchestrator.workers.model_files.SMOLLM2_NAME`)."""
    sysdir = workdir / system
    sysdir.mkdir()
    if system == "vllm":
        server = VllmServer(model_dir, served, sysdir, ready_timeout_s=bench.ready_timeout_s)
        with server:
            yield _Target(server.url, served)
    elif system in ("pdorch-agg", "pdorch-pd"):
        cluster = LocalCluster(
            model=bench.model,
            engine="vllm",
            transport=bench.transport,
            prefill_workers=1 if system == "pdorch-pd" else 0,
            decode_workers=1,
            model_cache=bench.model_cache,
            workdir=sysdir,
            ready_timeout_s=bench.ready_timeout_s,
            log_level=bench.log_level,
            gateway=True,
        )
        with cluster:
            address = cluster.orchestrator_addresses[0]
            yield _Target(
                cluster.gateway_urls[0],
                served,
                kv_per_request=lambda ids: _pdorch_transfer_ms(address, ids),
            )
    elif system == "vllm-nixl":
        with _nixl(bench, model_dir, served, sysdir) as target:
            yield target
    else:
        raise NotRun(f"unknown system {system!r}")


def _pdorch_transfer_ms(address: str, request_ids: Sequence[str]) -> list[float | None]:
    """Each request's KV transfer time from its record (None: it ran aggregated)."""
    return asyncio.run(_transfer_ms(address, request_ids))


async def _transfer_ms(address: str, request_ids: Sequence[str]) -> list[float | None]:
    out: list[float | None] = []
    async with connect(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for rid in request_ids:
            try:
                info = await stub.GetRequest(
                    orchestrator_pb2.GetRequestRequest(request_id=rid), timeout=10
                )
            except grpc.RpcError:
                out.append(None)
                continue
            disaggregated = info.mode == "disaggregated"
            out.append(float(info.timings.transfer_ms) if disaggregated else None)
    return out


# ------------------------------------------------------------------------------- NIXL


def _nixl_env(nixl_path: str) -> dict[str, str]:
    return {"PYTHONPATH": nixl_path} if nixl_path else {}


def check_nixl(nixl_path: str) -> None:
    env = dict(os.environ)
    if nixl_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (nixl_path, env.get("PYTHONPATH")) if p)
    probe = subprocess.run(
        [sys.executable, "-c", "import nixl._api"],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        raise NotRun(
            "the nixl package is not importable (pip install --no-deps nixl nixl-cu12 "
            "into a directory and pass it as --nixl-path)"
        )


@contextlib.contextmanager
def _nixl(bench: ServingBench, model_dir: Path, served: str, sysdir: Path) -> Iterator[_Target]:
    check_nixl(bench.nixl_path)
    servers = []
    for role in ("producer", "consumer"):
        config = {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}"}
        env = _nixl_env(bench.nixl_path) | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        env = reserved_cpus_env() | env  # cores placed as pdorch's vLLM workers place them
        servers.append(
            VllmServer(
                model_dir,
                served,
                sysdir,
                log_name=f"vllm-{role}",
                extra_args=("--kv-transfer-config", json.dumps(config)),
                env=env,
                ready_timeout_s=bench.ready_timeout_s,
            )
        )
    prefill, decode = servers
    with contextlib.ExitStack() as stack:
        for s in servers:  # one after another: two vLLM starts at once thrash 2 cores
            stack.enter_context(s)
        port = free_port()
        log_path = sysdir / "proxy.log"
        argv = [
            sys.executable, "-m", "orchestrator.bench.nixl_proxy",
            "--port", str(port), "--prefill", prefill.url, "--decode", decode.url,
        ]  # fmt: skip
        with log_path.open("ab") as out:
            proxy = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        stack.callback(_stop_proc, proxy)
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/health", proxy, 60)
        mark = [metric_sum_count(_metrics(decode.url), NIXL_XFER_METRIC)]

        def kv_mean_ms() -> float | None:
            now = metric_sum_count(_metrics(decode.url), NIXL_XFER_METRIC)
            (s0, c0), (s1, c1) = mark[0], now
            mark[0] = now
            return (s1 - s0) / (c1 - c0) * 1000 if c1 > c0 else None

        yield _Target(url, served, kv_mean_ms=kv_mean_ms, kv_note=NIXL_KV_NOTE)


def _metrics(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotRun(f"the NIXL proxy exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)  # polling a condition with a deadline
    raise NotRun(f"the NIXL proxy did not answer {url} in {timeout_s:.0f} s")


def _stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
