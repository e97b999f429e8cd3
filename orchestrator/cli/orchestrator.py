"""`pdorch orchestrator`: one orchestrator replica — the control plane behind the gRPC client
API (and, with ``--http-port``, the OpenAI-compatible gateway), with Redis as its store.

Its flags fill `ControlSettings` (and the `AdmissionPolicy` in it), `GatewaySettings` and
`ServerSettings` below; their defaults are those dataclasses' field defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.cli import event_loop, gc_tuning
from orchestrator.cli.common import (
    CommandError,
    Commands,
    Parents,
    add_command,
    check_port_free,
    check_redis,
    default,
    field_doc,
    non_negative_float,
    non_negative_int,
    port,
    positive_int,
    price,
    serve_metrics,
    server_tls_dir,
    until_signalled,
)

log = logging.getLogger("pdorch")

if TYPE_CHECKING:
    import grpc

    from orchestrator.api.tls import Tls
    from orchestrator.control.orchestrator import ControlSettings, Orchestrator
    from orchestrator.control.tokens import TokenFile
    from orchestrator.gateway.server import HttpServer


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The replica's process around the control plane: where it listens and how it stops.
    Only the composition root builds servers, so these settings live here."""

    host: str = "127.0.0.1"
    port: int = 50051
    """The gRPC client API; `pdorch generate` and `pdorch bench load` connect here."""
    drain_grace_s: float = 10.0
    """On SIGTERM: seconds in-flight streams may finish before they are handed off."""
    metrics_port: int = 0
    """Prometheus ``/metrics`` (0: off)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


API_KEY_ENV = "PDORCH_API_KEY"
TOKENS_FILE_ENV = "PDORCH_TOKENS_FILE"
UNAUTHENTICATED_WARNING = (
    "NO AUTHENTICATION: no --tokens-file, so anyone who reaches this orchestrator's port "
    "can submit, read and cancel requests and bill any tenant (README: Security)"
)

AGGREGATE_BELOW = "auto"
"""`pdorch orchestrator`'s ``--aggregate-below``: the measured rates decide. (A bare
`AdmissionPolicy` always disaggregates, which keeps placement in tests predictable.)"""

SERVER_OPTIONS = (
    # gRPC core holds calls the event loop has not picked up yet; by default it cancels one
    # that waited 30 s and refuses beyond 1,000 waiting. A replica saturated by a burst
    # (2,000 concurrent clients at 200 workers here) then cancels calls it would have
    # served; admission (`--max-inflight`, `--max-queue`, the TTFT SLO) is where load is
    # refused, with a reason and a retry-after.
    ("grpc.server_max_unrequested_time_in_server", 600),
    ("grpc.server.max_pending_requests", 65536),
)


NAME = "orchestrator"
HELP = "run an orchestrator replica"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    from orchestrator.control.orchestrator import ControlSettings  # noqa: PLC0415 - grpc
    from orchestrator.core.kvdtype import KvPolicy  # noqa: PLC0415 - numpy
    from orchestrator.core.routing import RoutingPolicy  # noqa: PLC0415
    from orchestrator.gateway.settings import GatewaySettings  # noqa: PLC0415
    from orchestrator.store.settings import StoreSettings  # noqa: PLC0415

    o = add_command(sub, NAME, parents, parents.redis, parents.tls, help=HELP)
    event_loop.add_loop_flag(o, event_loop.ORCHESTRATOR_LOOP)
    o.add_argument(
        "--host", default=default(ServerSettings, "host"), help="listen address (%(default)s)"
    )
    o.add_argument(
        "--port",
        type=port,
        default=default(ServerSettings, "port"),
        help="gRPC client API (`pdorch generate`; 0: a free port; default %(default)s)",
    )
    o.add_argument(
        "--replica-id",
        default=env.get("HOSTNAME", "orchestrator"),
        help="this replica's name in leases and logs (default: $HOSTNAME, else orchestrator)",
    )
    o.add_argument(
        "--fallback",
        choices=("local", "fail"),
        default=default(ControlSettings, "fallback"),
        help="when a pool is down: local runs requests aggregated on the surviving pool, "
        "fail refuses them (default %(default)s)",
    )
    o.add_argument(
        "--kv-dtype",
        choices=tuple(p.value for p in KvPolicy),
        default=default(ControlSettings, "kv_dtype").value,
        help="KV wire dtype per prefill→decode pair: auto converts where the decode GPU holds "
        "KV narrower (bf16→fp16 for T4); fp8 quarters float32's bytes (README: KV precision)",
    )
    o.add_argument(
        "--drain-grace",
        type=non_negative_float,
        default=default(ServerSettings, "drain_grace_s"),
        help=field_doc(ServerSettings, "drain_grace_s"),
    )
    o.add_argument(
        "--metrics-port",
        type=port,
        default=default(ServerSettings, "metrics_port"),
        help=field_doc(ServerSettings, "metrics_port"),
    )
    o.add_argument(
        "--price",
        type=price,
        action="append",
        default=[],
        metavar="KIND=USD",
        help="price per GPU-hour of a worker GPU kind, e.g. H100=2.1 (repeatable)",
    )
    o.add_argument(
        "--transfer-usd-per-gb",
        type=non_negative_float,
        default=default(ControlSettings, "transfer_usd_per_gb"),
        help=field_doc(ControlSettings, "transfer_usd_per_gb"),
    )
    o.add_argument(
        "--detach-grace",
        type=non_negative_float,
        default=default(ControlSettings, "detach_grace_s"),
        help=field_doc(ControlSettings, "detach_grace_s"),
    )
    o.add_argument(
        "--stream-flush-ms",
        type=non_negative_float,
        default=default(ControlSettings, "stream_flush_ms"),
        help=field_doc(ControlSettings, "stream_flush_ms"),
    )
    o.add_argument(
        "--decode-mux",
        action=argparse.BooleanOptionalAction,
        default=default(ControlSettings, "decode_mux"),
        help=field_doc(ControlSettings, "decode_mux"),
    )
    o.add_argument(
        "--call-mux",
        action=argparse.BooleanOptionalAction,
        default=default(ControlSettings, "call_mux"),
        help=field_doc(ControlSettings, "call_mux"),
    )
    o.add_argument(
        "--placement-sample",
        type=non_negative_int,
        default=default(ControlSettings, "placement_sample"),
        help=field_doc(ControlSettings, "placement_sample"),
    )
    o.add_argument(
        "--journal-gather-ms",
        type=non_negative_float,
        default=default(ControlSettings, "journal_gather_ms"),
        help=field_doc(ControlSettings, "journal_gather_ms"),
    )
    o.add_argument(
        "--store-outage",
        type=non_negative_float,
        default=default(StoreSettings, "outage_s"),
        help=field_doc(StoreSettings, "outage_s"),
    )
    _admission_flags(o)
    o.add_argument(
        "--kv-routing",
        choices=("on", "off"),
        default="on" if default(RoutingPolicy, "enabled") else "off",
        help=field_doc(RoutingPolicy, "enabled"),
    )
    o.add_argument(
        "--kv-suffix",
        choices=("on", "off"),
        default="on" if default(RoutingPolicy, "suffix_only") else "off",
        help=field_doc(RoutingPolicy, "suffix_only"),
    )
    o.add_argument("--profile", default="", help="write a cProfile of this process to PATH")
    o.add_argument(
        "--gc-threshold",
        type=int,
        default=gc_tuning.DEFAULT_THRESHOLD,
        help="once started, freeze the objects start-up built out of the garbage collector's "
        "sight and collect the young generation every N allocations (0: CPython's default "
        "collector; see orchestrator/cli/gc_tuning.py)",
    )
    o.add_argument(
        "--http-port",
        type=port,
        default=None,
        help="also serve the OpenAI-compatible HTTP gateway on this port (0: any free port)",
    )
    o.add_argument("--http-host", default="", help="the gateway's address (default: --host)")
    o.add_argument(
        "--api-key",
        default=env.get(API_KEY_ENV, default(GatewaySettings, "api_key")),
        help="gateway only, one shared key: require 'Authorization: Bearer KEY' (default: "
        "$PDORCH_API_KEY; none). Prefer --tokens-file: it guards both APIs and names tenants",
    )
    o.add_argument(
        "--tokens-file",
        default=env.get(TOKENS_FILE_ENV, ""),
        metavar="PATH",
        help="bearer tokens (SHA-256 hashed) and the tenants each may act for (README: "
        "Security); both the gRPC API and the gateway then require one, and the tenant comes "
        "from it. Re-read when it changes, or on SIGHUP (default: $PDORCH_TOKENS_FILE; none: "
        "the API is open)",
    )
    o.add_argument(
        "--client-cert",
        choices=("none", "required"),
        default="none",
        help="with --tls-dir, on the client API and the gateway: none: server TLS only, "
        "callers prove themselves with a bearer token; required: mutual TLS, a caller "
        "presents a certificate ca.pem signed, of a client identity (a worker's is refused)",
    )
    o.add_argument(
        "--http-plain",
        action="store_true",
        help="with --tls-dir: serve the gateway as plain HTTP all the same, for a proxy "
        "that terminates TLS in front of it; only on a loopback --http-host",
    )
    o.set_defaults(run=run)


def _admission_flags(o: argparse.ArgumentParser) -> None:
    from orchestrator.core.admission import AdmissionPolicy  # noqa: PLC0415

    o.add_argument(
        "--ttft-slo-ms",
        type=non_negative_float,
        default=default(AdmissionPolicy, "ttft_slo_s") * 1000,
        help="refuse (RESOURCE_EXHAUSTED + retry-after) requests whose estimated TTFT exceeds "
        "this (0: no SLO check)",
    )
    o.add_argument(
        "--max-queue",
        type=positive_int,
        default=default(AdmissionPolicy, "max_queue"),
        help=field_doc(AdmissionPolicy, "max_queue"),
    )
    o.add_argument(
        "--max-inflight",
        type=non_negative_int,
        default=default(AdmissionPolicy, "max_inflight"),
        help=field_doc(AdmissionPolicy, "max_inflight"),
    )
    o.add_argument(
        "--tenant-limit",
        action="append",
        default=[],
        metavar="TENANT=N",
        help=field_doc(AdmissionPolicy, "tenant_limits") + " (repeatable)",
    )
    o.add_argument(
        "--default-tenant-limit",
        type=non_negative_int,
        default=default(AdmissionPolicy, "default_tenant_limit"),
        help=field_doc(AdmissionPolicy, "default_tenant_limit"),
    )
    o.add_argument(
        "--aggregate-below",
        default=AGGREGATE_BELOW,
        metavar="auto|N",
        help="conditional disaggregation: 'auto' keeps prompts on the decode worker when the "
        "measured rates say a transfer costs more; N: prompts under N tokens; 0: never",
    )


def preflight(args: argparse.Namespace) -> None:
    """What can be checked before anything starts: Redis answers, the ports are free (a
    replica that cannot reach Redis fails here instead of warning every second)."""
    if args.http_plain and not _loopback(args.http_host or args.host):
        raise CommandError(
            "--http-plain serves plaintext HTTP only on a loopback address (a TLS proxy in "
            f"the same host or pod), not on {args.http_host or args.host}"
        )
    check_redis(args.redis)
    check_port_free(args.host, args.port, "--port")
    check_port_free(args.host, args.metrics_port, "--metrics-port")
    if args.http_port:
        check_port_free(args.http_host or args.host, args.http_port, "--http-port")


def _loopback(host: str) -> bool:
    import ipaddress  # noqa: PLC0415

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(args.host, args.port, args.drain_grace, args.metrics_port)


def control_settings(args: argparse.Namespace) -> ControlSettings:
    """The control plane's settings from the flags (ConfigError on a bad value)."""
    from orchestrator.control.orchestrator import ControlSettings  # noqa: PLC0415
    from orchestrator.core.admission import (  # noqa: PLC0415
        AdmissionPolicy,
        parse_aggregate_below,
        parse_tenant_limits,
    )
    from orchestrator.core.hardware import PRICED_KINDS, with_prices  # noqa: PLC0415
    from orchestrator.core.kvdtype import KvPolicy  # noqa: PLC0415
    from orchestrator.core.routing import RoutingPolicy  # noqa: PLC0415

    prices = with_prices(PRICED_KINDS, dict(args.price))
    admission = AdmissionPolicy(
        ttft_slo_s=args.ttft_slo_ms / 1000,
        max_queue=args.max_queue,
        max_inflight=args.max_inflight,
        tenant_limits=parse_tenant_limits(args.tenant_limit),
        default_tenant_limit=args.default_tenant_limit,
        aggregate_below=parse_aggregate_below(args.aggregate_below),
    )
    return ControlSettings(
        fallback=args.fallback,
        detach_grace_s=args.detach_grace,
        stream_flush_ms=args.stream_flush_ms,
        journal_gather_ms=args.journal_gather_ms,
        decode_mux=args.decode_mux,
        call_mux=args.call_mux,
        placement_sample=args.placement_sample,
        prices=prices,
        transfer_usd_per_gb=args.transfer_usd_per_gb,
        kv_dtype=KvPolicy(args.kv_dtype),
        admission=admission,
        routing=RoutingPolicy(enabled=args.kv_routing == "on", suffix_only=args.kv_suffix == "on"),
    )


async def run(args: argparse.Namespace) -> int:
    from grpc_health.v1 import _async as health_aio  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    from orchestrator.control.clients import WorkerClients  # noqa: PLC0415
    from orchestrator.control.metrics import ControlMetrics  # noqa: PLC0415
    from orchestrator.control.orchestrator import Orchestrator  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415
    from orchestrator.rpc.many import ManyCalls  # noqa: PLC0415
    from orchestrator.rpc.service import server as rpc_server  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415

    try:
        settings = control_settings(args)
    except ConfigError as exc:
        print(f"pdorch orchestrator: {exc}", file=sys.stderr)
        return 2
    preflight(args)
    tokens = _tokens(args)
    tls = _tls(args)
    serving = server_settings(args)
    store = RedisStore(StoreSettings(url=args.redis, outage_s=args.store_outage))
    clients = WorkerClients(tls)
    metrics = ControlMetrics()
    control = Orchestrator(store, clients, settings, owner=args.replica_id, metrics=metrics)
    metrics_server = serve_metrics(metrics.registry, serving.host, serving.metrics_port)
    required = tls is not None and args.client_cert == "required"
    many_calls = ManyCalls()
    server = rpc_server(control, SERVER_OPTIONS, tokens, client_certs=required, calls=many_calls)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = _listen(server, serving.address, tls, required)
    http = _gateway(args, control, tokens, tls) if args.http_port is not None else None
    await server.start()
    await control.start()
    gc_tuning.tune(args.gc_threshold)  # start-up is over: what it built lives on
    try:
        if http is not None:
            await http.start()  # before SERVING: a ready orchestrator serves both
            print(f"gateway {args.replica_id} ready on {http.url}/v1", flush=True)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        print(
            f"orchestrator {args.replica_id} ready on {serving.host}:{port} "
            f"(event loop {event_loop.running()})",
            flush=True,
        )
        await until_signalled()
    finally:
        await health.enter_graceful_shutdown()
        many_calls.drain()  # GenerateMany calls take no new request, end with their last
        await _stop_fronts(server, http, serving.drain_grace_s)
        await control.stop()
        await clients.close()
        await store.close()
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


async def _stop_fronts(server: grpc.aio.Server, http: HttpServer | None, grace_s: float) -> None:
    """Both fronts stop accepting and drain their streams side by side."""
    stopping = [server.stop(grace_s)]
    if http is not None:
        stopping.append(http.stop())
    await asyncio.gather(*stopping)


def _tokens(args: argparse.Namespace) -> TokenFile | None:
    """The tokens file (re-read on SIGHUP too), or None after one loud warning."""
    from orchestrator.control.tokens import TokenFile  # noqa: PLC0415

    if args.api_key and args.api_key != os.environ.get(API_KEY_ENV):
        log.warning(
            "--api-key on the command line is visible to every user of this host: "
            "use $%s or --tokens-file",
            API_KEY_ENV,
        )
    if not args.tokens_file:
        log.warning(UNAUTHENTICATED_WARNING)
        return None
    if args.api_key:
        raise CommandError(
            "--tokens-file and --api-key exclude each other: list the key's "
            "SHA-256 in the tokens file"
        )
    tokens = TokenFile(args.tokens_file)  # ConfigError: does not start on a bad file
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, tokens.reload)
    return tokens


def _listen(server: grpc.aio.Server, address: str, tls: Tls | None, required: bool) -> int:
    """Add the client API's port: TLS with ``tls`` (client certificates verified when
    presented; ``required``: always), else plaintext."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials(require_client_cert=required))


def _tls(args: argparse.Namespace) -> Tls | None:
    """The orchestrator identity's credentials (client API, calls to workers), or None
    (plaintext) after one loud warning."""
    from orchestrator.api.tls import Tls  # noqa: PLC0415
    from orchestrator.core.peers import Role  # noqa: PLC0415

    directory = server_tls_dir(args, "the orchestrator (client API, calls to workers)")
    return Tls.load(directory, Role.ORCHESTRATOR.identity) if directory else None


def _gateway(
    args: argparse.Namespace, control: Orchestrator, tokens: TokenFile | None, tls: Tls | None
) -> HttpServer:
    """The OpenAI-compatible gateway over this process's orchestrator (the `gateway` extra)."""
    try:
        from orchestrator.gateway.app import Gateway  # noqa: PLC0415 - imports starlette
        from orchestrator.gateway.server import HttpServer, ServedTls  # noqa: PLC0415 - uvicorn
    except ImportError as exc:
        raise SystemExit(
            f"pdorch orchestrator --http-port needs the gateway extra "
            f"(pip install 'pdorch[gateway]'): {exc}"
        ) from exc
    from orchestrator.gateway.backend import OrchestratorBackend  # noqa: PLC0415
    from orchestrator.gateway.settings import GatewaySettings  # noqa: PLC0415

    app = Gateway(OrchestratorBackend(control), GatewaySettings(api_key=args.api_key), tokens).app
    served = None
    if tls is not None and not args.http_plain:
        served = ServedTls(*tls.ssl_files(), client_cert_required=args.client_cert == "required")
    return HttpServer(app, args.http_host or args.host, args.http_port, args.drain_grace, served)
