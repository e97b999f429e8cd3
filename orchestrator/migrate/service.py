"""What `pdorch migrate` runs: the proxy until told to stop, the status, the report."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from orchestrator import errors
from orchestrator.gateway.server import HttpServer
from orchestrator.migrate import plots, report
from orchestrator.migrate.control import Control
from orchestrator.migrate.proxy import Proxy
from orchestrator.migrate.settings import MigrationSettings, parse_listen
from orchestrator.migrate.state import MigrationState
from orchestrator.store.url import redacted

log = logging.getLogger(__name__)


async def serve(settings: MigrationSettings, redis_url: str, stop: asyncio.Event) -> None:
    """Run the proxy on ``settings.listen`` until ``stop`` is set, then stop in phases: stop
    accepting and let answers finish (``drain_grace_s``), let shadow calls finish, flush
    samples to Redis. A bad ``listen`` raises ConfigError; one that cannot be bound, OSError."""
    host, port = parse_listen(settings.listen)
    state = MigrationState(redis_url, settings.name)
    control = Control(settings, state)
    proxy = Proxy(control)
    try:
        server = HttpServer(proxy.app, host, port, settings.drain_grace_s)
        # Listen first: a proxy that cannot (its port taken, say by the migration's running
        # proxy) must leave the migration's settings in Redis as they are — writing them
        # first let a failed start change a live canary's share, mode and upstreams.
        await server.start()
        try:
            await control.start()
            log.info(
                "migration %s (%s) listening on %s: existing %s, pdorch %s",
                settings.name, settings.mode, server.url,
                redacted(settings.upstreams.existing), redacted(settings.upstreams.pdorch),
            )  # fmt: skip
            print(f"pdorch migrate {settings.mode}: listening on {server.url}", flush=True)
            await stop.wait()
        finally:
            await server.stop()
    finally:
        await proxy.stop()
        await control.stop()
        await state.close()


async def status(redis_url: str, name: str) -> dict[str, Any]:
    state = MigrationState(redis_url, name)
    try:
        return (await state.snapshot()).to_dict()
    finally:
        await state.close()


async def set_percent(redis_url: str, name: str, percent: float) -> None:
    if not (0.0 <= percent <= 100.0):
        raise errors.ConfigError("--percent", f"must be in [0, 100], got {percent}")
    state = MigrationState(redis_url, name)
    try:
        await state.set_percent(percent)
    finally:
        await state.close()


async def write_report(redis_url: str, name: str, out: Path) -> report.Summary:
    """Render the report to ``out`` (``.md`` or ``.html``), plots beside it."""
    if out.suffix not in (".md", ".html"):
        raise errors.ConfigError("--out", f"must end in .md or .html, got {str(out)!r}")
    state = MigrationState(redis_url, name)
    try:
        snap = await state.snapshot()
        samples = await state.samples()
    finally:
        await state.close()
    summary = report.summarize(name, snap.config, samples, snap.rollbacks)
    try:
        await asyncio.to_thread(out.parent.mkdir, parents=True, exist_ok=True)
        figures = await asyncio.to_thread(plots.draw, samples, snap.rollbacks, out.parent, out.stem)
        text = (
            report.markdown(summary, figures)
            if out.suffix == ".md"
            else report.html_page(summary, figures)
        )
        await asyncio.to_thread(out.write_text, text, encoding="utf-8")
    except OSError as exc:
        raise errors.ConfigError("--out", f"cannot write {out}: {exc}") from exc
    return summary


def format_status(snap: dict[str, Any]) -> str:
    """`pdorch migrate status` for people."""
    up = snap.get("upstreams", {})
    lim = snap.get("limits", {})
    c = snap.get("counters", {})
    lines = [
        f"migration {snap['name']}: mode {snap.get('mode')}, "
        + (
            f"pdorch share {snap.get('percent', 0):g}%"
            if snap.get("mode") == "canary"
            else f"shadow sample {snap.get('sample', 0):g}"
        ),
        f"  existing {up.get('existing', '?')}   pdorch {up.get('pdorch', '?')}",
        f"  limits: error rate {lim.get('max_error_rate')}, TTFT p99 "
        f"{_limit_ms(lim.get('max_ttft_p99_ms'))}, TPOT p99 "
        f"{_limit_ms(lim.get('max_tpot_p99_ms'))}, window {lim.get('window')} "
        f"(min {lim.get('min_samples')})",
    ]
    for path in ("existing", "pdorch"):
        w = snap.get("windows", {}).get(path)
        line = (f"  {path:8s} requests {c.get(f'requests:{path}', 0)}, "
                f"failures {c.get(f'failures:{path}', 0)}")  # fmt: skip
        if w:

            def ms(v: Any) -> str:
                return "—" if v is None else f"{v:.0f}"

            line += (
                f"; window n={w['count']} errors {w['error_rate']:.1%} TTFT p50/p99 "
                f"{ms(w['ttft_p50_ms'])}/{ms(w['ttft_p99_ms'])} ms TPOT p99 "
                f"{ms(w['tpot_p99_ms'])} ms"
            )
        lines.append(line)
    if c.get("shadow_skipped"):
        lines.append(f"  shadow requests skipped (too many in flight): {c['shadow_skipped']}")
    lines.append(f"  samples kept: {snap.get('samples', 0)}")
    rollbacks = snap.get("rollbacks", [])
    lines.append(f"  rollbacks: {len(rollbacks)}")
    lines += [f"    {r['percent_before']:g}% -> 0%: {r['reason']}" for r in rollbacks[-5:]]
    return "\n".join(lines)


def _limit_ms(value: Any) -> str:
    """A latency limit as status shows it: ``1500 ms``, or ``off`` for 0 (no limit)."""
    return f"{value:g} ms" if value else "off"
