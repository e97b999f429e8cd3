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

**Scale.** ``redis_shards`` ≥ 1 runs the store on a Redis Cluster of that many primaries
started by the bench (`LocalRedisCluster`, ``redis+cluster://``; 0: one plain
redis-server); ``pin`` pins each orchestrator replica and each Redis shard to a core
(`orchestrator.bench.scale` says how, and what that can show on a small machine). The
result then also has every process's CPU per request and per relayed token, and projects
what one core of each tier sustains and how many decode GPUs it fronts (a projection from
CPU counters, not a measured fleet). ``hiredis=False`` hides hiredis from every process the
bench starts, so redis-py parses replies in pure Python: what hiredis saves, in one run.

A ``profile_dir`` runs every orchestrator under cProfile (``pdorch orchestrator
--profile``) and leaves one ``.pstats`` file per replica there; profiled figures are slower
and not comparable with unprofiled ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.bench.load import LoadResult, LoadSpec, run_load
from orchestrator.bench.no_hiredis import child_hiredis, without_hiredis
from orchestrator.bench.pinning import PinError, available_cores, pin
from orchestrator.bench.scale import TIERS, CoreAssignment, Usage, assign_cores, project
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.core.spec import MAX_CHUNK_WINDOW_MS
from orchestrator.errors import ConfigError
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.server import RedisServerError
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
    fleet_args: tuple[str, ...] = ()
    """Extra flags of every simulated-worker process (e.g. ``--loop=uvloop``)."""
    timeout_s: float = 600.0
    """The whole load phase."""
    ramp_s: float = 0.0
    """Spread the first ``concurrency`` requests evenly over this many seconds (and so
    every later wave: a closed loop of equal requests stays in step); 0: they start at once,
    and each wave arrives as a burst of ``concurrency`` (`orchestrator.bench.load`)."""
    chunk_window_ms: int = 0
    """The chunk window every request asks (``GenerateRequest.chunk_window_ms``, at most
    `MAX_CHUNK_WINDOW_MS`); 0: the orchestrators' ``--stream-flush-ms``."""
    tls: bool = True
    """Client API over TLS and orchestrator→worker calls over mutual TLS (the local
    cluster's default); False: plaintext, to measure what TLS costs."""
    redis_shards: int = 0
    """0: one plain redis-server; S >= 1: a Redis Cluster of S primaries (no replicas)."""
    pin: bool = False
    """Pin each orchestrator replica and each Redis shard to a core of its own (round-robin
    when there are too few; see `orchestrator.bench.scale`)."""
    hiredis: bool = True
    """redis-py parses replies with hiredis where it is installed; False (``--hiredis
    off``): hidden from the bench's processes, they parse in pure Python."""
    gpu_batch: int = 128
    """The decode batch of the projection's GPU (a ``decode_gpu`` running ``model``)."""
    generate_many: bool = False
    """The load clients send their requests on ``GenerateMany`` calls, one per connection
    (a gateway multiplexing its users); False: one ``Generate`` call per request."""

    def check(self) -> None:
        for name in ("workers", "concurrency", "requests", "orchestrators", "clients",
                     "gpu_batch"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.ramp_s < 0:
            raise ConfigError("ramp_s", "must be >= 0 (0: no ramp)")
        if not 0 <= self.chunk_window_ms <= MAX_CHUNK_WINDOW_MS:
            raise ConfigError("chunk_window_ms", f"must be in [0, {MAX_CHUNK_WINDOW_MS}]")
        if self.warmup < 0:
            raise ConfigError("warmup", "must be >= 0 (0: two per worker)")
        if self.redis_shards < 0:
            raise ConfigError("redis_shards", "must be >= 0 (0: one plain redis-server)")
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

    @property
    def gpu_tokens_per_s(self) -> float:
        """Tokens per second of one decode GPU at ``gpu_batch`` (the performance model's,
        at a context of the prompt and half the output: words counted as tokens)."""
        spec = SimSpec.parse(self.decode_sim)
        context = self.prompt_words + self.max_tokens // 2
        return self.gpu_batch / spec.decode_step_s(self.gpu_batch, context)


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
    try:
        with contextlib.ExitStack() as stack:
            return _run(b, log_level, progress, stack)
    except (RedisServerError, PinError) as exc:
        raise ClusterError(str(exc)) from exc


def _run(
    b: ControlPlaneBench,
    log_level: str,
    progress: Callable[[str], None],
    stack: contextlib.ExitStack,
) -> dict[str, object]:
    prefill, decode = b.pools
    cluster = LocalCluster(
        transport="tcp",
        prefill_workers=0,
        decode_workers=0,
        orchestrators=0,
        log_level=log_level,
        tls=b.tls,
    )
    shards: LocalRedisCluster | None = None
    if b.redis_shards:
        progress(f"starting a Redis Cluster of {b.redis_shards} primaries")
        shards = LocalRedisCluster(cluster.workdir / "redis-cluster", primaries=b.redis_shards)
        stack.enter_context(shards)
        cluster.external_redis = shards.url
    if not b.hiredis:
        cluster.env.update(without_hiredis(cluster.workdir))
    hiredis = child_hiredis(cluster.env)
    progress(
        f"starting {prefill} + {decode} simulated workers, {b.fleet_processes} process(es)/role"
    )
    stack.enter_context(cluster)
    for role, count, sim in (
        ("prefill", prefill, b.prefill_sim),
        ("decode", decode, b.decode_sim),
    ):
        for i, n in enumerate(_split(count, b.fleet_processes)):
            if n:
                cluster.start_sim_workers(role, n, sim, i, *b.fleet_args)
    cluster.wait_live_workers(prefill, decode)
    progress(f"starting {b.orchestrators} orchestrator(s)")
    for i in range(b.orchestrators):
        extra = list(b.orchestrator_args)
        if b.profile_dir is not None:
            b.profile_dir.mkdir(parents=True, exist_ok=True)
            extra += ["--profile", str(b.profile_dir / f"orchestrator-{i}.pstats")]
        cluster.start_orchestrator(i, 0, *extra)

    pids = _pids(cluster, shards)
    tiers = {n: "orchestrators" for n in pids if n.startswith("orchestrator")}
    tiers.update({n: "redis" for n in pids if n.startswith("redis")})
    cores = _pin(pids, tiers) if b.pin else None
    if cores is not None:
        progress(f"pinned: {cores.describe()}")

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

    before = {name: _cpu_s(p) for name, p in pids.items()}
    progress(f"measuring: {b.requests} requests at concurrency {b.concurrency}")
    tls_dir = str(cluster.tls_dir) if b.tls else ""
    client_cores = cores.rest if cores is not None and cores.dedicated else None
    results = _drive(b, targets, log_level, tls_dir, cluster.env, client_cores)
    after = {name: _cpu_s(p) for name, p in pids.items()}
    merged = LoadResult.merge(results)
    cpu = {name: after[name] - before[name] for name in pids}
    cpu["clients"] = merged.cpu_s
    return _result(b, merged, cpu, tiers, cores, hiredis)


def _pin(pids: dict[str, list[int]], tiers: dict[str, str]) -> CoreAssignment:
    """Pin each process of ``tiers`` to its core, the others (when they can be kept off
    those cores) to the cores left."""
    cores = assign_cores(list(tiers), available_cores())
    for name in tiers:
        pin(pids[name][0], [cores.pinned[name]])
    if cores.dedicated:
        for name in set(pids) - set(tiers):
            for pid in pids[name]:
                pin(pid, cores.rest)
    return cores


def _pids(cluster: LocalCluster, shards: LocalRedisCluster | None) -> dict[str, list[int]]:
    """Measured process (or group of processes) -> its process ids."""
    procs = cluster.procs
    pids = {n: [p.popen.pid] for n, p in procs.items() if n.startswith("orchestrator")}
    if shards is None:
        pids["redis"] = [procs["redis"].popen.pid]
    else:
        pids.update({f"redis-{i}": [n.process.pid] for i, n in enumerate(shards.nodes)})
    for group, prefix in (("prefill_fleet", "prefill-sim"), ("decode_fleet", "decode-sim")):
        pids[group] = [p.popen.pid for n, p in procs.items() if n.startswith(prefix)]
    return pids


def _result(
    b: ControlPlaneBench,
    merged: LoadResult,
    cpu: dict[str, float],
    tiers: dict[str, str],
    cores: CoreAssignment | None,
    hiredis: bool,
) -> dict[str, object]:
    prefill, decode = b.pools
    summary = merged.summary()
    completed = max(1, int(str(summary["completed"])))
    usage = Usage(cpu, tiers, completed, sum(s.tokens for s in merged.samples))
    gpu_tokens_per_s = b.gpu_tokens_per_s

    def group_ms(names: Iterable[str]) -> float:
        return round(sum(cpu[n] for n in names) * 1000 / completed, 2)

    cpu_ms = {tier: group_ms(n for n, t in tiers.items() if t == tier) for tier in TIERS}
    cpu_ms.update({g: group_ms([g]) for g in ("prefill_fleet", "decode_fleet", "clients")})
    projections = {tier: project(usage, tier, gpu_tokens_per_s) for tier in TIERS}
    return {
        "workers": {"prefill": prefill, "decode": decode, "processes_per_role": b.fleet_processes},
        "sim": {
            "prefill": b.prefill_sim,
            "decode": b.decode_sim,
            "kv_scale": SimSpec.parse(b.prefill_sim).kv_scale,
        },
        "orchestrators": b.orchestrators,
        "redis_shards": b.redis_shards,
        "hiredis": hiredis,
        "concurrency": b.concurrency,
        "clients": b.clients,
        "max_tokens": b.max_tokens,
        "prompt_words": b.prompt_words,
        "tls": b.tls,
        "ramp_s": b.ramp_s,
        "chunk_window_ms": b.chunk_window_ms,
        "generate_many": b.generate_many,
        **summary,
        "tokens": usage.tokens,
        "orchestrator_cpu_ms_per_request": cpu_ms["orchestrators"],
        "tokens_per_message": round(usage.tokens / max(1, int(str(summary["messages"]))), 2),
        "orchestrator_cpu_us_per_message": round(
            sum(cpu[n] for n, t in tiers.items() if t == "orchestrators")
            * 1e6
            / max(1, int(str(summary["messages"]))),
            1,
        ),
        "cpu_ms_per_request": cpu_ms,
        "cpu_per_process": usage.per_process(),
        "pinning": None if cores is None else cores.to_dict(),
        "projection": {
            "decode_gpu": f"{b.decode_sim} at batch {b.gpu_batch}",
            "gpu_tokens_per_s": round(gpu_tokens_per_s),
            **{t: p.to_dict() if p is not None else None for t, p in projections.items()},
        },
        "cpus": os.cpu_count(),
        "profiled": b.profile_dir is not None,
        "settings": {k: str(v) for k, v in asdict(b).items()},
    }


def _drive(
    b: ControlPlaneBench,
    targets: tuple[str, ...],
    log_level: str,
    tls_dir: str,
    env: dict[str, str],
    cores: tuple[int, ...] | None,
) -> list[LoadResult]:
    """Run the load processes (over TLS with the client identity in ``tls_dir``, if
    given; with ``env`` added to the environment; pinned to ``cores``, if given); their
    results."""
    procs: list[subprocess.Popen[bytes]] = []
    results = []
    deadline = time.monotonic() + b.timeout_s
    try:
        for args in _client_argv(b, targets, log_level, tls_dir):
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env}
            )
            procs.append(proc)
            if cores is not None:
                pin(proc.pid, cores)
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


def _client_argv(
    b: ControlPlaneBench, targets: tuple[str, ...], log_level: str, tls_dir: str
) -> list[list[str]]:
    """Each load process's command line: its share of the requests and concurrency."""
    argv = []
    offset = 0
    for i, (requests, concurrency) in enumerate(
        zip(_split(b.requests, b.clients), _split(b.concurrency, b.clients), strict=True)
    ):
        if not requests:
            continue
        argv.append([
            sys.executable, "-m", "orchestrator.cli", "--log-level", log_level,
            "bench", "load",
            "--target", ",".join(targets),
            "--requests", str(requests),
            "--concurrency", str(max(1, concurrency)),
            "--max-tokens", str(b.max_tokens),
            "--prompt-words", str(b.prompt_words),
            "--offset", str(offset),
            "--ramp-s", str(b.ramp_s),
            "--ramp-phase", str(i / b.clients),
            "--chunk-window-ms", str(b.chunk_window_ms),
            "--generate-many", "on" if b.generate_many else "off",
            "--samples",
            *(["--tls-dir", tls_dir] if tls_dir else []),
        ])  # fmt: skip
        offset += requests
    return argv


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
        f"orchestration overhead ms: {r['overhead_ms']} (arrivals ramped over "
        f"{r['ramp_s']} s; channels connected in {r['connect_ms']} ms, before the clock)",
        f"client TTFT ms: {r['client_ttft_ms']}",
        f"worker TTFT ms: {r['worker_ttft_ms']}",
        f"orchestrator CPU ms/request: {r['orchestrator_cpu_ms_per_request']} "
        f"(all: {r['cpu_ms_per_request']})",
        f"client stream messages: {r['messages']} ({r['tokens_per_message']} tokens each); "
        f"orchestrator CPU µs/message: {r['orchestrator_cpu_us_per_message']}",
        f"redis: {r['redis_shards'] or 'one plain server'} shard(s); hiredis: {r['hiredis']}; "
        f"pinning: {r['pinning']}",
        f"CPU per process over {r['tokens']} relayed tokens:",
    ]
    per = r["cpu_per_process"]
    assert isinstance(per, dict)
    for name, figures in per.items():
        lines.append(
            f"  {name}: {figures['cpu_ms_per_request']} ms/request, "
            f"{figures['cpu_us_per_token']} µs/token"
        )
    proj = r["projection"]
    assert isinstance(proj, dict)
    lines.append(
        f"projection (not a measurement; one decode GPU = {proj['decode_gpu']}, "
        f"{proj['gpu_tokens_per_s']} tokens/s):"
    )
    for tier in TIERS:
        p = proj[tier]
        if p is None:
            lines.append(f"  {tier}: nothing to project from")
            continue
        lines.append(
            f"  {tier}: {p['us_per_token']} µs/token → {p['tokens_per_s_per_core']} tokens/s "
            f"per core ({p['decode_gpus_per_core']} decode GPUs); {p['processes']} process(es), "
            f"busiest {p['busiest_share']:.0%} → {p['tier_tokens_per_s']} tokens/s "
            f"({p['tier_decode_gpus']} decode GPUs)"
        )
    return "\n".join(lines)
