"""One `pdorch chaos run`: start the cluster, run the reference, the faulted runs, the checks.

The cluster is the same local one the demo starts (real Redis, orchestrators and workers as
processes), with fault proxies put on the links the scenario faults. The workload first runs
once without faults: its outputs are the reference (greedy and seeded sampling are both
deterministic). Then each run replays the workload with its own fault plan (seed + run
index), waits for a quiet period, reads every request's final state from Redis, and checks.
Each run also reads the workers' KV gauges from their heartbeats before the workload and after
the quiet period, for the leak check (`leaks`). Between runs every process is brought back
(continued, restarted) so runs are independent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from orchestrator.chaos.checker import TERMINAL_STATES, RunVerdict, Summary, check_run
from orchestrator.chaos.faults import FaultExecutor
from orchestrator.chaos.history import History
from orchestrator.chaos.leaks import Gauges, LeakReport, check_leaks
from orchestrator.chaos.proxy import FaultProxy
from orchestrator.chaos.scenario import (
    ClusterSpec,
    Scenario,
    ScenarioError,
    kv_fault_spec,
    plan,
)
from orchestrator.chaos.workload import Clients, RequestPlan, make_requests
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.errors import PdorchError
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.redis_store import RedisStore, StoreSettings
from transport.backend_names import TCP, UCX, needs_ucx
from transport.base import TransportSettings

log = logging.getLogger(__name__)

Steps = Callable[[str], AbstractContextManager[object]]
"""Wraps each phase of a chaos command (cluster start, reference run, each faulted run, stop)
so a front end can show progress; ``contextlib.nullcontext`` shows nothing."""

VLLM_READY_S = 900.0
"""How long vLLM workers may take to start (or restart after a kill): each builds a vLLM
engine, 20 s on an idle 2-core machine, minutes when several start at once."""


@dataclass(slots=True)
class ChaosResult:
    scenario: Scenario
    summary: Summary
    violations: list[str]
    pictures: list[Path] = field(default_factory=list)
    histories: list[Path] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        out = self.summary.to_json()
        out["violations"] = self.violations
        out["timeline"] = [str(p) for p in self.pictures]
        return out


def _transport(name: str) -> str:
    if name != "auto":
        return name
    from transport.ucx import ucx_available  # noqa: PLC0415

    return UCX if ucx_available() else TCP


def cluster_for(
    spec: ClusterSpec, model_cache: Path | None = None, redis: str = ""
) -> LocalCluster:
    """A (not yet started) local cluster for scenarios with this cluster spec, on ``redis``
    (any ``--redis`` URL: a Redis Cluster's, a Sentinel's) or else its own redis-server. Its
    workers take their KV fault from a file, re-read at each SIGUSR1, so one cluster serves
    many scenarios (see `shareable`)."""
    cluster = LocalCluster(
        model=spec.model,
        engine=spec.engine,
        transport=_transport(spec.transport),
        prefill_workers=spec.prefill,
        decode_workers=spec.decode,
        orchestrators=spec.orchestrators,
        model_cache=model_cache,
        redis_aof=spec.redis_aof,
        heartbeat_ttl_s=spec.heartbeat_ttl_s,
        external_redis=redis,
    )
    if spec.engine == "vllm":
        cluster.ready_timeout_s = VLLM_READY_S
    fault_file = str(cluster.workdir / "kv-fault")
    for role, flags in (("prefill", spec.prefill_flags), ("decode", spec.decode_flags)):
        cluster.worker_extra[role] = ["--kv-fault-file", fault_file, *flags]
    cluster.orchestrator_extra = list(spec.orchestrator_flags)
    return cluster


def shareable(scenario: Scenario, cluster: LocalCluster) -> bool:
    """Whether ``scenario`` can run on an already started ``cluster``: same shape, and no
    fault proxy to put in front of its processes (UCX KV faults need none)."""
    spec = scenario.cluster
    transport = _transport(spec.transport)
    proxies = scenario.links() - ({"kv"} if needs_ucx(transport) else set())
    fault_file = str(cluster.workdir / "kv-fault")
    own_redis_cluster = spec.redis_cluster is not None  # started (and faulted) by its runner
    return not proxies and not own_redis_cluster and (
        (cluster.model, cluster.engine, cluster.transport, cluster.prefill_workers,
         cluster.decode_workers, cluster.orchestrators, cluster.redis_aof,
         cluster.heartbeat_ttl_s, cluster.worker_extra.get("prefill"),
         cluster.worker_extra.get("decode"), cluster.orchestrator_extra)
        == (spec.model, spec.engine, transport, spec.prefill, spec.decode, spec.orchestrators,
            spec.redis_aof, spec.heartbeat_ttl_s,
            ["--kv-fault-file", fault_file, *spec.prefill_flags],
            ["--kv-fault-file", fault_file, *spec.decode_flags], list(spec.orchestrator_flags))
    )  # fmt: skip


class ChaosRunner:
    def __init__(
        self,
        scenario: Scenario,
        *,
        seed: int = 0,
        runs: int = 1,
        out_dir: Path | None = None,
        model_cache: Path | None = None,
        pictures: bool = True,
        cluster: LocalCluster | None = None,
        steps: Steps = contextlib.nullcontext,
        redis: str = "",
    ) -> None:
        """``cluster``: an already started cluster to run on (it is restored, not stopped,
        at the end); None starts one for this command, on ``redis`` if given (a Redis the
        runner neither starts nor faults). ``steps``: see `Steps`."""
        self.scenario = scenario
        self.steps = steps
        self.seed = seed
        self.runs = runs
        self.out_dir = out_dir or Path("chaos-out") / scenario.name
        self.model_cache = model_cache
        self.pictures = pictures
        self.transport = _transport(scenario.cluster.transport)
        if cluster is not None and not shareable(scenario, cluster):
            raise ScenarioError(f"scenario {scenario.name} cannot run on the given cluster")
        check_runnable(scenario, seed=seed, runs=runs, redis=redis)
        self.shared = cluster is not None
        self.cluster = cluster or cluster_for(scenario.cluster, model_cache, redis)
        self.links = scenario.links()
        self.kv_injector = "kv" in self.links and needs_ucx(self.transport)
        self.proxies: dict[str, dict[str, FaultProxy]] = {}
        self.kv_file: Path | None = (
            self.cluster.workdir / "kv-fault" if scenario.cluster.engine == "reference" else None
        )
        """The workers' KV fault file (their injector's faults; reference engine only)."""
        self.redis_cluster: LocalRedisCluster | None = None
        """The Redis Cluster this runner started for the fleet (``cluster.redis_cluster``)."""

    # ------------------------------------------------------------------------ setup

    def _workers(self) -> list[str]:
        spec = self.scenario.cluster
        return [f"prefill-{i}" for i in range(spec.prefill)] + [
            f"decode-{i}" for i in range(spec.decode)
        ]

    async def _start(self) -> list[str]:
        """Start proxies and the cluster; returns the addresses clients connect to."""
        if self.kv_file is not None:
            self.kv_file.write_text(kv_fault_spec((), None))  # nothing armed
        if self.shared:
            await self._restore()
            return list(self.cluster.orchestrator_addresses)
        workers = self._workers()
        if "worker" in self.links:
            self.proxies["worker"] = {}
            for name in workers:
                proxy = FaultProxy(f"grpc-{name}", "127.0.0.1:1", seed=self.seed)
                self.cluster.advertise[name] = await proxy.start()
                self.proxies["worker"][name] = proxy
        if "kv" in self.links and not self.kv_injector:
            self.proxies["kv"] = {}
            for name in (w for w in workers if w.startswith("decode")):
                proxy = FaultProxy(f"kv-{name}", "127.0.0.1:1", seed=self.seed + 1)
                self.cluster.kv_advertise[name] = await proxy.start()
                self.proxies["kv"][name] = proxy

        def retarget(name: str, port: int, kv_port: int) -> None:
            if name in self.proxies.get("worker", {}):
                self.proxies["worker"][name].retarget(f"127.0.0.1:{port}")
            if name in self.proxies.get("kv", {}):
                self.proxies["kv"][name].retarget(f"127.0.0.1:{kv_port}")

        self.cluster.on_worker_ports = retarget
        if (rc := self.scenario.cluster.redis_cluster) is not None:
            self.redis_cluster = LocalRedisCluster(
                self.cluster.workdir / "redis-cluster",
                primaries=rc.primaries,
                replicas=rc.replicas,
                node_timeout_ms=rc.node_timeout_ms,
            )
            await asyncio.to_thread(self.redis_cluster.start)
            self.cluster.external_redis = self.redis_cluster.url
        await asyncio.to_thread(self.cluster.start)
        addresses = list(self.cluster.orchestrator_addresses)
        if "client" in self.links:
            self.proxies["client"] = {}
            fronted = []
            for i, address in enumerate(addresses):
                proxy = FaultProxy(f"client-{i}", address, seed=self.seed + 2)
                fronted.append(await proxy.start())
                self.proxies["client"][f"orchestrator-{i}"] = proxy
            addresses = fronted
        return addresses

    async def _restore(self) -> None:
        """Every process back and healthy, every link clean: the next run starts whole."""
        for proxies in self.proxies.values():
            for proxy in proxies.values():
                proxy.faults.clear()

        def restore() -> None:
            c = self.cluster
            redis_proc = c.procs.get("redis")  # none on an external Redis
            if redis_proc is not None and redis_proc.popen.poll() is not None:
                c.start_redis(c.redis_aof)
            if self.redis_cluster is not None:
                self.redis_cluster.rejoin()  # a killed primary back, as a replica
            if self.kv_file is not None:
                self.kv_file.write_text(kv_fault_spec((), None))  # for workers restarted below
            for name in self._workers():
                proc = c.procs[name]
                proc.signal(signal.SIGCONT)
                if self.kv_file is not None:  # (a worker still importing would die of SIGUSR2)
                    proc.signal(signal.SIGUSR2)  # KV fault injector off
                if proc.popen.poll() is not None:
                    role, index = name.rsplit("-", 1)
                    c.start_worker(role, int(index))
            for i in range(self.scenario.cluster.orchestrators):
                proc = c.procs[f"orchestrator-{i}"]
                proc.signal(signal.SIGCONT)
                if proc.popen.poll() is not None:
                    c.start_orchestrator(i)
            c.wait_workers(self.scenario.cluster.prefill, self.scenario.cluster.decode)

        await asyncio.to_thread(restore)

    async def _close(self) -> None:
        if self.shared:
            await self._restore()  # whole again for whoever runs on it next
            return
        await asyncio.to_thread(self.cluster.stop)
        if self.redis_cluster is not None:
            await asyncio.to_thread(self.redis_cluster.stop)
        for proxies in self.proxies.values():
            for proxy in proxies.values():
                await proxy.close()

    # ------------------------------------------------------------------------ runs

    async def run(self) -> ChaosResult:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        plans = make_requests(self.scenario.workload, self.seed)
        store = RedisStore(StoreSettings(url="redis://127.0.0.1:1/0"))
        name, n = self.scenario.name, len(plans)
        try:
            with self.steps(f"{name}: cluster up ({'shared' if self.shared else 'starting'})"):
                addresses = await self._start()
            await store.close()
            store = RedisStore(StoreSettings(url=self.cluster.redis_url))
            with self.steps(f"{name}: reference run, {n} requests without faults"):
                reference = await self._reference(addresses, plans)
            summary = Summary(self.scenario.name)
            result = ChaosResult(self.scenario, summary, [])
            for i in range(self.runs):
                with self.steps(
                    f"{name}: run {i + 1}/{self.runs}, {n} requests under faults, then checks"
                ):
                    verdict, history = await self._one(i, addresses, plans, reference, store)
                summary.runs.append(verdict)
                self._save(result, verdict, history)
                log.info("chaos %s run %d: %s", self.scenario.name, i, verdict.clean)
                if i + 1 < self.runs:
                    await self._restore()
            result.violations = summary.violations(self.scenario.invariants)
            if (keep := self.scenario.keep_up_s) > 0:
                with self.steps(f"{name}: keeping the cluster up for {keep:g} s (keep_up_s)"):
                    await asyncio.sleep(keep)  # the scenario asks for it: metrics, logs
            return result
        finally:
            await store.close()
            with self.steps(f"{name}: {'restoring' if self.shared else 'stopping'} the cluster"):
                await self._close()

    async def _reference(
        self, addresses: list[str], plans: list[RequestPlan]
    ) -> dict[int, tuple[int, ...]]:
        history = History(run=-1, seed=self.seed)
        clients = Clients(
            addresses,
            history,
            time.monotonic(),
            concurrency=self.scenario.workload.concurrency,
            timeout_s=self.scenario.workload.request_timeout_s,
            prefix=f"chaos-{self.scenario.name}-{self.seed}-{time.time_ns()}-ref",
            tls=self.cluster.credentials(),
            many=self.scenario.workload.client == "generate-many",
        )
        try:
            reference = await clients.run(plans)
        finally:
            await clients.close()
        if len(reference) != len(plans):
            failed = [op for op in history.ops if op.type in {"fail", "info"}]
            raise ScenarioError(
                f"the fault-free reference run did not complete "
                f"({len(reference)}/{len(plans)}): {failed[:3]}"
            )
        return reference

    async def _one(
        self,
        index: int,
        addresses: list[str],
        plans: list[RequestPlan],
        reference: dict[int, tuple[int, ...]],
        store: RedisStore,
    ) -> tuple[RunVerdict, History]:
        seed = self.seed + index
        history = History(run=index, seed=seed)
        # Before the run's clock starts: waiting for idle workers (up to a heartbeat TTL)
        # must not eat into the fault plan's times, which count from the workload's start.
        baseline = await self._baseline(store)
        t0 = time.monotonic()
        clients = Clients(
            addresses,
            history,
            t0,
            concurrency=self.scenario.workload.concurrency,
            timeout_s=self.scenario.workload.request_timeout_s,
            prefix=f"chaos-{self.scenario.name}-{seed}-{time.time_ns()}",
            tls=self.cluster.credentials(),
            many=self.scenario.workload.client == "generate-many",
        )
        executor = FaultExecutor(
            self.cluster,
            store,
            history,
            self.proxies,
            kv_injector=self.kv_injector,
            now=clients.now,
            seed=seed,
            late_bound_s=self.scenario.late_bound_s,
            kv_file=self.kv_file,
            redis_cluster=self.redis_cluster,
        )

        async def faults() -> None:
            for fault in plan(self.scenario, seed):
                # Faults run in plan order: one due while an earlier one still waited for its
                # trigger is due when that one is done (its `planned_at` keeps the plan's time).
                due = max(fault.at, clients.now())
                if fault.after_healed:
                    await executor.settle()  # earlier faults back in service first
                    due = max(due, clients.now())
                delay = fault.at - clients.now()
                if delay > 0:
                    await asyncio.sleep(delay)  # the fault's scheduled time
                await executor.inject(fault, due)

        executor.start()  # request records read all along: faults never wait on reads

        load = asyncio.create_task(clients.run(plans), name="pdorch-chaos-workload")
        injector = asyncio.create_task(faults(), name="pdorch-chaos-faults")
        try:
            limit = self.scenario.duration_s + self.scenario.workload.request_timeout_s
            done, _ = await asyncio.wait({load}, timeout=limit)
            if not done:
                raise ScenarioError(f"run {index}: clients still running after {limit}s")
            await injector
            await executor.settle()
            history.end = clients.now()
            states, epochs = await self._quiet(store, list(history.requests))
            leaks = await self._leaks(store, baseline)
        finally:
            for task in (load, injector):
                task.cancel()
            await asyncio.gather(load, injector, return_exceptions=True)
            await executor.cancel()
            await clients.close()
        return check_run(history, reference, states, epochs, leaks), history

    async def _quiet(
        self, store: RedisStore, rids: list[str]
    ) -> tuple[dict[str, str], dict[str, int]]:
        """The quiet period: no more client traffic; wait until every request the store knows
        has a terminal state, or ``quiet_s`` passed. What is still live then is *lost*."""
        deadline = time.monotonic() + self.scenario.quiet_s
        while True:
            states, epochs = await self._states(store, rids)
            live = [r for r, s in states.items() if s and s not in TERMINAL_STATES]
            if not live or time.monotonic() > deadline:
                return states, epochs
            await asyncio.sleep(0.2)  # polling the store with a deadline

    async def _gauges(self, store: RedisStore) -> dict[str, Gauges]:
        """KV gauges of the cluster's workers whose current process is alive and heartbeats
        (a dead one's last heartbeat outlives it by up to its TTL: it is not read)."""
        try:
            infos = await asyncio.wait_for(store.workers(), 5.0)
        except (PdorchError, TimeoutError):
            return {}
        c = self.cluster
        return {
            i.worker_id: Gauges.of(i)
            for i in infos
            if i.worker_id in c.procs
            and c.procs[i.worker_id].popen.poll() is None
            and c.expected.get(i.worker_id) == i.address
        }

    async def _baseline(self, store: RedisStore) -> dict[str, Gauges]:
        """The gauges before the workload, once the workers are idle (the last run's or the
        reference run's requests may still show for a heartbeat or two)."""
        deadline = time.monotonic() + self.scenario.cluster.heartbeat_ttl_s + 2.0
        while True:
            gauges = await self._gauges(store)
            idle = all(g.active == 0 and g.kv_used_bytes == 0 for g in gauges.values())
            if idle or time.monotonic() > deadline:
                if not idle:
                    log.warning("chaos: workers not idle before the run: %s", gauges)
                return gauges
            await asyncio.sleep(0.2)  # heartbeats publish the gauges about once a second

    async def _leaks(self, store: RedisStore, baseline: dict[str, Gauges]) -> LeakReport:
        """Poll the workers' gauges until nothing leaks, or the scenario's leak wait passed
        (then the last reading is the verdict)."""
        wait = self.scenario.leak_wait_s
        if wait is None:
            wait = TransportSettings().kv_hold_s + self.scenario.cluster.heartbeat_ttl_s
        started = time.monotonic()
        while True:
            report = check_leaks(baseline, await self._gauges(store))
            elapsed = time.monotonic() - started
            if report.clean:
                report.settle_s = round(elapsed, 3)
                return report
            if elapsed > wait:
                return report
            await asyncio.sleep(0.2)  # heartbeats publish the gauges about once a second

    async def _states(
        self, store: RedisStore, rids: list[str]
    ) -> tuple[dict[str, str], dict[str, int]]:
        """Final states and epochs from Redis (retrying while it comes back from a restart)."""
        deadline = time.monotonic() + 30
        while True:
            out: dict[str, str] = {}
            epochs: dict[str, int] = {}
            try:
                for rid in rids:
                    record = await asyncio.wait_for(store.get(rid), 2.0)
                    out[rid] = "" if record is None else str(record.state)
                    if record is not None:
                        epochs[rid] = record.epoch
            except (PdorchError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)  # Redis is restarting: poll until it answers
            else:
                return out, epochs

    def _save(self, result: ChaosResult, verdict: RunVerdict, history: History) -> None:
        path = self.out_dir / f"run-{history.run:03d}-seed-{history.seed}.json"
        path.write_text(history.dumps())
        result.histories.append(path)
        if self.pictures and (history.run < 3 or not verdict.clean):
            from orchestrator.chaos.timeline import draw  # noqa: PLC0415 - matplotlib is heavy

            picture = path.with_suffix(".png")
            draw(history, verdict, picture, title=f"{self.scenario.name} — run {history.run}")
            result.pictures.append(picture)


def check_runnable(scenario: Scenario, *, seed: int, runs: int, redis: str = "") -> None:
    """Raise `ScenarioError` if ``scenario`` cannot run with these options: a front end calls
    it before announcing the run (`ChaosRunner` calls it again)."""
    if redis and _faults_redis(scenario, seed, runs):
        raise ScenarioError(f"scenario {scenario.name} faults Redis: not with --redis")
    if redis and scenario.cluster.redis_cluster is not None:
        raise ScenarioError(
            f"scenario {scenario.name} starts its own Redis Cluster: not with --redis"
        )
    transport = _transport(scenario.cluster.transport)
    if "kv" in scenario.links() and needs_ucx(transport) and scenario.cluster.engine == "vllm":
        raise ScenarioError(
            f"scenario {scenario.name}: KV-link faults with engine vllm need transport tcp"
        )


def _faults_redis(scenario: Scenario, seed: int, runs: int) -> bool:
    return any(
        f.target.split(":")[0] == "redis" for i in range(runs) for f in plan(scenario, seed + i)
    )


def run_chaos(
    scenario: Scenario,
    *,
    seed: int,
    runs: int,
    out_dir: Path | None,
    model_cache: Path | None,
    as_json: bool,
    steps: Steps = contextlib.nullcontext,
    redis: str = "",
) -> int:
    try:
        runner = ChaosRunner(
            scenario, seed=seed, runs=runs, out_dir=out_dir, model_cache=model_cache,
            steps=steps, redis=redis,
        )  # fmt: skip
        result = asyncio.run(runner.run())
    except (ScenarioError, ClusterError, grpc.RpcError) as exc:
        print(f"pdorch chaos: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        print(result.summary.human())
        for p in result.pictures:
            print(f"  timeline: {p}")
        print("  verdict: " + ("OK" if not result.violations else ", ".join(result.violations)))
    return 1 if result.violations else 0
