"""A local pdorch cluster as real processes on loopback: Redis, orchestrators, workers.

Used by `pdorch demo`, the integration tests and the chaos tool. Every process is started
through the `pdorch` CLI (``python -m orchestrator.cli``), so what runs here is what runs
in a deployment. Readiness is awaited on conditions (Redis PING, workers' heartbeats in
Redis, the orchestrator's gRPC health), each with a deadline; `stop` terminates in phases.

**TLS by default**: the cluster makes a throwaway CA in ``<workdir>/tls`` (`orchestrator
.certs`, once per cluster) and starts every orchestrator and worker with ``--tls-dir``, so the
client API and orchestrator→worker calls are mutual TLS. `channel` gives a test or a
demo a channel to one of its processes with the right identity (a client's to an
orchestrator, the orchestrator's to a worker). The gateway stays plain HTTP on loopback
(``--http-plain``); ``tls=False`` runs everything plaintext (``--insecure``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisClusterException

from orchestrator.api.tls import Tls, secure_channel
from orchestrator.core.peers import CA_FILE, ORCHESTRATOR_SERVER_NAME, WORKER_SERVER_NAME, Role
from orchestrator.ports import free_port
from orchestrator.procs import group_runs, pid_taken
from orchestrator.rpc.client import channel as client_channel
from orchestrator.store.connect import sync_client
from orchestrator.store.keys import Keys
from orchestrator.store.server import RedisServer, RedisServerError

__all__ = [
    "ClusterError",
    "LocalCluster",
    "Proc",
    "connect",
    "free_port",
    "spawn",
]


class ClusterError(Exception):
    """The local cluster could not start (a process died or never became ready)."""


_KEYS = Keys()
"""The orchestrators and workers started here use the store's default key prefix."""


def _wait(predicate: object, timeout_s: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                raise ClusterError(f"{p.name} exited with {p.popen.returncode}: {p.tail()}")
        if predicate():  # type: ignore[operator]
            return
        time.sleep(delay)  # polling a condition with a deadline, not a fixed sleep
        delay = min(delay * 2, 0.25)
    raise ClusterError(f"timed out after {timeout_s}s waiting for {what}")


GROUP_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT})
"""Signals a process group takes as a whole, as a pod or node does: killed, frozen or thawed
with everything it started (a vLLM worker's engine core and model worker are its children,
about 3.4 GB, and outlive a parent killed alone). Other signals (SIGTERM, the KV fault
injector's SIGUSR1/2) go to the leader only: it drains, then stops its children itself, and
a vLLM child would die of a SIGUSR1 it does not handle."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    group: bool = False
    """The process leads its own process group (started with `spawn`): `GROUP_SIGNALS` and
    `stop` reach every process in it."""

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` (to the group, for `GROUP_SIGNALS`). Nothing once the process has
        been reaped: its pid, and so its group's id, may belong to another process by then
        (pids wrap at 32768 here)."""
        if self.popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.group and sig in GROUP_SIGNALS:
                os.killpg(self.popen.pid, sig)
            else:
                os.kill(self.popen.pid, sig)

    def _exited(self) -> bool:
        """The leader exited (it is not reaped: its pid still names its group)."""
        try:
            return os.waitid(os.P_PID, self.popen.pid, _EXITED_NOWAIT) is not None
        except ChildProcessError:  # reaped meanwhile
            return True

    def _reaped(self) -> bool:
        """The leader was reaped: its pid no longer holds its group's id for it."""
        if self.popen.returncode is not None:
            return True
        try:
            os.waitid(os.P_PID, self.popen.pid, _EXITED_NOWAIT)
        except ChildProcessError:  # reaped by someone else than `popen`
            return True
        return False

    def exit_status(self) -> str | None:
        """How the process ended ("exited with 1", "killed by SIGKILL"); None while it runs.
        It is not reaped: its pid keeps naming its group, which `stop` then still reaches."""
        code = self.popen.returncode
        if code is None:
            try:
                info = os.waitid(os.P_PID, self.popen.pid, _EXITED_NOWAIT)
            except ChildProcessError:
                return "exited"  # reaped by someone else: its status went with it
            if info is None:
                return None
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            code = -info.si_status if killed else info.si_status
        return f"killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (the leader drains and stops its children), SIGKILL after ``grace_s``;
        the group is killed before the leader is reaped, so nothing it started is left
        running, whatever the leader left behind.

        A leader gone already (killed alone, ``kill -9 PID`` or an OOM kill; or crashed) may
        have left its group running — a vLLM worker's engine core and model workers, GBs of
        memory: that group gets SIGTERM, then SIGKILL after ``grace_s``, reaped or not."""
        if self.popen.returncode is None and not self._exited():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while not self._exited() and time.monotonic() < deadline:
                time.sleep(0.02)  # polling the exit with a deadline (not reaping it yet)
            if self.group or not self._exited():
                self.signal(signal.SIGKILL)  # the leader, or the stragglers of its group
        elif self.group:
            self._stop_orphans(grace_s)
        self.popen.wait()

    def _stop_orphans(self, grace_s: float) -> None:
        """Stop what the exited leader's group still runs: SIGTERM, SIGKILL after ``grace_s``."""
        if not self._signal_group(signal.SIGCONT):
            return  # nothing left of the group
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._orphans_run() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling their exits with a deadline (not our children)
        self._signal_group(signal.SIGKILL)

    def _group_gone(self) -> bool:
        """Whether the leader's pid has been handed to another process since it was reaped.
        Linux gives out no pid that is in use as a process group's id, so while the group
        has members the pid stays free: taken, the group is empty and the pid is a
        newcomer's (whose group of the same id is not ours to signal)."""
        return self._reaped() and pid_taken(self.popen.pid)

    def _signal_group(self, sig: int) -> bool:
        """``sig`` to the group of the exited leader; False when there is none to signal."""
        if self._group_gone():
            return False
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _orphans_run(self) -> bool:
        return not self._group_gone() and group_runs(self.popen.pid)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_EXITED_NOWAIT = os.WEXITED | os.WNOHANG | os.WNOWAIT


def spawn(name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Proc:
    """Start ``args`` as the leader of a new session and process group, output to
    ``log_path``: a kill of the returned `Proc` is a kill of everything it started."""
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return Proc(name, popen, log_path, args, group=True)


SIM_WORKER = "llama-3-8b@L4"
"""What ``engine="sim"`` workers simulate (``pdorch worker --sim``)."""


@dataclass
class LocalCluster:
    model: str = "tiny"
    transport: str = "ucx"
    engine: str = "reference"
    """Workers' ``--engine``: reference, or vllm (run from the vllm extra's environment); or
    sim: `start_worker` starts simulated workers with a prefix cache (`SIM_WORKER`)."""
    prefill_workers: int = 1
    decode_workers: int = 2
    orchestrators: int = 1
    model_cache: Path | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdorch-")))
    ready_timeout_s: float = 120.0
    redis_port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)
    orchestrator_addresses: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    redis_aof: bool = False
    """Redis with an append-only file, so a killed redis-server restarts without loss (the
    AOF is written before replies; ``everysec`` only defers the fsync, which matters for a
    machine crash, not a process kill)."""
    expected: dict[str, str] = field(default_factory=dict)
    """Worker name -> the gRPC address its current process publishes."""
    worker_extra: dict[str, list[str]] = field(default_factory=dict)
    """Role -> extra `pdorch worker` flags for every worker of that role (e.g. --kv-fault);
    ``{index}`` in a flag is replaced by the worker's index (e.g. a metrics port each)."""
    heartbeat_ttl_s: float = 3.0
    advertise: dict[str, str] = field(default_factory=dict)
    """Worker name -> address to publish instead of its own (a fault proxy in front of it)."""
    kv_advertise: dict[str, str] = field(default_factory=dict)
    """Worker name -> KV address to publish instead of its own (TCP transport only)."""
    on_worker_ports: Callable[[str, int, int], None] | None = None
    """Told each (re)started worker's real gRPC and KV ports (proxies retarget to them)."""
    on_spawn: Callable[[], object] | None = None
    """Called as each process has been started, before it is ready (`pdorch up` lists it
    in its state file there: killed while waiting, it leaves nothing `down` cannot find)."""
    gateway: bool = False
    """Every orchestrator also serves the OpenAI-compatible gateway (`--http-port`)."""
    gateway_port: int = 0
    """The gateway port of orchestrator 0 (0: a free port); the others always get free ones."""
    orchestrator_extra: list[str] = field(default_factory=list)
    """Extra `pdorch orchestrator` flags for every orchestrator (e.g. --api-key); ``{index}``
    is replaced by the orchestrator's index."""
    aggregate_below: str = "0"
    """Conditional disaggregation (`--aggregate-below`). Off by default here: on one machine
    every worker is the same CPU, where "auto" rightly keeps short prompts local, and the
    demo, the tests and the chaos scenarios are about moving KV between workers."""
    gateway_urls: list[str] = field(default_factory=list)
    """Orchestrator index -> its gateway's base URL (``http://127.0.0.1:PORT``)."""
    tls: bool = True
    """Run with TLS (a throwaway CA in ``<workdir>/tls``); False: plaintext (``--insecure``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every process the cluster starts (a benchmark's switches)."""

    @property
    def tls_dir(self) -> Path:
        return self.workdir / "tls"

    def _tls_flags(self) -> list[str]:
        """The TLS flags of every orchestrator and worker (the CA made on first use)."""
        if not self.tls:
            return ["--insecure"]
        if not (self.tls_dir / CA_FILE).exists():
            from orchestrator.certs import make_tls_dir  # noqa: PLC0415 - cryptography

            make_tls_dir(self.tls_dir)
        return ["--tls-dir", str(self.tls_dir)]

    def _orchestrator_tls_flags(self) -> list[str]:
        """An orchestrator's: the client API is mutual TLS too (clients here have a
        certificate; a worker's is refused)."""
        flags = self._tls_flags()
        return [*flags, "--client-cert", "required"] if self.tls else flags

    def credentials(self, role: Role = Role.CLIENT) -> Tls | None:
        """The credentials of ``role`` (None when the cluster runs plaintext)."""
        if not self.tls:
            return None
        self._tls_flags()
        return Tls.load(self.tls_dir, role.identity)

    def channel(self, address: str, token: str | None = None) -> grpc.aio.Channel:
        """A channel to one of this cluster's processes: a client's to an orchestrator, the
        orchestrator's to a worker (a test acting as the control plane)."""
        worker = address not in self.orchestrator_addresses
        tls = self.credentials(Role.ORCHESTRATOR if worker else Role.CLIENT)
        if tls is not None and worker:
            return secure_channel(address, tls, WORKER_SERVER_NAME)
        return client_channel(address, token, tls=tls)

    external_redis: str = ""
    """A Redis to use instead of starting one (any ``--redis`` URL: a Redis Cluster's, a
    Sentinel's); empty: the cluster starts its own redis-server."""

    @property
    def redis_url(self) -> str:
        return self.external_redis or f"redis://127.0.0.1:{self.redis_port}/0"

    def _redis(self, timeout_s: float) -> Any:
        """A blocking client of the cluster's Redis, whatever its shape."""
        return sync_client(self.redis_url, timeout_s)

    def _spawn(self, name: str, args: list[str]) -> Proc:
        old = self.procs.get(name)
        if old is not None:
            old.stop()  # reap a killed predecessor before replacing it
        log_path = self.workdir / f"{name}.log"
        env = dict(os.environ)
        env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        env.update(self.env)
        proc = spawn(name, args, log_path, env)
        self.procs[name] = proc
        if self not in _LIVE:
            _LIVE.append(self)
        if self.on_spawn is not None:
            self.on_spawn()
        return proc

    def _pdorch(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "orchestrator.cli", "--log-level", self.log_level, *args]

    def start(self) -> LocalCluster:
        try:
            if not self.external_redis:
                self.start_redis(self.redis_aof)
            for i in range(self.prefill_workers):
                self.start_worker("prefill", i)
            for i in range(self.decode_workers):
                self.start_worker("decode", i)
            self.wait_workers(self.prefill_workers, self.decode_workers)
            for i in range(self.orchestrators):
                self.start_orchestrator(i)
        except BaseException:
            self.stop()
            raise
        return self

    def start_redis(self, appendonly: bool = False) -> None:
        """Start (or restart, on the same port and directory) the cluster's redis-server."""
        old = self.procs.pop("redis", None)
        if old is not None:
            old.stop()  # reap a killed predecessor before replacing it
        log = self.workdir / "redis.log"
        # Its own session, as every process here: a Ctrl-C at the terminal reaches `pdorch
        # up` alone, which stops the orchestrators (draining into Redis) before Redis.
        server = RedisServer(
            self.workdir, port=self.redis_port, appendonly=appendonly, log=log, new_session=True
        )
        try:
            server.start()
        except RedisServerError as exc:
            raise ClusterError(str(exc)) from exc
        self.redis_port = server.port
        self.procs["redis"] = Proc("redis", server.process, log, server.argv, group=True)
        if self.on_spawn is not None:
            self.on_spawn()

    def worker_args(self, role: str, index: int) -> list[str]:
        if self.engine == "sim":  # one simulated worker with a prefix cache, no model
            return self._pdorch(
                "worker",
                "--role", role,
                "--redis", self.redis_url,
                "--sim", SIM_WORKER,
                "--sim-prefix-cache",
                "--transport", self.transport,
                "--worker-id", f"{role}-{index}",
                "--heartbeat-ttl", str(self.heartbeat_ttl_s),
                *self._tls_flags(),
            )  # fmt: skip
        args = self._pdorch(
            "worker",
            "--role", role,
            "--redis", self.redis_url,
            "--model", self.model,
            "--transport", self.transport,
            "--worker-id", f"{role}-{index}",
            # several workers share this machine's cores: one engine thread each
            "--torch-threads", "1",
            "--heartbeat-ttl", str(self.heartbeat_ttl_s),
            "--engine", self.engine,
            *self._tls_flags(),
        )  # fmt: skip
        if self.model_cache is not None:
            args += ["--model-cache", str(self.model_cache)]
        return args

    def start_worker(self, role: str, index: int, *extra: str) -> Proc:
        """Start (or restart) a worker on fresh ports; it counts as registered only once its
        own heartbeat — with these ports — is in Redis, not a dead predecessor's."""
        name = f"{role}-{index}"
        port = free_port()
        kv_port = free_port() if name in self.kv_advertise else 0
        self.expected[name] = self.advertise.get(name, f"127.0.0.1:{port}")
        args = [*self.worker_args(role, index), "--port", str(port), "--kv-port", str(kv_port)]
        if name in self.advertise:
            args += ["--advertise", self.advertise[name]]
        if name in self.kv_advertise:
            args += ["--kv-advertise", self.kv_advertise[name]]
        if self.on_worker_ports is not None:
            self.on_worker_ports(name, port, kv_port)
        args += [*_indexed(self.worker_extra.get(role, []), index), *extra]
        return self._spawn(name, args)

    def registered_names(self) -> set[str]:
        """Workers whose current process (its published address) has a live heartbeat."""
        found = set()
        try:
            with contextlib.closing(self._redis(1.0)) as client:
                for name, address in self.expected.items():
                    raw = client.get(_KEYS.worker(name))
                    if raw is not None and json.loads(str(raw)).get("address") == address:
                        found.add(name)
        except (redis.RedisError, RedisClusterException):
            return set()
        return found

    def wait_registered(self, names: list[str], timeout_s: float) -> None:
        procs = [self.procs[n] for n in names]
        _wait(lambda: set(names) <= self.registered_names(), timeout_s, f"{names}", procs)

    def registered(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0}
        try:
            with contextlib.closing(self._redis(1.0)) as client:
                for name, address in self.expected.items():
                    raw = client.get(_KEYS.worker(name))
                    if raw is not None and json.loads(str(raw)).get("address") == address:
                        role = name.split("-", 1)[0]
                        counts[role] = counts.get(role, 0) + 1
        except (redis.RedisError, RedisClusterException):
            return {}
        return counts

    def wait_workers(self, prefill: int, decode: int, timeout_s: float | None = None) -> None:
        workers = [p for n, p in self.procs.items() if n.startswith(("prefill", "decode"))]

        def ready() -> bool:
            c = self.registered()
            return c.get("prefill", 0) >= prefill and c.get("decode", 0) >= decode

        _wait(ready, timeout_s or self.ready_timeout_s, "workers to register", workers)

    def start_sim_workers(
        self, role: str, count: int, sim: str, index: int = 0, *extra: str
    ) -> Proc:
        """Start ``count`` simulated workers of ``role`` in one process (``pdorch worker --sim``),
        ids ``<role>-s<index>-0`` … ``-<count-1>``; wait for them with `wait_live_workers`."""
        args = self._pdorch(
            "worker",
            "--role", role,
            "--redis", self.redis_url,
            "--sim", sim,
            "--count", str(count),
            "--transport", "tcp",
            "--worker-id", f"{role}-s{index}",
            "--heartbeat-ttl", str(self.heartbeat_ttl_s),
            *self._tls_flags(),
            *extra,
        )  # fmt: skip
        return self._spawn(f"{role}-sim-{index}", args)

    def live_workers(self) -> dict[str, int]:
        """Role -> workers with a live heartbeat in Redis, whoever started them."""
        counts: dict[str, int] = {}
        try:
            with contextlib.closing(self._redis(2.0)) as client:
                ids = sorted(str(i) for i in client.smembers(_KEYS.workers))
                values = [client.get(_KEYS.worker(i)) for i in ids]  # one slot each: no MGET
                for raw in values:
                    if raw is not None:
                        role = str(json.loads(str(raw)).get("role", ""))
                        counts[role] = counts.get(role, 0) + 1
        except (redis.RedisError, RedisClusterException):
            return {}
        return counts

    def wait_live_workers(self, prefill: int, decode: int, timeout_s: float | None = None) -> None:
        workers = [p for n, p in self.procs.items() if n.startswith(("prefill", "decode"))]

        def ready() -> bool:
            c = self.live_workers()
            return c.get("prefill", 0) >= prefill and c.get("decode", 0) >= decode

        _wait(ready, timeout_s or self.ready_timeout_s, "simulated workers to register", workers)

    def start_orchestrator(self, index: int, port: int = 0, *extra: str) -> str:
        if not port and index < len(self.orchestrator_addresses):
            port = int(self.orchestrator_addresses[index].rpartition(":")[2])  # restart
        port = port or free_port()
        args = self._pdorch(
            "orchestrator",
            "--redis", self.redis_url,
            "--port", str(port),
            "--replica-id", f"orchestrator-{index}",
            "--aggregate-below", self.aggregate_below,
            *self._orchestrator_tls_flags(),
            *_indexed(self.orchestrator_extra, index),
            *extra,
        )  # fmt: skip
        url = ""
        if self.gateway:
            if index < len(self.gateway_urls):  # restart: same port
                http_port = int(self.gateway_urls[index].rpartition(":")[2])
            else:
                http_port = (self.gateway_port if index == 0 else 0) or free_port()
            args += ["--http-port", str(http_port)]
            if self.tls:  # loopback: the local gateway stays plain HTTP (README: Security)
                args.append("--http-plain")
            url = f"http://127.0.0.1:{http_port}"
        proc = self._spawn(f"orchestrator-{index}", args)
        address = f"127.0.0.1:{port}"
        # An orchestrator reports SERVING only once its gateway, if any, serves too.
        tls = self.credentials()
        _wait(lambda: _serving(address, tls), 30, f"orchestrator {address}", [proc])
        if index < len(self.orchestrator_addresses):
            self.orchestrator_addresses[index] = address
        else:
            self.orchestrator_addresses.append(address)
        if url and index < len(self.gateway_urls):
            self.gateway_urls[index] = url
        elif url:
            self.gateway_urls.append(url)
        return address

    def stop(self) -> None:
        """Stop every process, in phases: the orchestrators first (each drains its clients'
        streams within its grace, while the workers still serve them), then the workers,
        then Redis (which every other process uses until it stops)."""
        for name in sorted(self.procs, key=_stop_phase):
            self.procs[name].stop()
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)
            _STOPPED.append((time.time(), self))

    def owns(self, address: str) -> bool:
        """Whether ``address`` is one of this cluster's orchestrators or workers (simulated
        ones included: found by their heartbeats)."""
        if address in self.orchestrator_addresses or address in self.expected.values():
            return True
        return address in self.worker_addresses()

    def worker_addresses(self) -> set[str]:
        """The gRPC addresses of the workers with a live heartbeat in Redis."""
        try:
            with contextlib.closing(self._redis(2.0)) as client:
                ids = sorted(str(i) for i in client.smembers(_KEYS.workers))
                values = [client.get(_KEYS.worker(i)) for i in ids]  # one slot each: no MGET
        except (redis.RedisError, RedisClusterException):
            return set()
        return {str(json.loads(str(raw)).get("address")) for raw in values if raw is not None}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> Iterator[tuple[str, str]]:
        for name, proc in self.procs.items():
            yield name, proc.tail(4000)

    def problems(self, per_process: int = 40) -> str:
        """Each process's warnings and errors (its last ``per_process``, tracebacks
        included) and its last lines: what a failed test prints (tests/conftest.py)."""
        out = [f"cluster in {self.workdir}"]
        for name, proc in self.procs.items():
            if name == "redis":
                continue
            lines = proc.tail(1 << 20).splitlines()
            flagged = [line for line in lines if _PROBLEM.match(line) or _TRACE.match(line)]
            out.append(f"--- {name}: {len(flagged)} warning/error lines; the last shown")
            out += flagged[-per_process:]
            out.append(f"--- {name}: last lines")
            out += lines[-8:]
        return "\n".join(out)


def _stop_phase(name: str) -> int:
    """When `LocalCluster.stop` stops process ``name``: orchestrators, workers, Redis."""
    if name.startswith("orchestrator"):
        return 0
    return 2 if name == "redis" else 1


_LIVE: list[LocalCluster] = []
"""Clusters started in this process and not stopped: `connect` finds an address's owner."""

_PROBLEM = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) ")
"""A log line at WARNING or above (the format `orchestrator.cli` configures)."""
_TRACE = re.compile(r"^(Traceback |\S+(Error|Exception): )")


_STOPPED: collections.deque[tuple[float, LocalCluster]] = collections.deque(maxlen=4)
"""The clusters stopped last, with when (``time.time()``): a test's own ``with`` block
stops its cluster before the test's failure is reported."""


def clusters_since(started: float) -> list[LocalCluster]:
    """The clusters this process has running, and those it stopped at or after ``started``
    (``time.time()``)."""
    return [*_LIVE, *(c for at, c in _STOPPED if at >= started and c not in _LIVE)]


def connect(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to ``address``, a process of a local cluster this process started (with
    that cluster's credentials, `LocalCluster.channel`); plaintext to any other address.
    For tests and tools that hold an address, not the cluster."""
    for cluster in reversed(_LIVE):
        if cluster.owns(address):
            return cluster.channel(address, token)
    return client_channel(address, token)


def _serving(address: str, tls: Tls | None = None) -> bool:
    with (
        grpc.insecure_channel(address)
        if tls is None
        else grpc.secure_channel(
            address,
            tls.channel_credentials(),
            [("grpc.ssl_target_name_override", ORCHESTRATOR_SERVER_NAME)],
        )
    ) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _indexed(flags: list[str], index: int) -> list[str]:
    """Extra flags for the process of this index: ``{index}`` replaced by it."""
    return [flag.replace("{index}", str(index)) for flag in flags]
