"""`pdorch migrate`: move an OpenAI service's traffic onto pdorch — the shadow and canary
proxies, and status, percent and report over a migration's state in Redis.

The proxies' flags fill `MigrationSettings` (with its `Upstreams`, `Limits` and `Pricing`);
their defaults are those dataclasses' field defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import TOKEN_ENV, Commands, Parents, add_command, default, field_doc
from orchestrator.errors import PdorchError
from orchestrator.migrate.settings import Limits, MigrationSettings, Pricing, Upstreams

_MODES = (
    ("shadow", "answer from the existing service; mirror a sample to pdorch and compare"),
    ("canary", "answer a share of requests from pdorch; roll back when it breaks limits"),
)


NAME = "migrate"
HELP = "move an OpenAI service's traffic onto pdorch: shadow, canary, status, report"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    m = add_command(
        sub,
        NAME,
        parents,
        help=HELP,
        description="A proxy in front of the existing OpenAI-compatible service and pdorch; "
        "see README 'Migration'.",
    )
    msub = m.add_subparsers(dest="migrate_command", required=True)

    def command(name: str, text: str, *uses: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p = add_command(msub, name, parents, parents.redis, *uses, help=text)
        p.add_argument("--name", required=True, help="the migration's name (Redis keys)")
        return p

    for mode, text in _MODES:
        _proxy_flags(command(mode, text), mode)
    st = command("status", "mode, share, counters, windows and rollbacks", parents.json)
    st.set_defaults(call=_status)
    pc = command("percent", "set a canary's share by hand (e.g. after a rollback)")
    pc.add_argument("--percent", type=float, required=True, help="share to pdorch (%%)")
    pc.set_defaults(call=_percent)
    rp = command("report", "Markdown or HTML report with plots")
    rp.add_argument("--out", required=True, help="report.md or report.html (plots beside it)")
    rp.set_defaults(call=_report)


def _proxy_flags(p: argparse.ArgumentParser, mode: str) -> None:
    p.add_argument("--existing", required=True, help="the existing service's base URL")
    p.add_argument("--pdorch", required=True, help="pdorch's gateway base URL")
    p.add_argument(
        "--listen", default=default(MigrationSettings, "listen"), help="HOST:PORT the proxy serves"
    )
    if mode == "shadow":
        p.add_argument(
            "--sample",
            type=float,
            default=default(MigrationSettings, "sample"),
            help="share mirrored (0..1)",
        )
    else:
        p.add_argument("--percent", type=float, required=True, help="share to pdorch (%%)")
    p.add_argument(
        "--max-error-rate",
        type=float,
        default=default(Limits, "max_error_rate"),
        help=field_doc(Limits, "max_error_rate", "roll back above this share of errors"),
    )
    p.add_argument(
        "--max-ttft-p99-ms",
        type=float,
        default=default(Limits, "max_ttft_p99_ms"),
        help="0: no limit",
    )
    p.add_argument(
        "--max-tpot-p99-ms",
        type=float,
        default=default(Limits, "max_tpot_p99_ms"),
        help="0: no limit",
    )
    p.add_argument(
        "--window", type=int, default=default(Limits, "window"), help="pdorch requests judged"
    )
    p.add_argument(
        "--min-samples",
        type=int,
        default=default(Limits, "min_samples"),
        help="judge only from this many",
    )
    p.add_argument(
        "--pdorch-api-key",
        default=os.environ.get(TOKEN_ENV, default(Upstreams, "pdorch_api_key")),
        help="bearer token for pdorch's gateway (default: $PDORCH_TOKEN, else the client's "
        "own Authorization); prefer the variable: arguments are visible to every user",
    )
    p.add_argument(
        "--existing-usd-per-1k-tokens",
        type=float,
        default=default(Pricing, "usd_per_1k_tokens"),
        help=field_doc(Pricing, "usd_per_1k_tokens", "the existing service's price per 1k tokens"),
    )
    p.add_argument(
        "--existing-usd-per-hour",
        type=float,
        default=default(Pricing, "usd_per_hour"),
        help=field_doc(Pricing, "usd_per_hour", "the existing service's price per hour"),
    )
    p.add_argument(
        "--shadow-concurrency",
        type=int,
        default=default(MigrationSettings, "shadow_concurrency"),
        help=field_doc(MigrationSettings, "shadow_concurrency"),
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=default(MigrationSettings, "max_samples"),
        help="samples kept in Redis",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=default(Upstreams, "connect_timeout_s"),
        help=field_doc(Upstreams, "connect_timeout_s", "seconds to connect to an upstream"),
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=default(Upstreams, "read_timeout_s"),
        help="S between bytes",
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        default=default(MigrationSettings, "drain_grace_s"),
        help=field_doc(MigrationSettings, "drain_grace_s"),
    )
    p.set_defaults(run=_serve)


def migration_settings(args: argparse.Namespace, mode: str) -> MigrationSettings:
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
        listen=args.listen,
        drain_grace_s=args.drain_grace,
    )


async def _serve(args: argparse.Namespace) -> int:
    """`pdorch migrate shadow|canary`: the migration proxy until SIGTERM/SIGINT."""
    from orchestrator.migrate import service  # noqa: PLC0415 - imports the HTTP stack

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.serve(migration_settings(args, args.migrate_command), args.redis, stop)
    except PdorchError as exc:
        print(f"pdorch migrate {args.migrate_command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdorch migrate {args.migrate_command}: cannot listen on {args.listen}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _status(args: argparse.Namespace) -> int:
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        snap = asyncio.run(service.status(args.redis, args.name))
    except PdorchError as exc:
        print(f"pdorch migrate status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(snap, sort_keys=True) if args.json else service.format_status(snap))
    return 0


def _percent(args: argparse.Namespace) -> int:
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        asyncio.run(service.set_percent(args.redis, args.name, args.percent))
    except PdorchError as exc:
        print(f"pdorch migrate percent: {exc}", file=sys.stderr)
        return 1
    print(f"migration {args.name}: pdorch share set to {args.percent:g}%")
    return 0


def _report(args: argparse.Namespace) -> int:
    from orchestrator.migrate import service  # noqa: PLC0415

    try:
        summary = asyncio.run(service.write_report(args.redis, args.name, Path(args.out)))
    except PdorchError as exc:
        print(f"pdorch migrate report: {exc}", file=sys.stderr)
        return 1
    answers = sum(p.requests for p in summary.paths)
    print(f"wrote {args.out} ({answers} answers, {len(summary.rollbacks)} rollbacks)")
    return 0
