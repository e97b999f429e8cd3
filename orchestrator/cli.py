"""`pdorch` command line: the composition root.

The only module that reads the environment and picks concrete parts (the Redis store, the
UCX or TCP transport, the engine) and wires them together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.control.orchestrator import Orchestrator
    from orchestrator.gateway.server import HttpServer

log = logging.getLogger("pdorch")


# ------------------------------------------------------------------------------ servers


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _run_worker(args: argparse.Namespace) -> int:
    if args.sim:
        return await _run_sim_workers(args)
    if args.count != 1:
        print("pdorch worker: --count needs --sim", file=sys.stderr)
        return 2
    from orchestrator.workers.metrics import WorkerMetrics  # noqa: PLC0415
    from orchestrator.workers.model_files import load_engine  # noqa: PLC0415

    if args.torch_threads > 0:
        import torch  # noqa: PLC0415 - only workers need torch

        torch.set_num_threads(args.torch_threads)
    metrics = WorkerMetrics()
    if args.engine == "vllm":
        return await _run_worker_with(args, _vllm_host(args, metrics), metrics)
    engine = await asyncio.to_thread(
        load_engine, args.model, Path(args.model_cache) if args.model_cache else None
    )
    return await _run_worker_with(args, engine, metrics)


def _vllm_host(args: argparse.Namespace, metrics: Any) -> Any:
    """``--engine vllm``: vLLM's async engine hosted in this process (the ``vllm`` extra)."""
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415
    from orchestrator.workers.vllm.engine import VllmHost, VllmSettings  # noqa: PLC0415

    if args.model != "smollm2":
        raise SystemExit("pdorch worker --engine vllm: only --model smollm2")
    model_dir = ensure_smollm2(Path(args.model_cache) if args.model_cache else None)
    return VllmHost(
        VllmSettings(
            model_dir=model_dir,
            name=args.model,
            role=args.role,
            kv_cache_bytes=(args.kv_capacity_mib or 1024) << 20,
            transport=args.transport,
            kv_hold_s=args.kv_hold,
        ),
        metrics,
    )


async def _run_worker_with(args: argparse.Namespace, engine: Any, metrics: Any) -> int:
    """Serve ``engine`` (an `Engine`, or an `EngineHost` that moves KV itself) until
    signalled, then drain."""
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.workers.host import EngineHost  # noqa: PLC0415
    from orchestrator.workers.server import Worker, WorkerSettings  # noqa: PLC0415
    from transport.backends import make_receiver, make_sender  # noqa: PLC0415
    from transport.base import TransportSettings  # noqa: PLC0415

    store = RedisStore(StoreSettings(url=args.redis))
    tsettings = TransportSettings(kv_hold_s=args.kv_hold)
    settings = WorkerSettings(
        role=args.role,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        worker_id=args.worker_id,
        kv_capacity_bytes=(args.kv_capacity_mib or 2048) << 20,
        heartbeat_ttl_s=args.heartbeat_ttl,
        heartbeat_interval_s=args.heartbeat_ttl / 3,
        max_batch=args.max_batch or 16,
        advertise=args.advertise,
        kv_advertise=args.kv_advertise,
        gpu_kind=args.gpu_kind,
    )
    hosted = isinstance(engine, EngineHost)
    sender = None if hosted else make_sender(args.transport, tsettings)
    if sender is not None and (args.inject_kv_stall > 0 or args.kv_fault or args.kv_fault_file):
        _attach_kv_fault(sender, args)  # chaos/testing only
    receiver = (
        make_receiver(args.transport, tsettings, engine.info.model_spec())
        if args.role == "decode" and not hosted
        else None
    )

    async def publish(info: object) -> None:
        await store.heartbeat(info, settings.heartbeat_ttl_s)  # type: ignore[arg-type]

    worker = Worker(engine, settings, publish, sender=sender, receiver=receiver, metrics=metrics)
    metrics.watch(worker.kv_used, worker.active_sequences)
    metrics_server = _serve_metrics(metrics.registry, args.host, args.metrics_port)
    await worker.start()
    print(f"worker {worker.worker_id} ready on {worker.address} kv={worker.kv_address}", flush=True)
    try:
        await _until_signalled()
    finally:
        log.info("worker %s draining", worker.worker_id)
        if metrics_server is not None:
            metrics_server.shutdown()
        with contextlib.suppress(Exception):
            await store.deregister(worker.worker_id)
        await worker.stop()
        await store.close()
    return 0


async def _run_sim_workers(args: argparse.Namespace) -> int:
    """``--count`` simulated workers in this process (`orchestrator.workers.fleet`)."""
    from orchestrator.errors import ConfigError  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.workers.fleet import SharedSender, WorkerFleet, member_settings  # noqa: PLC0415
    from orchestrator.workers.server import Worker, WorkerSettings  # noqa: PLC0415
    from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec  # noqa: PLC0415
    from transport.base import TransportSettings  # noqa: PLC0415
    from transport.tcp import TcpDataPlane, tcp_receiver  # noqa: PLC0415

    try:
        spec = SimSpec.parse(args.sim)
    except ConfigError as exc:
        print(f"pdorch worker: --sim: {exc}", file=sys.stderr)
        return 2
    engine = SimEngine(spec)
    # Heartbeats only: a few connections, not one per worker beating at the same moment.
    store = RedisStore(StoreSettings(url=args.redis, max_connections=8))
    tsettings = TransportSettings(kv_hold_s=args.kv_hold)
    base = WorkerSettings(
        role=args.role,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        worker_id=args.worker_id,
        kv_capacity_bytes=(
            args.kv_capacity_mib << 20 if args.kv_capacity_mib else spec.kv_capacity_bytes
        ),
        heartbeat_ttl_s=args.heartbeat_ttl,
        heartbeat_interval_s=args.heartbeat_ttl / 3,
        max_batch=args.max_batch or 256,
        gpu_kind=spec.gpu.name,
    )

    async def publish(info: object) -> None:
        await store.heartbeat(info, base.heartbeat_ttl_s)  # type: ignore[arg-type]

    count = args.count
    prefill = args.role == "prefill"
    sender = SharedSender(TcpDataPlane(), tsettings, users=count) if prefill else None
    workers = [
        Worker(
            engine,
            member_settings(base, i, count),
            publish,
            sender=sender,
            receiver=(None if prefill else tcp_receiver(tsettings, engine.info.model_spec())),
            runner=SimRunner(engine),
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
        print(f"worker {w.worker_id} ready on {w.address} kv={w.kv_address}", flush=True)
    try:
        await _until_signalled()
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
    given, so a chaos run can change the fault without restarting the worker — SIGUSR2
    disarms it."""
    from transport.testing import FaultInjector  # noqa: PLC0415

    if args.kv_fault:
        injector = FaultInjector.parse(args.kv_fault)  # validated by the parser already
    elif args.kv_fault_file:
        injector = FaultInjector(armed=False)
    else:  # stall while sending layer 1 of every KV
        injector = FaultInjector(layer=1, delay_s=args.inject_kv_stall)
    injector.attach(sender)  # type: ignore[arg-type]

    def arm() -> None:
        if args.kv_fault_file:
            try:
                spec = FaultInjector.parse(Path(args.kv_fault_file).read_text().strip())
            except (OSError, ValueError) as exc:
                log.warning("kv fault file %s: %s", args.kv_fault_file, exc)
                return
            injector.configure(spec)
        injector.armed = True

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, arm)
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(injector, "armed", False))


_ORCHESTRATOR_SERVER_OPTIONS = (
    # gRPC core holds calls the event loop has not picked up yet; by default it cancels one
    # that waited 30 s and refuses beyond 1,000 waiting. A replica saturated by a burst
    # (2,000 concurrent clients at 200 workers here) then cancels calls it would have
    # served; admission (`--max-inflight`, `--max-queue`, the TTFT SLO) is where load is
    # refused, with a reason and a retry-after.
    ("grpc.server_max_unrequested_time_in_server", 600),
    ("grpc.server.max_pending_requests", 65536),
)


async def _run_orchestrator(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import _async as health_aio  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    from orchestrator.api import orchestrator_pb2_grpc  # noqa: PLC0415
    from orchestrator.control.clients import WorkerClients  # noqa: PLC0415
    from orchestrator.control.metrics import ControlMetrics  # noqa: PLC0415
    from orchestrator.control.orchestrator import ControlSettings, Orchestrator  # noqa: PLC0415
    from orchestrator.core.admission import (  # noqa: PLC0415
        AdmissionPolicy,
        parse_aggregate_below,
        parse_tenant_limits,
    )
    from orchestrator.core.hardware import PRICED_KINDS, with_prices  # noqa: PLC0415
    from orchestrator.core.kvdtype import KvPolicy  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415
    from orchestrator.rpc.service import OrchestratorService  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415

    try:
        prices = with_prices(PRICED_KINDS, dict(args.price))
        admission = AdmissionPolicy(
            ttft_slo_s=args.ttft_slo_ms / 1000,
            max_queue=args.max_queue,
            max_inflight=args.max_inflight,
            tenant_limits=parse_tenant_limits(args.tenant_limit),
            default_tenant_limit=args.default_tenant_limit,
            aggregate_below=parse_aggregate_below(args.aggregate_below),
        )
    except ConfigError as exc:
        print(f"pdorch orchestrator: {exc}", file=sys.stderr)
        return 2
    store = RedisStore(StoreSettings(url=args.redis))
    clients = WorkerClients()
    settings = ControlSettings(
        fallback=args.fallback,
        detach_grace_s=args.detach_grace,
        prices=prices,
        transfer_usd_per_gb=args.transfer_usd_per_gb,
        kv_dtype=KvPolicy(args.kv_dtype),
        admission=admission,
    )
    metrics = ControlMetrics()
    control = Orchestrator(store, clients, settings, owner=args.replica_id, metrics=metrics)
    metrics_server = _serve_metrics(metrics.registry, args.host, args.metrics_port)
    server = grpc.aio.server(options=_ORCHESTRATOR_SERVER_OPTIONS)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(OrchestratorService(control), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    http = _gateway(args, control) if args.http_port is not None else None
    await server.start()
    await control.start()
    try:
        if http is not None:
            await http.start()  # before SERVING: a ready orchestrator serves both
            print(f"gateway {args.replica_id} ready on {http.url}/v1", flush=True)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        print(f"orchestrator {args.replica_id} ready on {args.host}:{port}", flush=True)
        await _until_signalled()
    finally:
        await health.enter_graceful_shutdown()
        # Both fronts stop accepting and drain their streams side by side.
        stopping = [server.stop(args.drain_grace)]
        if http is not None:
            stopping.append(http.stop())
        await asyncio.gather(*stopping)
        await control.stop()
        await clients.close()
        await store.close()
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


def _serve_metrics(registry: object, host: str, port: int) -> Any:
    """Prometheus ``/metrics`` on ``port`` (a daemon thread); None when port is 0."""
    if port <= 0:
        return None
    from prometheus_client import start_http_server  # noqa: PLC0415

    server, _thread = start_http_server(port, host, registry=registry)  # type: ignore[arg-type]
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server


def _gateway(args: argparse.Namespace, control: Orchestrator) -> HttpServer:
    """The OpenAI-compatible gateway over this process's orchestrator (the `gateway` extra)."""
    try:
        from orchestrator.gateway.app import Gateway  # noqa: PLC0415 - imports starlette
        from orchestrator.gateway.server import HttpServer  # noqa: PLC0415 - imports uvicorn
    except ImportError as exc:
        raise SystemExit(
            f"pdorch orchestrator --http-port needs the gateway extra "
            f"(pip install 'pdorch[gateway]'): {exc}"
        ) from exc
    from orchestrator.gateway.backend import OrchestratorBackend  # noqa: PLC0415
    from orchestrator.gateway.settings import GatewaySettings  # noqa: PLC0415

    app = Gateway(OrchestratorBackend(control), GatewaySettings(api_key=args.api_key)).app
    return HttpServer(app, args.http_host or args.host, args.http_port, args.drain_grace)


async def _run_operator(args: argparse.Namespace) -> int:
    from orchestrator.operator.config import OperatorConfig  # noqa: PLC0415
    from orchestrator.operator.runner import run_operator  # noqa: PLC0415 - imports kopf

    config = OperatorConfig(
        namespaces=tuple(args.namespace),
        resync_interval_s=args.resync_interval,
        server=args.server or None,
        liveness_endpoint=args.liveness or None,
    )
    await run_operator(config)
    return 0


# ------------------------------------------------------------------------------ clients


async def _generate(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415

    from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc  # noqa: PLC0415

    req = orchestrator_pb2.GenerateRequest(
        request_id=args.request_id,
        max_tokens=args.max_tokens,
        sampling=common_pb2.SamplingParams(temperature=args.temperature, seed=args.seed),
        stop=args.stop,
    )
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    async with grpc.aio.insecure_channel(args.orchestrator) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            async for chunk in stub.Generate(req, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    t = chunk.timings
                    print(
                        f"\n[{common_pb2.FinishReason.Name(chunk.finish_reason)}] "
                        f"ttft {t.ttft_ms:.0f} ms, tpot {t.tpot_ms:.1f} ms, "
                        f"kv {chunk.kv_bytes} bytes, {chunk.prefill_worker or '-'} -> "
                        f"{chunk.decode_worker}",
                        file=sys.stderr,
                    )
        except grpc.aio.AioRpcError as exc:
            print(f"\npdorch generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


async def _cost(args: argparse.Namespace) -> int:
    """Per-tenant totals of what finished requests cost (kept in Redis by the orchestrators)."""
    from orchestrator.errors import PdorchError  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415

    store = RedisStore(StoreSettings(url=args.redis))
    try:
        totals = await store.tenant_costs()
    except PdorchError as exc:
        print(f"pdorch cost: {exc}", file=sys.stderr)
        return 1
    finally:
        await store.close()
    if args.json:
        print(json.dumps(totals, sort_keys=True))
        return 0
    print(f"{'tenant':20s} {'requests':>9s} {'USD':>12s} {'USD/1k req':>11s} "
          f"{'prefill GPU-s':>14s} {'decode GPU-s':>13s} {'KV GB':>8s}")  # fmt: skip
    for tenant, t in totals.items():
        n = t.get("requests", 0.0)
        usd = t.get("usd", 0.0)
        print(
            f"{tenant:20s} {n:9.0f} {usd:12.6f} {usd / n * 1000 if n else 0:11.4f} "
            f"{t.get('prefill_gpu_s', 0.0):14.2f} "
            f"{t.get('decode_gpu_s', 0.0) + t.get('aggregated_gpu_s', 0.0):13.2f} "
            f"{t.get('transfer_bytes', 0.0) / 1e9:8.3f}"
        )
    return 0


def _bench_transport(args: argparse.Namespace) -> int:
    from transport import bench  # noqa: PLC0415

    try:
        size = bench.parse_size(args.size)
        result = bench.run(args.backend, size, args.iters, args.layers, args.rounds)
    except bench.BenchError as exc:
        print(f"pdorch bench transport: {exc}", file=sys.stderr)
        return 2
    print(result.json() if args.json else result.human())
    return 0


def _bench_precision(args: argparse.Namespace) -> int:
    from orchestrator.bench.precision import prompts_from_text, render  # noqa: PLC0415
    from orchestrator.bench.precision_run import default_prompts, run_precision  # noqa: PLC0415
    from orchestrator.workers.model_files import load_engine  # noqa: PLC0415

    if args.prompts:
        try:
            prompts = prompts_from_text(Path(args.prompts).read_text())
        except OSError as exc:
            print(f"pdorch bench precision: --prompts: {exc}", file=sys.stderr)
            return 2
        if not prompts:
            print("pdorch bench precision: --prompts: no prompts in the file", file=sys.stderr)
            return 2
    else:
        prompts = default_prompts()
    engine = load_engine(args.model, Path(args.model_cache) if args.model_cache else None)

    def progress(i: int, r: object) -> None:  # stderr: stdout stays one JSON object
        print(f"  prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)

    report = run_precision(engine, args.dtype, prompts, args.max_tokens, progress)
    print(json.dumps(report.to_dict()) if args.json else render(report))
    return 0


def _bench_control_plane(args: argparse.Namespace) -> int:
    from orchestrator.bench.control_plane import (  # noqa: PLC0415
        ControlPlaneBench,
        format_result,
        run_bench,
    )
    from orchestrator.cluster import ClusterError  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    bench = ControlPlaneBench(
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        concurrency=args.concurrency,
        requests=args.requests,
        orchestrators=args.orchestrators,
        clients=args.clients,
        fleet_processes=args.fleet_processes,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        model=args.model,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        warmup=args.warmup,
        profile_dir=Path(args.profile_dir) if args.profile_dir else None,
        orchestrator_args=tuple(args.orchestrator_arg),
    )
    try:
        result = run_bench(bench, log_level=args.log_level)
    except (ConfigError, ClusterError) as exc:
        print(f"pdorch bench control-plane: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from orchestrator.bench.engine_batching import (  # noqa: PLC0415
        EngineBench,
        format_result,
        run_bench,
    )

    bench = EngineBench(
        engine=args.engine,
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        rounds=args.rounds,
        max_tokens=args.max_tokens,
    )
    result = run_bench(bench, log_level=args.log_level)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    from orchestrator.bench.load import LoadSpec, run_load  # noqa: PLC0415

    spec = LoadSpec(
        targets=tuple(t for t in args.target.split(",") if t),
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        offset=args.offset,
    )
    result = asyncio.run(run_load(spec))
    if args.samples:  # for `bench control-plane`, which merges several clients
        print(result.to_json())
    elif args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        for key, value in result.summary().items():
            print(f"{key}: {value}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo  # noqa: PLC0415

    return run_demo(
        model=args.model,
        transport=args.transport,
        as_json=args.json,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        max_tokens=args.max_tokens,
        serve=args.serve,
        http_port=args.http_port,
        engine=args.engine,
    )


def _chaos_list(args: argparse.Namespace) -> int:
    from orchestrator.chaos.scenario import ScenarioError, load, shipped  # noqa: PLC0415

    for name, path in sorted(shipped().items()):
        try:
            description = load(str(path)).description
        except ScenarioError as exc:
            description = f"(invalid: {exc})"
        print(f"{name:24s} {description}")
    return 0


def _chaos_run(args: argparse.Namespace) -> int:
    from orchestrator.chaos.runner import run_chaos  # noqa: PLC0415
    from orchestrator.chaos.scenario import ScenarioError, load  # noqa: PLC0415

    try:
        scenario = load(args.scenario)
    except ScenarioError as exc:
        print(f"pdorch chaos: {exc}", file=sys.stderr)
        return 2
    return run_chaos(
        scenario,
        seed=args.seed,
        runs=args.runs,
        out_dir=Path(args.out) if args.out else None,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        as_json=args.json,
    )


def _migrate_settings(args: argparse.Namespace, mode: str) -> Any:
    from orchestrator.migrate.settings import (  # noqa: PLC0415
        Limits,
        MigrationSettings,
        Pricing,
        Upstreams,
    )

    return MigrationSettings(
        name=args.name,
        mode=mode,
        upstreams=Upstreams(
            existing=args.existing,
            pdorch=args.pdorch,
            pdorch_api_key=args.pdorch_api_key,
            connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.upstream_timeout,
        ),
        percent=getattr(args, "percent", 0.0),
        sample=getattr(args, "sample", 0.0),
        limits=Limits(
            max_error_rate=args.max_error_rate,
            max_ttft_p99_ms=args.max_ttft_p99_ms,
            max_tpot_p99_ms=args.max_tpot_p99_ms,
            window=args.window,
            min_samples=args.min_samples,
        ),
        pricing=Pricing(
            usd_per_1k_tokens=args.existing_usd_per_1k_tokens,
            usd_per_hour=args.existing_usd_per_hour,
        ),
        shadow_concurrency=args.shadow_concurrency,
        max_samples=args.max_samples,
    )


async def _migrate_serve(args: argparse.Namespace) -> int:
    """`pdorch migrate shadow|canary`: the migration proxy until SIGTERM/SIGINT."""
    from orchestrator.errors import PdorchError  # noqa: PLC0415
    from orchestrator.migrate import service  # noqa: PLC0415
    from orchestrator.migrate.settings import parse_listen  # noqa: PLC0415

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        settings = _migrate_settings(args, args.migrate_command)
        host, port = parse_listen(args.listen)
        await service.serve(settings, args.redis, host, port, stop, args.drain_grace)
    except PdorchError as exc:
        print(f"pdorch migrate {args.migrate_command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdorch migrate {args.migrate_command}: cannot listen on {args.listen}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _migrate_status(args: argparse.Namespace) -> int:
    from orchestrator.errors import PdorchError  # noqa: PLC0415
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        snap = asyncio.run(service.status(args.redis, args.name))
    except PdorchError as exc:
        print(f"pdorch migrate status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(snap, sort_keys=True) if args.json else service.format_status(snap))
    return 0


def _migrate_percent(args: argparse.Namespace) -> int:
    from orchestrator.errors import PdorchError  # noqa: PLC0415
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        asyncio.run(service.set_percent(args.redis, args.name, args.percent))
    except PdorchError as exc:
        print(f"pdorch migrate percent: {exc}", file=sys.stderr)
        return 1
    print(f"migration {args.name}: pdorch share set to {args.percent:g}%")
    return 0


def _migrate_report(args: argparse.Namespace) -> int:
    from orchestrator.errors import PdorchError  # noqa: PLC0415
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        summary = asyncio.run(service.write_report(args.redis, args.name, Path(args.out)))
    except PdorchError as exc:
        print(f"pdorch migrate report: {exc}", file=sys.stderr)
        return 1
    answers = sum(p.requests for p in summary.paths)
    print(f"wrote {args.out} ({answers} answers, {len(summary.rollbacks)} rollbacks)")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from orchestrator.core import planconfig, planner  # noqa: PLC0415
    from orchestrator.core.plan_report import format_plan, plan_to_dict  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    def read(path: str) -> dict[str, object]:
        fmt = "json" if path.endswith(".json") else "toml"
        return planconfig.parse_text(Path(path).read_text(encoding="utf-8"), fmt)

    flags: dict[str, object] = {
        "model.preset": args.model,
        "model.dtype": args.dtype,
        "traffic.rate": args.rate,
        "traffic.prompt": args.prompt_tokens,
        "traffic.output": args.output_tokens,
        "slo.ttft_ms": args.ttft_ms,
        "slo.tpot_ms": args.tpot_ms,
        "slo.percentile": args.percentile,
        "plan.kinds": args.gpus,
        "plan.prefill_kinds": args.prefill_gpus,
        "plan.link_gbps": args.link_gbps,
        "plan.max_batch": args.max_batch,
        "plan.allow_fp16": True if args.allow_fp16 else None,
    }
    try:
        data = read(args.config) if args.config else {}
        if args.gpu_file:
            gpus = {f"gpus.{kind}": spec for kind, spec in read(args.gpu_file).items()}
            data = planconfig.overlay(data, gpus)
        if args.model:
            data.pop("model", None)  # a preset named on the command line replaces the file's
        flags = {key: value for key, value in flags.items() if value is not None}
        flags |= {f"prices.{k}": v for k, v in map(planconfig.parse_price, args.price)}
        request = planconfig.plan_request_from_mapping(planconfig.overlay(data, flags))
        result = planner.plan(request)
    except (ConfigError, OSError) as exc:
        print(f"pdorch plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(result), indent=2) if args.json else format_plan(result))
    return 0


# ------------------------------------------------------------------------------- parser


def _price(text: str) -> tuple[str, float]:
    from orchestrator.core.planconfig import parse_price  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    try:
        return parse_price(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fault_spec(text: str) -> str:
    from transport.testing import FaultInjector  # noqa: PLC0415

    try:
        FaultInjector.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    p = argparse.ArgumentParser(prog="pdorch", description=__doc__)
    p.add_argument("--log-level", default=env.get("PDORCH_LOG_LEVEL", "WARNING"))
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    sub = p.add_subparsers(dest="command", required=True)
    redis_default = env.get("PDORCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    cache_default = env.get("PDORCH_MODEL_CACHE", "")

    o = sub.add_parser("orchestrator", help="run an orchestrator replica")
    o.add_argument("--redis", default=redis_default)
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, default=50051)
    o.add_argument("--replica-id", default=env.get("HOSTNAME", "orchestrator"))
    o.add_argument("--fallback", choices=("local", "fail"), default="local")
    o.add_argument(
        "--kv-dtype",
        choices=("auto", "native", "fp16", "fp8"),  # orchestrator.core.kvdtype.KvPolicy
        default="auto",
        help="KV wire dtype per prefill→decode pair: auto converts where the decode GPU holds "
        "KV narrower (bf16→fp16 for T4); fp8 quarters float32's bytes (README: KV precision)",
    )
    o.add_argument(
        "--drain-grace",
        type=float,
        default=10.0,
        help="on SIGTERM: seconds in-flight streams may finish before they are handed off",
    )
    o.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    o.add_argument(
        "--price",
        type=_price,
        action="append",
        default=[],
        metavar="KIND=USD",
        help="price per GPU-hour of a worker GPU kind, e.g. H100=2.1 (repeatable)",
    )
    o.add_argument("--transfer-usd-per-gb", type=float, default=0.0)
    o.add_argument(
        "--detach-grace",
        type=float,
        default=10.0,
        help="seconds a request keeps running after its client left, for it to resume",
    )
    o.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=0.0,
        help="refuse (RESOURCE_EXHAUSTED + retry-after) requests whose estimated TTFT exceeds "
        "this (0: no SLO check)",
    )
    o.add_argument(
        "--max-queue", type=int, default=256, help="requests per prefill worker's queue, at most"
    )
    o.add_argument(
        "--max-inflight", type=int, default=0, help="requests this replica drives (0: no limit)"
    )
    o.add_argument(
        "--tenant-limit",
        action="append",
        default=[],
        metavar="TENANT=N",
        help="requests in flight at most for a tenant, all replicas together (repeatable)",
    )
    o.add_argument(
        "--default-tenant-limit", type=int, default=0, help="for other tenants (0: no limit)"
    )
    o.add_argument(
        "--aggregate-below",
        default="auto",
        metavar="auto|N",
        help="conditional disaggregation: 'auto' keeps prompts on the decode worker when the "
        "measured rates say a transfer costs more; N: prompts under N tokens; 0: never",
    )
    o.add_argument("--profile", default="", help="write a cProfile of this process to PATH")
    o.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP gateway on this port (0: any free port)",
    )
    o.add_argument("--http-host", default="", help="the gateway's address (default: --host)")
    o.add_argument(
        "--api-key",
        default=env.get("PDORCH_API_KEY", ""),
        help="gateway: require 'Authorization: Bearer KEY' (default: $PDORCH_API_KEY; none)",
    )
    o.set_defaults(run=_run_orchestrator)

    w = sub.add_parser("worker", help="run a prefill or decode worker")
    w.add_argument("--role", choices=("prefill", "decode"), required=True)
    w.add_argument("--redis", default=redis_default)
    w.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    w.add_argument("--model-cache", default=cache_default)
    w.add_argument("--transport", choices=("ucx", "tcp"), default="ucx")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0)
    w.add_argument("--kv-port", type=int, default=0)
    w.add_argument("--worker-id", default="")
    w.add_argument(
        "--kv-capacity-mib",
        type=int,
        default=0,
        help="KV budget (default 2048; simulated: the GPU's memory beside the weights)",
    )
    w.add_argument("--heartbeat-ttl", type=float, default=3.0)
    w.add_argument(
        "--kv-hold", type=float, default=30.0, help="free a received KV nobody claims after S"
    )
    w.add_argument(
        "--torch-threads", type=int, default=0, help="CPU threads for the engine (0: torch's)"
    )
    w.add_argument(
        "--gpu-kind",
        default=env.get("PDORCH_GPU_KIND", "cpu"),
        help="the accelerator this worker runs on (priced by the orchestrators: H100, L4, ...)",
    )
    w.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics (0: off)")
    w.add_argument("--advertise", default="", help="host:port to publish instead of the listener")
    w.add_argument("--kv-advertise", default="", help="host:port to publish for the KV receiver")
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
    w.add_argument(
        "--sim",
        default="",
        metavar="MODEL@GPU",
        help="simulated worker: no model, timings from the performance model, e.g. "
        "llama-3-8b@H100 or llama-3-70b@H100x4 (TCP transport; see README 'Scale')",
    )
    w.add_argument(
        "--count",
        type=_positive_int,
        default=1,
        help="with --sim: this many workers in this process (ids <worker-id>-0..N-1)",
    )
    w.add_argument("--max-batch", type=int, default=0, help="decode batch (16; simulated: 256)")
    w.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="reference: pdorch's transformers engine; vllm: vLLM's async engine (the vllm "
        "extra; --model smollm2; --kv-capacity-mib sizes its block pool, default 1024)",
    )
    w.add_argument("--profile", default="", help="write a cProfile of this process to PATH")
    w.set_defaults(run=_run_worker)

    op = sub.add_parser("operator", help="run the Kubernetes operator (DisaggregatedService)")
    op.add_argument(
        "--namespace", action="append", required=True, help="serve this namespace (repeatable)"
    )
    op.add_argument(
        "--resync-interval", type=float, default=30.0, help="re-reconcile every resource every S"
    )
    op.add_argument(
        "--server",
        default=env.get("PDORCH_KUBE_SERVER", ""),
        help="API server URL used without authentication (kubectl proxy); "
        "default: the pod's service account, else the kubeconfig",
    )
    op.add_argument("--liveness", default="", help="serve kopf's liveness probe at this URL")
    op.set_defaults(run=_run_operator)

    g = sub.add_parser("generate", help="stream a completion from an orchestrator")
    g.add_argument("prompt")
    g.add_argument("--orchestrator", default="127.0.0.1:50051")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--request-id", default="")
    g.add_argument("--timeout", type=float, default=300.0)
    g.set_defaults(run=_generate)

    d = sub.add_parser("demo", help="start a local cluster and run prompts through it")
    d.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    d.add_argument("--model-cache", default=cache_default)
    d.add_argument("--transport", choices=("ucx", "tcp"), default="ucx")
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--json", action="store_true")
    d.add_argument(
        "--serve",
        action="store_true",
        help="then keep the cluster up with the OpenAI-compatible gateway until Ctrl-C",
    )
    d.add_argument("--http-port", type=int, default=0, help="--serve: gateway port (0: free)")
    d.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="the workers' engine (vllm: run from the vllm extra's environment, --model smollm2)",
    )
    d.set_defaults(call=_demo)

    co = sub.add_parser("cost", help="what each tenant's requests cost so far")
    co.add_argument("--redis", default=redis_default)
    co.add_argument("--json", action="store_true")
    co.set_defaults(run=_cost)

    c = sub.add_parser("chaos", help="chaos-test failover on a local cluster")
    csub = c.add_subparsers(dest="chaos_command", required=True)
    cl = csub.add_parser("list", help="list the shipped scenarios")
    cl.set_defaults(call=_chaos_list)
    cr = csub.add_parser("run", help="run a scenario (shipped name or YAML file) and check it")
    cr.add_argument("scenario")
    cr.add_argument("--seed", type=int, default=0, help="run i uses seed + i for its faults")
    cr.add_argument("--runs", type=_positive_int, default=1)
    cr.add_argument("--json", action="store_true", help="print one JSON object")
    cr.add_argument("--out", default="", help="folder for histories and timelines")
    cr.add_argument("--model-cache", default=cache_default)
    cr.set_defaults(call=_chaos_run)

    _add_migrate(sub, redis_default)

    b = sub.add_parser("bench", help="benchmarks (ratios against a reference in the same run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bt = bsub.add_parser("transport", help="KV transfer throughput vs ucx_perftest tag_bw")
    bt.add_argument("--backend", choices=("ucx", "tcp"), default="ucx")
    bt.add_argument("--size", default="64MiB", help="KV bytes per transfer (e.g. 64MiB)")
    bt.add_argument("--iters", type=int, default=10)
    bt.add_argument("--layers", type=int, default=32, help="layers the KV is split into")
    bt.add_argument(
        "--rounds", type=int, default=5, help="alternations of ours/reference (medians compared)"
    )
    bt.add_argument("--json", action="store_true", help="print one JSON object")
    bt.set_defaults(call=_bench_transport)
    bp = bsub.add_parser(
        "precision",
        help="token agreement with the KV converted for the wire (fp16/bf16/fp8) vs unchanged",
        description="Runs each prompt greedily twice in this process from one prefill: with "
        "the prompt's KV unchanged, and with it converted to --dtype and back (the wire "
        "encoding included). Reports agreement (matched prefix / length), the first "
        "divergence per prompt, and refuses to recommend a dtype (fp8) whose disagreement "
        "exceeds 1%. See README 'KV precision'.",
    )
    bp.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    bp.add_argument("--dtype", choices=("fp16", "bf16", "fp8"), default="fp8")
    bp.add_argument("--prompts", default="", help="file: one prompt per line (default: 20)")
    bp.add_argument("--max-tokens", type=_positive_int, default=64)
    bp.add_argument("--model-cache", default=cache_default)
    bp.add_argument("--json", action="store_true", help="print one JSON object")
    bp.set_defaults(call=_bench_precision)
    bc = bsub.add_parser(
        "control-plane",
        help="the real orchestrator, Redis and gRPC against simulated workers",
        description="Starts Redis, simulated workers (pdorch worker --sim) and orchestrators, "
        "drives concurrent requests through gRPC and reports admitted req/s, orchestration "
        "overhead (client TTFT - worker TTFT) and CPU per request. See README 'Scale'.",
    )
    bc.add_argument("--workers", type=_positive_int, default=200)
    bc.add_argument("--prefill-workers", type=int, default=0, help="of --workers (0: half)")
    bc.add_argument("--concurrency", type=_positive_int, default=2000)
    bc.add_argument("--requests", type=_positive_int, default=10000)
    bc.add_argument("--orchestrators", type=_positive_int, default=1)
    bc.add_argument("--clients", type=_positive_int, default=2, help="load processes")
    bc.add_argument(
        "--fleet-processes", type=_positive_int, default=1, help="processes per worker role"
    )
    bc.add_argument("--max-tokens", type=_positive_int, default=16)
    bc.add_argument("--prompt-words", type=_positive_int, default=100)
    bc.add_argument("--model", default="llama-3-8b", help="performance-model preset")
    bc.add_argument("--prefill-gpu", default="H100")
    bc.add_argument("--decode-gpu", default="L4")
    bc.add_argument("--warmup", type=int, default=0, help="unmeasured requests (0: 2/worker)")
    bc.add_argument("--profile-dir", default="", help="cProfile each orchestrator into DIR")
    bc.add_argument(
        "--orchestrator-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass FLAG to every orchestrator, e.g. --orchestrator-arg=--max-inflight=300",
    )
    bc.add_argument("--json", action="store_true", help="print one JSON object")
    bc.set_defaults(call=_bench_control_plane)
    be = bsub.add_parser(
        "engine",
        help="TTFT/TPOT of concurrent streams on one worker (does the engine batch them?)",
    )
    be.add_argument("--engine", choices=("reference", "vllm"), default="vllm")
    be.add_argument("--concurrency", default="1,4,8", help="comma-separated stream counts")
    be.add_argument("--rounds", type=_positive_int, default=2, help="requests per stream")
    be.add_argument("--max-tokens", type=_positive_int, default=64)
    be.add_argument("--json", action="store_true", help="print one JSON object")
    be.set_defaults(call=_bench_engine)
    bl = bsub.add_parser("load", help="drive concurrent requests at running orchestrators")
    bl.add_argument("--target", default="127.0.0.1:50051", help="host:port[,host:port...]")
    bl.add_argument("--requests", type=_positive_int, default=1000)
    bl.add_argument("--concurrency", type=_positive_int, default=100)
    bl.add_argument("--max-tokens", type=_positive_int, default=16)
    bl.add_argument("--prompt-words", type=_positive_int, default=100)
    bl.add_argument("--offset", type=int, default=0, help="first request number")
    bl.add_argument("--json", action="store_true", help="print the summary as JSON")
    bl.add_argument("--samples", action="store_true", help="print every sample as JSON")
    bl.set_defaults(call=_bench_load)

    pl = sub.add_parser(
        "plan",
        help="estimate cost and goodput of colocated and disaggregated layouts",
        description="Roofline estimates of colocated and prefill/decode-split layouts on GPU "
        "kinds: replicas, TTFT, TPOT, goodput and cost per 1,000 requests, and a "
        "recommendation. Flags override --config; see README 'Planner'.",
    )
    pl.add_argument("--config", help="JSON or TOML file (sections: model, traffic, slo, ...)")
    pl.add_argument("--model", help="preset: smollm2-135m, llama-3-8b, llama-3-70b")
    pl.add_argument("--dtype", choices=("bf16", "fp16", "fp8"), help="weights/KV dtype")
    pl.add_argument("--rate", type=float, help="requests per second (default 20)")
    pl.add_argument("--prompt-tokens", help="512 | uniform:LO:HI | lognormal:MEDIAN:P90")
    pl.add_argument("--output-tokens", help="same forms as --prompt-tokens (default 256)")
    pl.add_argument("--ttft-ms", type=float, help="TTFT target for the percentile prompt")
    pl.add_argument("--tpot-ms", type=float, help="TPOT target")
    pl.add_argument("--percentile", type=float, help="prompt percentile for TTFT (0.9)")
    pl.add_argument("--gpus", help="kinds, comma-separated: colocated and decode pools")
    pl.add_argument("--prefill-gpus", help="kinds for prefill pools (default: first of --gpus)")
    pl.add_argument("--price", action="append", default=[], help="KIND=USD per GPU-hour")
    pl.add_argument("--gpu-file", help="JSON or TOML table of GPU kinds overriding the defaults")
    pl.add_argument("--link-gbps", type=float, help="prefill->decode link, Gbit/s (100)")
    pl.add_argument("--max-batch", type=int, help="most sequences per decode batch (256)")
    pl.add_argument("--allow-fp16", action="store_true", help="plan bf16 models in fp16 on T4")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(call=_plan)
    return p


def _add_migrate(sub: Any, redis_default: str) -> None:
    m = sub.add_parser(
        "migrate",
        help="move an OpenAI service's traffic onto pdorch: shadow, canary, status, report",
        description="A proxy in front of the existing OpenAI-compatible service and pdorch; "
        "see README 'Migration'.",
    )
    msub = m.add_subparsers(dest="migrate_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", required=True, help="the migration's name (Redis keys)")
        p.add_argument("--redis", default=redis_default, help="where the migration's state lives")

    for mode, text in (
        ("shadow", "answer from the existing service; mirror a sample to pdorch and compare"),
        ("canary", "answer a share of requests from pdorch; roll back when it breaks limits"),
    ):
        p = msub.add_parser(mode, help=text)
        common(p)
        p.add_argument("--existing", required=True, help="the existing service's base URL")
        p.add_argument("--pdorch", required=True, help="pdorch's gateway base URL")
        p.add_argument("--listen", default="127.0.0.1:8090", help="HOST:PORT the proxy serves")
        if mode == "shadow":
            p.add_argument("--sample", type=float, default=0.1, help="share mirrored (0..1)")
        else:
            p.add_argument("--percent", type=float, required=True, help="share to pdorch (%%)")
        p.add_argument("--max-error-rate", type=float, default=0.05)
        p.add_argument("--max-ttft-p99-ms", type=float, default=0.0, help="0: no limit")
        p.add_argument("--max-tpot-p99-ms", type=float, default=0.0, help="0: no limit")
        p.add_argument("--window", type=int, default=100, help="pdorch requests judged")
        p.add_argument("--min-samples", type=int, default=20, help="judge only from this many")
        p.add_argument("--pdorch-api-key", default="", help="key for pdorch (default: client's)")
        p.add_argument("--existing-usd-per-1k-tokens", type=float, default=0.0)
        p.add_argument("--existing-usd-per-hour", type=float, default=0.0)
        p.add_argument("--shadow-concurrency", type=int, default=8)
        p.add_argument("--max-samples", type=int, default=10_000, help="samples kept in Redis")
        p.add_argument("--connect-timeout", type=float, default=5.0)
        p.add_argument("--upstream-timeout", type=float, default=300.0, help="S between bytes")
        p.add_argument("--drain-grace", type=float, default=10.0)
        p.set_defaults(run=_migrate_serve)
    st = msub.add_parser("status", help="mode, share, counters, windows and rollbacks")
    common(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(call=_migrate_status)
    pc = msub.add_parser("percent", help="set a canary's share by hand (e.g. after a rollback)")
    common(pc)
    pc.add_argument("--percent", type=float, required=True)
    pc.set_defaults(call=_migrate_percent)
    rp = msub.add_parser("report", help="Markdown or HTML report with plots")
    common(rp)
    rp.add_argument("--out", required=True, help="report.md or report.html (plots beside it)")
    rp.set_defaults(call=_migrate_report)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": record.created,
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    if args.log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if getattr(args, "call", None) is not None:
        return int(args.call(args))
    if getattr(args, "profile", ""):
        return _profiled(args)
    return int(asyncio.run(args.run(args)))


def _profiled(args: argparse.Namespace) -> int:
    """Run a server command under cProfile; the stats go to ``--profile`` when it exits."""
    import cProfile  # noqa: PLC0415

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return int(asyncio.run(args.run(args)))
    finally:
        profiler.disable()
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
