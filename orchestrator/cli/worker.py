"""`pdorch worker`: a prefill or decode worker serving a real model, or ``--sim`` workers
(timings from the performance model, no model loaded), heartbeating into Redis.

Its flags fill `WorkerSettings` and `TransportSettings`; their defaults are those dataclasses'
field defaults. A flag left at 0 (``--kv-capacity-mib``, ``--max-batch``) is not passed on, so
the settings' default (or the simulated GPU's) applies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import event_loop
from orchestrator.cli.common import (
    ENGINES,
    CommandError,
    Commands,
    Parents,
    add_command,
    add_transport_flag,
    check_engine,
    check_port_free,
    check_redis,
    check_transport,
    default,
    field_doc,
    gpu_kind,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    serve_metrics,
    server_tls_dir,
    until_signalled,
)
from transport.backend_names import DEFAULT, TCP, Backend

if TYPE_CHECKING:
    from orchestrator.api.tls import Tls
    from orchestrator.workers.engine import Engine
    from orchestrator.workers.host import EngineHost
    from orchestrator.workers.metrics import WorkerMetrics
    from orchestrator.workers.server import WorkerSettings
    from transport.security import LinkTls

log = logging.getLogger("pdorch")

SIM_MAX_BATCH = 256
"""Decode batch of a simulated worker: a GPU's continuous batch, where the reference engine's
CPU batch is `WorkerSettings.max_batch`."""


VLLM_KV_MIB = 1024
"""vLLM's block pool when ``--kv-capacity-mib`` is not given (the CPU backend allocates it up
front, so it is smaller than the reference engine's budget, which is only a limit)."""

SIM_TRANSPORT: Backend = TCP
"""Simulated workers' KV transport unless ``--transport`` names one: their KV is a few
scaled-down bytes, and TCP needs no ``ucx`` extra and starts no UCX context or progress
thread. (On UCX, a ``--count`` fleet's members share their process's one UCX context.)"""

NAME = "worker"
HELP = "run a prefill or decode worker"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    from orchestrator.workers.server import WorkerSettings  # noqa: PLC0415 - imports grpc
    from transport.base import TransportSettings  # noqa: PLC0415

    w = add_command(
        sub,
        NAME,
        parents,
        parents.redis,
        parents.model,
        parents.model_cache,
        parents.tls,
        help=HELP,
    )
    event_loop.add_loop_flag(w, event_loop.WORKER_LOOP, event_loop.WORKER_LOOP_NOTE)
    add_transport_flag(w, None, f"{DEFAULT}; with --sim, {SIM_TRANSPORT}")
    w.add_argument(
        "--role",
        choices=("prefill", "decode"),
        required=True,
        help="prefill: computes prompts' KV and sends it; decode: receives KV and streams tokens",
    )
    w.add_argument(
        "--host", default=default(WorkerSettings, "host"), help="listen address (%(default)s)"
    )
    w.add_argument(
        "--port",
        type=port,
        default=default(WorkerSettings, "port"),
        help="gRPC listener (0: a free port; default %(default)s)",
    )
    w.add_argument(
        "--kv-port",
        type=port,
        default=default(WorkerSettings, "kv_port"),
        help="KV receiver (0: a free port; default %(default)s)",
    )
    w.add_argument(
        "--worker-id",
        default=default(WorkerSettings, "worker_id"),
        help="its name in Redis and in logs (default: %(default)s)",
    )
    kv_mib = default(WorkerSettings, "kv_capacity_bytes") >> 20
    w.add_argument(
        "--kv-capacity-mib",
        type=non_negative_int,
        default=0,
        help=f"KV budget (default {kv_mib}; simulated: the GPU's memory beside the weights)",
    )
    w.add_argument(
        "--heartbeat-ttl",
        type=positive_float,
        default=default(WorkerSettings, "heartbeat_ttl_s"),
        help=field_doc(WorkerSettings, "heartbeat_ttl_s") + " It beats 3 times as often.",
    )
    w.add_argument(
        "--kv-hold",
        type=positive_float,
        default=default(TransportSettings, "kv_hold_s"),
        help=field_doc(TransportSettings, "kv_hold_s"),
    )
    w.add_argument(
        "--kv-finite-check",
        action=argparse.BooleanOptionalAction,
        default=default(TransportSettings, "check_finite"),
        help=field_doc(TransportSettings, "check_finite"),
    )
    w.add_argument(
        "--torch-threads",
        type=non_negative_int,
        default=0,
        help="CPU threads for the engine (0: torch's)",
    )
    w.add_argument(
        "--gpu-kind",
        type=gpu_kind,
        default=env.get("PDORCH_GPU_KIND", default(WorkerSettings, "gpu_kind")),
        help="the accelerator this worker runs on, priced by the orchestrators: H100, L4, "
        "... (default: $PDORCH_GPU_KIND, else %(default)s)",
    )
    w.add_argument("--metrics-port", type=port, default=0, help="Prometheus /metrics (0: off)")
    w.add_argument(
        "--advertise",
        default=default(WorkerSettings, "advertise"),
        help=field_doc(WorkerSettings, "advertise"),
    )
    w.add_argument(
        "--kv-advertise",
        default=default(WorkerSettings, "kv_advertise"),
        help=field_doc(WorkerSettings, "kv_advertise"),
    )
    _fault_flags(w)
    w.add_argument(
        "--sim",
        type=_sim_spec,
        default="",
        metavar="MODEL@GPU",
        help="simulated worker: no model, timings from the performance model, e.g. "
        "llama-3-8b@H100 or llama-3-70b@H100x4 (TCP transport; see README 'Scale')",
    )
    w.add_argument(
        "--sim-prefix-cache",
        action="store_true",
        help="with --sim: simulate vLLM's prefix cache (prefills charged for uncached "
        "tokens only; the cache reported for KV-aware routing)",
    )
    w.add_argument(
        "--count",
        type=positive_int,
        default=1,
        help="with --sim: this many workers in this process (ids <worker-id>-0..N-1)",
    )
    w.add_argument(
        "--max-batch",
        type=non_negative_int,
        default=0,
        help=f"decode batch ({default(WorkerSettings, 'max_batch')}; simulated: {SIM_MAX_BATCH})",
    )
    w.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help="reference: pdorch's transformers engine; vllm: vLLM's async engine (the vllm "
        "extra's environment; --model smollm2; --kv-capacity-mib sizes its block pool, "
        f"default {VLLM_KV_MIB})",
    )
    w.add_argument("--profile", default="", help="write a cProfile of this process to PATH")
    w.set_defaults(run=run)


def _fault_flags(w: argparse.ArgumentParser) -> None:
    w.add_argument(
        "--kv-fault",
        type=_fault_spec,
        default="",
        help="fault injection on outgoing KV, e.g. 'layer=1,corrupt=99,p=0.5,armed=0' "
        "(keys: layer corrupt stall delay p seed armed); SIGUSR1 arms it, SIGUSR2 disarms",
    )
    w.add_argument(
        "--kv-fault-file",
        default="",
        help="fault injection: SIGUSR1 reads the fault spec from this file and arms it",
    )
    w.add_argument(
        "--inject-kv-stall",
        type=float,
        default=0.0,
        help="fault injection: stall this many seconds in the middle of every KV send",
    )


def _sim_spec(text: str) -> str:
    from orchestrator.errors import ConfigError  # noqa: PLC0415
    from orchestrator.workers.sim_engine import SimSpec  # noqa: PLC0415

    if not text:  # the default: a real engine
        return text
    try:
        SimSpec.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _fault_spec(text: str) -> str:
    from transport.testing import FaultInjector  # noqa: PLC0415

    try:
        FaultInjector.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def worker_settings(args: argparse.Namespace, **chosen: Any) -> WorkerSettings:
    """The worker's settings from its flags. ``chosen``: fields this kind of worker sets
    (a simulated GPU's KV room and batch), overridden by ``--kv-capacity-mib`` and
    ``--max-batch`` when given; what neither sets keeps the dataclass's default."""
    from orchestrator.workers.server import WorkerSettings  # noqa: PLC0415

    if args.kv_capacity_mib:
        chosen["kv_capacity_bytes"] = args.kv_capacity_mib << 20
    if args.max_batch:
        chosen["max_batch"] = args.max_batch
    return WorkerSettings(
        role=args.role,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        worker_id=args.worker_id,
        heartbeat_ttl_s=args.heartbeat_ttl,
        heartbeat_interval_s=args.heartbeat_ttl / 3,
        **chosen,
    )


def preflight(args: argparse.Namespace) -> None:
    """What can be checked before anything starts: flags that go together, Redis answers,
    the ports are free."""
    check_engine(args.engine, args.model)
    check_transport(transport(args))
    if args.count != 1 and not args.sim:
        raise CommandError("--count needs --sim")
    if args.sim_prefix_cache and not args.sim:
        raise CommandError("--sim-prefix-cache needs --sim")
    check_redis(args.redis)
    if args.count == 1:  # a fleet's members take the ports after these
        check_port_free(args.host, args.port, "--port")
        check_port_free(args.host, args.kv_port, "--kv-port")
    check_port_free(args.host, args.metrics_port, "--metrics-port")


def transport(args: argparse.Namespace) -> str:
    """The backend ``--transport`` names, else the default (`SIM_TRANSPORT` for --sim)."""
    if args.transport is not None:
        return str(args.transport)
    return SIM_TRANSPORT if args.sim else DEFAULT


async def run(args: argparse.Namespace) -> int:
    preflight(args)
    tls = _tls(args)  # before the model loads: a bad --tls-dir fails at once
    if args.sim:
        return await _run_sim_workers(args, tls)
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.workers.host import EngineHost  # noqa: PLC0415
    from orchestrator.workers.metrics import WorkerMetrics  # noqa: PLC0415
    from orchestrator.workers.model_files import load_engine  # noqa: PLC0415
    from orchestrator.workers.server import Worker  # noqa: PLC0415
    from transport.backends import make_receiver, make_sender  # noqa: PLC0415
    from transport.base import TransportSettings  # noqa: PLC0415

    if args.torch_threads > 0:
        import torch  # noqa: PLC0415 - only workers need torch

        torch.set_num_threads(args.torch_threads)
    metrics = WorkerMetrics()
    engine: Engine | EngineHost
    if args.engine == "vllm":  # hosts vLLM, which moves KV through its own connector
        engine = _vllm_host(args, metrics, tls)
    else:
        engine = await asyncio.to_thread(
            load_engine, args.model, Path(args.model_cache) if args.model_cache else None
        )
    hosted = isinstance(engine, EngineHost)
    store = RedisStore(StoreSettings(url=args.redis))
    tsettings = TransportSettings(kv_hold_s=args.kv_hold, check_finite=args.kv_finite_check)
    settings = worker_settings(
        args, advertise=args.advertise, kv_advertise=args.kv_advertise, gpu_kind=args.gpu_kind
    )
    kv_tls = _kv_tls(tls)
    backend = transport(args)
    sender = None if hosted else make_sender(backend, tsettings, tls=kv_tls)
    if sender is not None and (args.inject_kv_stall > 0 or args.kv_fault or args.kv_fault_file):
        _attach_kv_fault(sender, args)  # chaos/testing only
    receiver = (
        make_receiver(backend, tsettings, engine.info.model_spec(), tls=kv_tls)
        if args.role == "decode" and not hosted
        else None
    )

    async def publish(info: object) -> None:
        await store.heartbeat(info, settings.heartbeat_ttl_s)  # type: ignore[arg-type]

    worker = Worker(
        engine,
        settings,
        publish,
        sender=sender,
        receiver=receiver,
        metrics=metrics,
        tls=tls,
    )
    metrics.watch(worker.kv_used, worker.active_sequences)
    metrics_server = serve_metrics(metrics.registry, args.host, args.metrics_port)
    await worker.start()
    print(
        f"worker {worker.worker_id} ready on {worker.address} kv={worker.kv_address} "
        f"(event loop {event_loop.running()})",
        flush=True,
    )
    try:
        await until_signalled()
    finally:
        log.info("worker %s draining", worker.worker_id)
        if metrics_server is not None:
            metrics_server.shutdown()
        with contextlib.suppress(Exception):
            await store.deregister(worker.worker_id)
        await worker.stop()
        await store.close()
    return 0


def _tls(args: argparse.Namespace) -> Tls | None:
    """The worker's credentials (`api.tls.load_worker`), or None (plaintext) after one loud
    warning."""
    from orchestrator.api.tls import load_worker  # noqa: PLC0415

    directory = server_tls_dir(args, "the worker's gRPC API")
    return load_worker(directory, args.role) if directory else None


def _kv_tls(tls: Tls | None) -> LinkTls | None:
    """The KV link's mutual TLS, from the same directory and identity as the gRPC API's
    (`transport.security.load_dir`): a decode worker takes KV only from prefill identities,
    a prefill worker sends only to decode ones. None (plaintext) when the API is plaintext."""
    if tls is None:
        return None
    from transport.security import load_dir  # noqa: PLC0415

    return load_dir(Path(tls.files.directory), tls.identity)


def _vllm_host(args: argparse.Namespace, metrics: WorkerMetrics, tls: Tls | None) -> EngineHost:
    """``--engine vllm``: vLLM's async engine, hosted in this process (the vllm extra),
    serving SmolLM2 (``--model smollm2``, the one it takes) under the name the reference
    engine gives it (`SMOLLM2_NAME`): a client names the same model on either engine."""
    from orchestrator.core.models import SMOLLM2_NAME  # noqa: PLC0415
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415
    from orchestrator.workers.vllm.cpu import reserved_cpus_env  # noqa: PLC0415
    from orchestrator.workers.vllm.engine import VllmHost, VllmSettings  # noqa: PLC0415

    for key, value in reserved_cpus_env().items():  # read by vLLM's engine core, a child
        os.environ.setdefault(key, value)
    model_dir = ensure_smollm2(Path(args.model_cache) if args.model_cache else None)
    settings = VllmSettings(
        model_dir=model_dir,
        name=SMOLLM2_NAME,
        role=args.role,
        kv_cache_bytes=(args.kv_capacity_mib or VLLM_KV_MIB) << 20,
        transport=transport(args),
        kv_hold_s=args.kv_hold,
        tls_dir=str(tls.files.directory) if tls else "",
        tls_identity=tls.identity if tls else "",
    )
    return VllmHost(settings, metrics)


async def _run_sim_workers(args: argparse.Namespace, tls: Tls | None) -> int:
    """``--count`` simulated workers in this process (`orchestrator.workers.fleet`)."""
    from orchestrator.store.connect import parse as parse_redis_url  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.workers.fleet import SharedSender, WorkerFleet, member_settings  # noqa: PLC0415
    from orchestrator.workers.server import Worker  # noqa: PLC0415
    from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec  # noqa: PLC0415
    from transport.backends import make_data_plane, make_receiver  # noqa: PLC0415
    from transport.base import TransportSettings  # noqa: PLC0415

    spec = SimSpec.parse(args.sim)  # validated by the parser already
    cached = args.sim_prefix_cache
    # One engine for all when stateless; a prefix cache is per worker.
    engines = [SimEngine(spec, prefix_cache=cached) for _ in range(args.count if cached else 1)]
    engine = engines[0]
    # Heartbeats only: a few connections, not one per worker beating at the same moment —
    # on one server, whose pool waits for a free connection. A Redis Cluster node's pool
    # fails a call that finds them all busy (`orchestrator.store.connect`), and all the
    # workers' first heartbeats go out together: one connection each, so none fails.
    connections = args.count if parse_redis_url(args.redis).kind == "cluster" else 8
    store = RedisStore(StoreSettings(url=args.redis, max_connections=max(8, connections)))
    tsettings = TransportSettings(kv_hold_s=args.kv_hold, check_finite=args.kv_finite_check)
    base = worker_settings(
        args,
        kv_capacity_bytes=spec.kv_capacity_bytes,
        max_batch=SIM_MAX_BATCH,
        gpu_kind=spec.gpu.name,
    )

    async def publish(info: object) -> None:
        await store.heartbeat(info, base.heartbeat_ttl_s)  # type: ignore[arg-type]

    count = args.count
    prefill = args.role == "prefill"
    kv_tls = _kv_tls(tls)
    backend = transport(args)
    sender = (
        SharedSender(make_data_plane(backend), tsettings, users=count, tls=kv_tls)
        if prefill
        else None
    )
    workers = [
        Worker(
            engines[i % len(engines)],
            member_settings(base, i, count),
            publish,
            sender=sender,
            receiver=(
                None
                if prefill
                else make_receiver(backend, tsettings, engine.info.model_spec(), tls=kv_tls)
            ),
            runner=SimRunner(engines[i % len(engines)]),
            tls=tls,
        )
        for i in range(count)
    ]
    fleet = WorkerFleet(workers)
    try:
        await fleet.start()  # stops what started if one fails
    except BaseException:
        await store.close()
        raise
    for w in workers:
        print(
            f"worker {w.worker_id} ready on {w.address} kv={w.kv_address} "
            f"(event loop {event_loop.running()})",
            flush=True,
        )
    try:
        await until_signalled()
    finally:
        log.info("%d simulated workers draining", count)
        for w in workers:
            with contextlib.suppress(Exception):
                await store.deregister(w.worker_id)
        await fleet.stop()
        await store.close()
    return 0


def _attach_kv_fault(sender: object, args: argparse.Namespace) -> None:
    """Fault injection on outgoing KV: SIGUSR1 arms it — re-reading ``--kv-fault-file`` when
    given (the whole set of KV faults active now), so a chaos run can change the faults
    without restarting the worker — SIGUSR2 disarms it. A worker started with a fault file
    reads it at once (a restarted worker gets the faults still active). A layer held at the
    injector's gate is announced in ``<fault file>.held.<worker id>`` (its wall-clock time),
    which the chaos runner watches for phase triggers."""
    from transport.testing import FaultInjector  # noqa: PLC0415

    def read_file() -> FaultInjector | None:
        try:
            return FaultInjector.parse(Path(args.kv_fault_file).read_text().strip())
        except (OSError, ValueError) as exc:
            log.warning("kv fault file %s: %s", args.kv_fault_file, exc)
            return None

    if args.kv_fault:
        injector = FaultInjector.parse(args.kv_fault)  # validated by the parser already
    elif args.kv_fault_file:
        injector = FaultInjector(armed=False)
        if Path(args.kv_fault_file).exists() and (first := read_file()) is not None:
            injector.configure(first)
            injector.armed = first.armed
    else:  # stall while sending layer 1 of every KV
        injector = FaultInjector(layer=1, delay_s=args.inject_kv_stall)
    if args.kv_fault_file:
        marker = Path(f"{args.kv_fault_file}.held.{args.worker_id}")

        def held(index: int) -> None:
            with contextlib.suppress(OSError):
                marker.write_text(f"{time.time()} {index}")

        injector.on_hold = held
    injector.attach(sender)  # type: ignore[arg-type]

    def arm() -> None:
        if args.kv_fault_file:
            spec = read_file()
            if spec is None:
                return
            injector.configure(spec)
        injector.armed = True

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, arm)
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(injector, "armed", False))
