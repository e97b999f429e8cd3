"""`pdorch status`: what a cluster is doing — the orchestrator's health, each pool's workers
with their load and KV room, and the requests in flight — read from the orchestrator's gRPC
health service and the workers' heartbeats in Redis. Exits 1 when the orchestrator does not
serve or no worker is alive, so scripts can wait on it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from orchestrator.cli.common import (
    CommandError,
    Commands,
    Parents,
    add_command,
    check_redis,
    client_tls,
)

NAME = "status"
HELP = "the cluster's orchestrator, workers, pools and requests in flight"

HEALTH_TIMEOUT_S = 2.0

if TYPE_CHECKING:
    from orchestrator.api.tls import Tls


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: str
    role: str
    address: str
    model: str
    gpu_kind: str
    active: int
    kv_used_bytes: int
    kv_capacity_bytes: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    orchestrator: str
    health: str
    """SERVING, NOT_SERVING, or UNREACHABLE (no answer within `HEALTH_TIMEOUT_S`)."""
    redis: str
    workers: tuple[WorkerRow, ...]
    in_flight: int

    @property
    def healthy(self) -> bool:
        return self.health == "SERVING" and bool(self.workers)


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    s = add_command(
        sub,
        NAME,
        parents,
        parents.orchestrator,
        parents.cluster_redis,
        parents.client_tls,
        parents.json,
        help=HELP,
        description="The orchestrator's health, the workers alive in each pool (from their "
        "heartbeats in Redis), and the requests not yet finished. Exits 1 when the "
        "orchestrator does not serve or no worker is alive.",
    )
    s.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    check_redis(args.redis)  # a refused password, said as Redis says it (not "unreachable")
    snap = await snapshot(args.orchestrator, args.redis, client_tls(args))
    print(
        json.dumps(asdict(snap) | {"healthy": snap.healthy}) if args.json else format_status(snap)
    )
    return 0 if snap.healthy else 1


async def snapshot(orchestrator: str, redis_url: str, tls: Tls | None = None) -> Snapshot:
    from orchestrator.errors import UnavailableError  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.store.url import redacted  # noqa: PLC0415

    store = RedisStore(StoreSettings(url=redis_url))
    try:
        infos = await store.workers()
        active = await store.active()
    except UnavailableError as exc:
        raise CommandError(f"--redis {redacted(redis_url)}: {exc}") from None
    finally:
        await store.close()
    rows = tuple(
        WorkerRow(
            w.worker_id,
            w.role,
            w.address,
            w.model,
            w.gpu_kind,
            w.active,
            w.kv_used_bytes,
            w.kv_capacity_bytes,
        )
        for w in sorted(infos, key=lambda w: (w.role != "prefill", w.worker_id))
    )
    health = await _health(orchestrator, tls)
    return Snapshot(orchestrator, health, redacted(redis_url), rows, len(active))


async def _health(address: str, tls: Tls | None) -> str:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    from orchestrator.rpc.client import channel as client_channel  # noqa: PLC0415

    async with client_channel(address, tls=tls) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def pools(workers: Sequence[WorkerRow]) -> dict[str, tuple[int, int, int, int]]:
    """Role -> (workers, sequences active, KV bytes used, KV bytes of room)."""
    out: dict[str, tuple[int, int, int, int]] = {}
    for w in workers:
        n, active, used, room = out.get(w.role, (0, 0, 0, 0))
        out[w.role] = (n + 1, active + w.active, used + w.kv_used_bytes, room + w.kv_capacity_bytes)
    return out


def format_status(snap: Snapshot) -> str:
    lines = [
        f"orchestrator  {snap.orchestrator}  {snap.health}",
        f"redis         {snap.redis}",
        f"requests in flight: {snap.in_flight}",
        "",
        f"{'pool':10s}{'workers':>8s}{'active':>8s}{'KV used MiB':>13s}{'of MiB':>10s}",
    ]
    by_role = pools(snap.workers)
    for role in ("prefill", "decode"):
        n, active, used, room = by_role.get(role, (0, 0, 0, 0))
        flag = "" if n else "   <- no worker alive"
        lines.append(f"{role:10s}{n:>8d}{active:>8d}{_mib(used):>13s}{_mib(room):>10s}{flag}")
    wid = max([len("worker"), *(len(w.worker_id) for w in snap.workers)]) + 2
    addr = max([len("address"), *(len(w.address) for w in snap.workers)]) + 2
    mod = max([len("model"), *(len(w.model) for w in snap.workers)]) + 2
    lines += ["", f"{'worker':{wid}s}{'role':9s}{'address':{addr}s}{'model':{mod}s}{'gpu':6s}"
              f"{'active':>7s}{'KV used MiB':>13s}"]  # fmt: skip
    for w in snap.workers:
        lines.append(
            f"{w.worker_id:{wid}s}{w.role:9s}{w.address:{addr}s}{w.model:{mod}s}{w.gpu_kind:6s}"
            f"{w.active:>7d}{_mib(w.kv_used_bytes):>13s}"
        )
    if not snap.workers:
        lines.append("(no worker has a live heartbeat in this Redis)")
    return "\n".join(lines)
