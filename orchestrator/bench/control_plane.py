"""`pdorch bench control-plane`: the real control plane against a simulated fleet.

Starts, on this machine and as separate processes through the `pdorch` CLI: Redis, the
simulated workers (``pdorch worker --sim``, ``fleet_processes`` processes per role, each
hosting its share of the workers), ``orchestrators`` orchestrator replicas; warms them up;
then runs ``clients`` load processes (``pdorch bench load``) that together keep
``concurrency`` requests in flight until ``requests`` have been sent, and reports:

* admitted (and completed) requests per second over the load's wall-clock window;
* the orchestration overhead's distribution (client TTFT − worker TTFT, see
  `orchestrator.bench.load`);
* CPU milliseconds per completed request of each kind of process — the orchestrators'
  figure is the one that matters; the others say where the rest of the machine went —
  from psutil: (user + system time after − before) / completed requests, sampled around
  the load phase only.

A ``profile_dir`` runs every orchestrator under cProfile (``pdorch orchestrator
--profile``) and leaves one ``.pstats`` file per replica there; profiled figures are slower
and not comparable with unprofiled ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.bench.load import LoadResult, LoadSpec, run_load
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.errors import ConfigError
from orchestrator.workers.sim_engine import SimSpec


@dataclass(frozen=True, slots=True)
class ControlPlaneBench:
    workers: int = 200
    prefill_workers: int = 0
    """Of ``workers``; 0: half."""
    concurrency: int = 2000
    requests: int = 10000
    orchestrators: int = 1
    clients: int = 2
    """Load processes (one Python process cannot keep thousands of streams busy alone)."""
    fleet_processes: int = 1
    """Processes per role the simulated workers are spread over."""
    max_tokens: int = 16
    prompt_words: int = 100
    model: str = "llama-3-8b"
    prefill_gpu: str = "H100"
    decode_gpu: str = "L4"
    warmup: int = 0
    """Requests run (and not measured) before the load; 0: two per worker."""
    profile_dir: Path | None = None
    orchestrator_args: tuple[str, ...] = ()
    """Extra `pdorch orchestrator` flags (e.g. ``--max-inflight=300``: admission under load)."""
    timeout_s: float = 600.0
    """The whole load phase."""
    tls: bool = True
    """Client API over TLS and orchestrator→worker calls over mutual TLS (the local
    cluster's default); False: plaintext, to measure what TLS costs."""

    def check(self) -> None:
        for name in ("workers", "concurrency", "requests", "orchestrators", "clients"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.fleet_processes < 1:
            raise ConfigError("fleet_processes", "must be at least 1")
        if not 0 <= self.prefill_workers < self.workers:
            raise ConfigError("prefill_workers", f"must be in [0, {self.workers})")
        if self.workers < 2:
            raise ConfigError("workers", "must be at least 2 (a prefill and a decode worker)")
        SimSpec.parse(self.prefill_sim)
        SimSpec.parse(self.decode_sim)

    @property
    def prefill_sim(self) -> str:
        return f"{self.model}@{self.prefill_gpu}"

    @property
    def decode_sim(self) -> str:
        return f"{self.model}@{self.decode_gpu}"

    @property
    def pools(self) -> tuple[int, int]:
        prefill = self.prefill_workers or self.workers // 2
        return prefill, self.workers - prefill


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal non-negative shares."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _cpu_s(pids: list[int]) -> float:
    import psutil  # noqa: PLC0415 - a test dependency: `pdorch` parses its flags without it

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def run_bench(
    b: ControlPlaneBench,
    log_level: str = "WARNING",
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, object]:
    """Run the benchmark; the result is what ``--json`` prints. ``progress``: a line per
    phase (fleet start, orchestrators, warm-up, the measured load)."""
    b.check()
    prefill, decode = b.pools
    progress(
        f"starting {prefill} + {decode} simulated workers, {b.fleet_processes} process(es)/role"
    )
    cluster = LocalCluster(
        transport="tcp",
        prefill_workers=0,
        decode_workers=0,
        orchestrators=0,
        log_level=log_level,
        tls=b.tls,
    )
    with cluster:
        for role, count, sim in (
            ("prefill", prefill, b.prefill_sim),
            ("decode", decode, b.decode_sim),
        ):
            for i, n in enumerate(_split(count, b.fleet_processes)):
                if n:
                    cluster.start_sim_workers(role, n, sim, i)
        cluster.wait_live_workers(prefill, decode)
        progress(f"starting {b.orchestrators} orchestrator(s)")
        for i in range(b.orchestrators):
            extra = list(b.orchestrator_args)
            if b.profile_dir is not None:
                b.profile_dir.mkdir(parents=True, exist_ok=True)
                extra += ["--profile", str(b.profile_dir / f"orchestrator-{i}.pstats")]
            cluster.start_orchestrator(i, 0, *extra)
        targets = tuple(cluster.orchestrator_addresses)
        warmup = b.warmup or 2 * b.workers
        progress(f"warm-up: {warmup} requests")
        warm = asyncio.run(
            run_load(
                LoadSpec(
                    targets,
                    requests=warmup,
                    concurrency=min(b.concurrency, 200),
                    max_tokens=b.max_tokens,
                    prompt_words=b.prompt_words,
                    offset=10**9,
                ),
                tls=cluster.credentials(),
            )
        )
        if not any(s.completed for s in warm.samples):
            raise ClusterError(f"warm-up: no request completed: {warm.summary()}")

        groups = {
            "orchestrators": [n for n in cluster.procs if n.startswith("orchestrator")],
            "prefill_fleet": [n for n in cluster.procs if n.startswith("prefill-sim")],
            "decode_fleet": [n for n in cluster.procs if n.startswith("decode-sim")],
            "redis": ["redis"],
        }
        pids = {g: [cluster.procs[n].popen.pid for n in names] for g, names in groups.items()}
        before = {g: _cpu_s(p) for g, p in pids.items()}
        progress(f"measuring: {b.requests} requests at concurrency {b.concurrency}")
        tls_dir = str(cluster.tls_dir) if b.tls else ""
        results = _drive(b, targets, log_level, tls_dir)
        after = {g: _cpu_s(p) for g, p in pids.items()}

    merged = LoadResult.merge(results)
    summary = merged.summary()
    completed = max(1, int(str(summary["completed"])))
    cpu_ms = {g: round((after[g] - before[g]) * 1000 / completed, 2) for g in groups}
    cpu_ms["clients"] = round(merged.cpu_s * 1000 / completed, 2)
    return {
        "workers": {"prefill": prefill, "decode": decode, "processes_per_role": b.fleet_processes},
        "sim": {
            "prefill": b.prefill_sim,
            "decode": b.decode_sim,
            "kv_scale": SimSpec.parse(b.prefill_sim).kv_scale,
        },
        "orchestrators": b.orchestrators,
        "concurrency": b.concurrency,
        "clients": b.clients,
        "max_tokens": b.max_tokens,
        "prompt_words": b.prompt_words,
        "tls": b.tls,
        **summary,
        "orchestrator_cpu_ms_per_request": cpu_ms["orchestrators"],
        "cpu_ms_per_request": cpu_ms,
        "cpus": os.cpu_count(),
        "profiled": b.profile_dir is not None,
        "settings": {k: str(v) for k, v in asdict(b).items()},
    }


def _drive(
    b: ControlPlaneBench, targets: tuple[str, ...], log_level: str, tls_dir: str
) -> list[LoadResult]:
    """Run the load processes (over TLS with the client identity in ``tls_dir``, if
    given); their results."""
    procs = []
    offset = 0
    for requests, concurrency in zip(
        _split(b.requests, b.clients), _split(b.concurrency, b.clients), strict=True
    ):
        if not requests:
            continue
        args = [
            sys.executable, "-m", "orchestrator.cli", "--log-level", log_level,
            "bench", "load",
            "--target", ",".join(targets),
            "--requests", str(requests),
            "--concurrency", str(max(1, concurrency)),
            "--max-tokens", str(b.max_tokens),
            "--prompt-words", str(b.prompt_words),
            "--offset", str(offset),
            "--samples",
            *(["--tls-dir", tls_dir] if tls_dir else []),
        ]  # fmt: skip
        offset += requests
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    deadline = time.monotonic() + b.timeout_s
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise ClusterError(f"load client exited {p.returncode}: {err.decode()[-2000:]}")
            results.append(LoadResult.from_json(out.decode()))
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"load did not finish within {b.timeout_s}s") from exc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def format_result(r: dict[str, object]) -> str:
    """The human-readable report."""
    w = r["workers"]
    assert isinstance(w, dict)
    lines = [
        f"control plane: {w['prefill']} prefill + {w['decode']} decode simulated workers "
        f"({r['sim']}), {r['orchestrators']} orchestrator(s), {r['cpus']} CPUs",
        f"load: {r['requests']} requests, {r['concurrency']} concurrent, "
        f"{r['max_tokens']} tokens each, {r['clients']} client process(es)",
        f"admitted {r['admitted_per_s']} req/s, completed {r['completed_per_s']} req/s "
        f"({r['completed']}/{r['requests']}; not completed: {r['not_completed_by_code']})",
        f"orchestration overhead ms: {r['overhead_ms']}",
        f"client TTFT ms: {r['client_ttft_ms']}",
        f"worker TTFT ms: {r['worker_ttft_ms']}",
        f"orchestrator CPU ms/request: {r['orchestrator_cpu_ms_per_request']} "
        f"(all: {r['cpu_ms_per_request']})",
    ]
    return "\n".join(lines)
