"""`pdorch up`: bring a local cluster up and keep it — Redis, prefill and decode workers and
an orchestrator serving gRPC and the OpenAI-compatible gateway, as processes on loopback
(`orchestrator.cluster.LocalCluster`) — print every endpoint and what to run next, and
publish them in the state file (`orchestrator.cli.state`) so that `generate`, `cost`,
`status` and `down` find the cluster without flags. Stops on Ctrl-C, SIGTERM or `pdorch down`,
or when Redis or the orchestrator exits; a worker that exits is told and the rest serve on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.cli.common import (
    DEFAULT_ORCHESTRATOR,
    ENGINES,
    CommandError,
    Commands,
    Parents,
    add_command,
    check_engine,
    check_port_free,
    check_transport,
    non_negative_int,
    port,
    positive_int,
)
from orchestrator.cli.progress import Progress
from orchestrator.cli.state import (
    ORCHESTRATOR_PROC,
    ClusterState,
    leftovers,
    live_state,
    remove_state,
    stale_state,
    state_path,
    write_state,
)
from orchestrator.procs import started

if TYPE_CHECKING:
    from orchestrator.cluster import LocalCluster

NAME = "up"
HELP = "start a local cluster and keep it up (Ctrl-C or `pdorch down` stops it)"

DEFAULT_HTTP_PORT = 8000
"""The gateway's port, as `vllm serve` and most OpenAI-compatible servers use."""
HOST = "127.0.0.1"
"""Everything listens on loopback: this is a local cluster, not a deployment."""


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    u = add_command(
        sub,
        NAME,
        parents,
        parents.model,
        parents.model_cache,
        parents.transport,
        parents.json,
        help=HELP,
        description="Start Redis, prefill and decode workers and an orchestrator (gRPC + "
        "OpenAI-compatible HTTP) on this machine, print their addresses and commands to try, "
        f"and stay up until Ctrl-C, SIGTERM or `pdorch down`. The addresses are written to "
        f"{state_path(env)} ($PDORCH_STATE), where `pdorch generate`, `cost`, `status` and "
        "`down` find them.",
    )
    u.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help="the workers' engine (vllm: run from the vllm extra's environment, --model "
        "smollm2; default %(default)s)",
    )
    u.add_argument(
        "--prefill", type=non_negative_int, default=1, help="prefill workers (default %(default)s)"
    )
    u.add_argument(
        "--decode",
        type=positive_int,
        default=None,
        help="decode workers (default 2; 1 with --engine vllm: each vLLM engine holds its "
        "own block pool)",
    )
    u.add_argument(
        "--port",
        type=port,
        default=int(DEFAULT_ORCHESTRATOR.rpartition(":")[2]),
        help="the orchestrator's gRPC port (0: a free one; default %(default)s)",
    )
    u.add_argument(
        "--http-port",
        type=port,
        default=DEFAULT_HTTP_PORT,
        help="the OpenAI-compatible gateway's port (0: a free one; default %(default)s)",
    )
    u.add_argument("--redis-port", type=port, default=0, help="Redis's port (default: a free one)")
    u.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="the orchestrator's Prometheus /metrics port (default: a free one; the workers' "
        "always get free ones)",
    )
    u.add_argument(
        "--logs", default="", help="folder for the processes' logs (default: a new temp folder)"
    )
    u.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC, for debugging (default: TLS everywhere, from a throwaway CA "
        "made in the logs folder; `pdorch generate`/`status` find it)",
    )
    u.set_defaults(call=lambda args: run(args, env))


def preflight(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Refuse before anything starts: a `pdorch up` that runs, or any process a killed one
    left running (`leftovers`: serving, or killed while starting) — starting would
    overwrite the state file, the only place `pdorch down` finds them by — and flags this
    machine cannot serve."""
    running = live_state(env)
    if running is not None:
        where = running.orchestrator if running.ready else "still starting"
        raise CommandError(
            f"a `pdorch up` cluster is already running (pid {running.pid}, {where}); "
            "`pdorch down` stops it"
        )
    killed = stale_state(env)
    left = [] if killed is None else leftovers(killed)
    if killed is not None and left:  # its state file is what `pdorch down` stops it by
        if ORCHESTRATOR_PROC in left:
            pid = killed.procs[ORCHESTRATOR_PROC][0]
            what = f"orchestrator {killed.orchestrator}, pid {pid}"
        else:  # killed while starting, or its orchestrator gone: what is left, by name
            what = ", ".join(left)
        raise CommandError(
            f"the cluster of a killed `pdorch up` (pid {killed.pid}) still runs ({what}); "
            "run `pdorch down` first"
        )
    check_engine(args.engine, args.model)
    check_transport(args.transport)
    for flag in ("--port", "--http-port", "--redis-port", "--metrics-port"):
        check_port_free(HOST, getattr(args, flag[2:].replace("-", "_")), flag)
    taken = [p for p in (args.port, args.http_port, args.redis_port, args.metrics_port) if p]
    if len(taken) != len(set(taken)):
        raise CommandError("--port, --http-port, --redis-port and --metrics-port must differ")


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    preflight(args, env)
    from orchestrator.cluster import ClusterError, LocalCluster  # noqa: PLC0415 - grpc, redis
    from orchestrator.demo import serve_until_signalled  # noqa: PLC0415
    from orchestrator.ports import free_port  # noqa: PLC0415

    progress = Progress(quiet=args.json)
    decode = args.decode or (1 if args.engine == "vllm" else 2)
    gateway = _gateway_installed()
    metrics = {"orchestrator-0": args.metrics_port or free_port()}
    cluster = LocalCluster(
        model=args.model,
        transport=args.transport,
        engine=args.engine,
        prefill_workers=args.prefill,
        decode_workers=decode,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        redis_port=args.redis_port,
        gateway=gateway,
        gateway_port=args.http_port,
        orchestrator_extra=["--metrics-port", str(metrics["orchestrator-0"])],
        tls=not args.insecure,
    )
    if args.logs:
        cluster.workdir = Path(args.logs)
        try:
            cluster.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = f"not a folder this can write in: {exc}"
            raise CommandError(f"--logs {args.logs}: {why}") from None
    _interrupt_on_sigterm()
    publish = _Publisher(env, cluster, metrics, gateway)
    cluster.on_spawn = publish  # each process listed as it starts
    try:
        try:
            _start(cluster, progress, metrics, args.port or free_port())
        except ClusterError as exc:
            raise CommandError(start_failure(str(exc), cluster.workdir)) from exc
        state = publish(ready=True)
        path = state_path(env)
        if args.json:
            print(json.dumps({"state_file": str(path), **json.loads(state.to_json())}))
        else:
            print(endpoints_text(state, path, gateway), flush=True)
            progress.say("up; Ctrl-C, SIGTERM or `pdorch down` stops it")
        # A worker that exits leaves the cluster serving on the others (its requests fail
        # over); Redis or the orchestrator exiting stops it.
        if not serve_until_signalled(cluster, "pdorch up", "`pdorch down` stops the rest"):
            return 1
    finally:
        # Stopping is bounded (each process: SIGTERM, then SIGKILL after a grace); a second
        # Ctrl-C, `pdorch down` or a closed terminal must not interrupt it half way and leave
        # processes behind (they lead their own process groups: no signal reaches them).
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        with progress.step("stopping the cluster"):
            cluster.stop()
        remove_state(env, os.getpid())  # only now: killed while stopping, `down` finishes
    return 0


class _Publisher:
    """Writes the state file: as each process starts (``ready`` False: what `pdorch down`
    must stop should this `pdorch up` be killed while starting), then once it serves."""

    def __init__(
        self,
        env: Mapping[str, str],
        cluster: LocalCluster,
        metrics: Mapping[str, int],
        gateway: bool,
    ) -> None:
        self.env = env
        self.cluster = cluster
        self.metrics = metrics
        self.gateway = gateway

    def __call__(self, *, ready: bool = False) -> ClusterState:
        cluster = self.cluster
        state = ClusterState(
            pid=os.getpid(),
            orchestrator=cluster.orchestrator_addresses[0] if ready else "",
            redis=_without_password(cluster.redis_url) if ready else "",  # no secret
            http=f"{cluster.gateway_urls[0]}/v1" if ready and self.gateway else "",
            metrics={n: f"http://{HOST}:{p}/metrics" for n, p in self.metrics.items()},
            model=_served_model(cluster) if ready else "",
            logs=str(cluster.workdir),
            tls=str(cluster.tls_dir) if cluster.tls else "",
            procs={n: [p.popen.pid, started(p.popen.pid)] for n, p in cluster.procs.items()},
            ready=ready,
        )
        write_state(self.env, state)
        return state


def _start(
    cluster: LocalCluster,
    progress: Progress,
    metrics: dict[str, int],
    grpc_port: int,
) -> None:
    """Start the processes step by step, each timed on stderr (and published in the state
    file as it starts: `LocalCluster.on_spawn`); on any failure stop them and raise
    `ClusterError` with the failing process's last log lines."""
    from orchestrator.ports import free_port  # noqa: PLC0415

    try:
        with progress.step(f"Redis (logs in {cluster.workdir})"):
            cluster.start_redis()
        _check_interrupted()
        workers = cluster.prefill_workers + cluster.decode_workers
        what = (
            f"{cluster.prefill_workers} prefill + {cluster.decode_workers} decode workers "
            f"loading {cluster.model} on {cluster.engine} (KV over {cluster.transport})"
        )

        def registered() -> str:
            return f"{sum(cluster.registered().values())}/{workers} registered"

        with progress.step(what, registered):
            for role, count in (
                ("prefill", cluster.prefill_workers),
                ("decode", cluster.decode_workers),
            ):
                for i in range(count):
                    metrics[f"{role}-{i}"] = free_port()
                    cluster.start_worker(role, i, "--metrics-port", str(metrics[f"{role}-{i}"]))
            cluster.wait_workers(cluster.prefill_workers, cluster.decode_workers)
        _check_interrupted()
        with progress.step("orchestrator"):
            cluster.start_orchestrator(0, grpc_port)
        _check_interrupted()
    except BaseException:
        cluster.stop()
        raise


def start_failure(message: str, logs: Path) -> str:
    """One line for a process that died or never became ready while the cluster started:
    `ClusterError` carries the tail of the process's log; its last line says why."""
    head, _, tail = message.partition(": ")
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    why = f": {lines[-1][:300]}" if lines else (f": {tail}" if tail else "")
    return f"{head}{why} (every process's log: {logs})"


_interrupted = threading.Event()
"""Set by SIGTERM during start-up. The handler also raises, but an exception raised while a
finalizer runs (a Redis client's ``ConnectionPool.__del__`` in a readiness poll) is printed
and dropped by Python ("Exception ignored in …"), so `_check_interrupted` looks again
between steps: a SIGTERM is never lost, at worst acted on one step later."""


def _interrupt_on_sigterm() -> None:
    """SIGTERM (`pdorch down`) during start-up acts as Ctrl-C: the start is abandoned and
    the processes stopped. (`serve_until_signalled` handles both signals once it is up.)"""
    _interrupted.clear()

    def interrupted(signum: int, frame: object) -> None:
        _interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)


def _check_interrupted() -> None:
    if _interrupted.is_set():
        raise KeyboardInterrupt


def _gateway_installed() -> bool:
    """The OpenAI-compatible gateway needs the gateway extra (not in the vllm environment)."""
    return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn"))


def _served_model(cluster: LocalCluster) -> str:
    import redis  # noqa: PLC0415

    from orchestrator.store.keys import Keys  # noqa: PLC0415

    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        raw = client.get(Keys().worker("decode-0"))
    finally:
        client.close()
    return str(json.loads(raw)["model"]) if raw else cluster.model


def endpoints_text(state: ClusterState, path: Path, gateway: bool) -> str:
    """The block `pdorch up` prints once the cluster serves: endpoints, then commands."""
    lines = [
        "",
        f"  gRPC (pdorch generate)   {state.orchestrator}",
        f"  OpenAI HTTP              {state.http or '- (needs the gateway extra)'}",
        f"  Redis                    {state.redis}",
    ]
    lines += [f"  metrics {name:17s}{url}" for name, url in state.metrics.items()]
    lines += [f"  TLS (CA, certificates)   {state.tls or '- (--insecure: plaintext)'}"]
    lines += [f"  logs                     {state.logs}", f"  state file               {path}", ""]
    chat = "--chat " if state.model != "tiny" else ""  # an instruct model: its template
    lines += ["Try:", f"  pdorch generate {chat}'What is the capital of France?'"]
    if gateway:
        body = json.dumps(
            {"model": state.model, "messages": [{"role": "user", "content": "Hello!"}]}
        )
        lines.append(
            f"  curl -s {state.http}/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}"
        )
        lines.append(
            f"  OPENAI_BASE_URL={state.http} OPENAI_API_KEY=none "
            'python -c "import openai; print(openai.OpenAI().chat.completions.create('
            f"model='{state.model}', temperature=0, "
            "messages=[{'role': 'user', 'content': 'List three prime numbers.'}])"
            '.choices[0].message.content)"'
        )
    lines += ["  pdorch status", "  pdorch cost", "  pdorch down", ""]
    return "\n".join(lines)


def _without_password(url: str) -> str:
    from orchestrator.store.url import without_password  # noqa: PLC0415 - keeps `plan` light

    return without_password(url)
