"""`pdorch cost`: per-tenant totals of what finished requests cost (kept in Redis by the
orchestrators)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from orchestrator.cli.common import CommandError, Commands, Parents, add_command, check_redis

NAME = "cost"
HELP = "what each tenant's requests cost so far"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    co = add_command(
        sub,
        NAME,
        parents,
        parents.cluster_redis,
        parents.json,
        help=HELP,
        description="Per-tenant totals the orchestrators keep in Redis: requests, USD, "
        "GPU-seconds per pool, KV moved, and the prompt tokens prefill workers found cached "
        "with what computing them would have cost (not billed). Exits 1 when that Redis "
        "holds none.",
    )
    co.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    from orchestrator.errors import UnavailableError  # noqa: PLC0415
    from orchestrator.store.redis_store import RedisStore, StoreSettings  # noqa: PLC0415
    from orchestrator.store.url import redacted  # noqa: PLC0415

    check_redis(args.redis)  # a refused password, said as Redis says it (not "unreachable")
    store = RedisStore(StoreSettings(url=args.redis))
    try:
        totals = await store.tenant_costs()
    except UnavailableError as exc:
        raise CommandError(f"--redis {redacted(args.redis)}: {exc}") from None
    finally:
        await store.close()
    if not totals:
        raise CommandError(
            f"no costs in the Redis at {redacted(args.redis)}: no request has finished there "
            "yet, or it is not the cluster's Redis (--redis, $PDORCH_REDIS_URL)"
        )
    if args.json:
        print(json.dumps(totals, sort_keys=True))
        return 0
    print(f"{'tenant':20s} {'requests':>9s} {'USD':>12s} {'USD/1k req':>11s} "
          f"{'prefill GPU-s':>14s} {'decode GPU-s':>13s} {'KV GB':>8s} "
          f"{'reused tok':>11s} {'saved USD':>12s}")  # fmt: skip
    for tenant, t in totals.items():
        n = t.get("requests", 0.0)
        usd, saved = t.get("usd", 0.0), t.get("reuse_saved_usd", 0.0)
        print(
            f"{tenant:20s} {n:9.0f} {_usd(usd, 12, 6)} {_usd(usd / n * 1000 if n else 0, 11, 4)} "
            f"{t.get('prefill_gpu_s', 0.0):14.2f} "
            f"{t.get('decode_gpu_s', 0.0) + t.get('aggregated_gpu_s', 0.0):13.2f} "
            f"{t.get('transfer_bytes', 0.0) / 1e9:8.3f} "
            f"{t.get('prefill_reused_tokens', 0.0):11.0f} {_usd(saved, 12, 6)}"
        )
    return 0


def _usd(value: float, width: int, places: int) -> str:
    """``value`` in ``places`` decimals, or in 3 significant digits where those decimals would
    show fewer (a few requests on CPU workers at $0.10/h cost 4e-7 USD, not 0.000000)."""
    if value == 0 or abs(value) >= 10 ** (2 - places):
        return f"{value:{width}.{places}f}"
    return f"{value:{width}.3g}"
