"""`pdorch cost`: per-tenant totals of what finished requests cost (kept in Redis by the
orchestrators)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from orchestrator.cli.common import Commands, Parents, add_command

NAME = "cost"
HELP = "what each tenant's requests cost so far"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    co = add_command(sub, NAME, parents, parents.redis, parents.json, help=HELP)
    co.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
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
