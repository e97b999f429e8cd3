"""What the command modules share: the parent parsers for flags several commands take
(each declared here once), argument types, a flag default read from a settings dataclass,
and the small pieces every server command runs (signals, the metrics endpoint).

Defaults come from the settings the flags fill (`default`), so a default lives in one place:
the dataclass field. The environment is read here and in the command modules only.

Settings modules are imported where a command's parser is built, not when this package is:
`pdorch plan` builds only the plan parser (`orchestrator.cli.app`) and never loads grpc,
redis or the worker code.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import signal
from collections.abc import Mapping
from typing import Any, TypeAlias

from orchestrator.errors import ConfigError

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``add_subparsers()`` returns: each command module adds its command to it."""

log = logging.getLogger("pdorch")

ENGINE_MODELS = ("tiny", "smollm2")
"""`orchestrator.workers.model_files.MODEL_NAMES`, which imports torch: not at parse time
(a unit test keeps the two equal)."""


def default(cls: type[Any], name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name`` (a default_factory called)."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise TypeError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


class Parents:
    """Parent parsers (``add_parser(parents=[...])``) for the flags several commands share,
    each built on first use: a command's parser reads only the settings it needs."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    @functools.cached_property
    def logging(self) -> argparse.ArgumentParser:
        """``--log-level``/``--log-format`` after a subcommand; every command takes them."""
        p = _parent()
        add_logging_flags(p, self._env, top=False)
        return p

    @functools.cached_property
    def json(self) -> argparse.ArgumentParser:
        p = _parent()
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    @functools.cached_property
    def redis(self) -> argparse.ArgumentParser:
        from orchestrator.store.redis_store import StoreSettings  # noqa: PLC0415 - imports redis

        p = _parent()
        p.add_argument(
            "--redis",
            default=self._env.get("PDORCH_REDIS_URL", default(StoreSettings, "url")),
            help="Redis URL (default: $PDORCH_REDIS_URL, else %(default)s)",
        )
        return p

    @functools.cached_property
    def model(self) -> argparse.ArgumentParser:
        """The engine's weights (workers, demo, precision bench) — not a performance preset."""
        p = _parent()
        p.add_argument("--model", choices=ENGINE_MODELS, default="smollm2")
        return p

    @functools.cached_property
    def model_cache(self) -> argparse.ArgumentParser:
        p = _parent()
        p.add_argument(
            "--model-cache",
            default=self._env.get("PDORCH_MODEL_CACHE", ""),
            help="where model weights are cached (default: $PDORCH_MODEL_CACHE, else the default)",
        )
        return p

    @functools.cached_property
    def transport(self) -> argparse.ArgumentParser:
        from transport.backends import BACKENDS  # noqa: PLC0415 - imports the UCX backend

        p = _parent()
        p.add_argument("--transport", choices=BACKENDS, default="ucx")
        return p


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def add_logging_flags(p: argparse.ArgumentParser, env: Mapping[str, str], *, top: bool) -> None:
    """``--log-level`` and ``--log-format``, on the top parser (``top``, with the defaults)
    and on every subcommand. A subcommand's copies default to SUPPRESS, so they override the
    top-level flags only when given: ``pdorch --log-level INFO worker`` and
    ``pdorch worker --log-level INFO`` mean the same."""
    p.add_argument(
        "--log-level",
        default=env.get("PDORCH_LOG_LEVEL", "WARNING") if top else argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING, ... (default: $PDORCH_LOG_LEVEL, else WARNING)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text" if top else argparse.SUPPRESS,
        help="text, or one JSON object a line (default: text)",
    )


def add_command(
    sub: Commands, name: str, parents: Parents, *uses: argparse.ArgumentParser, **kw: Any
) -> argparse.ArgumentParser:
    """``sub.add_parser(name)`` taking the shared flags in ``uses`` and the logging flags."""
    return sub.add_parser(name, parents=[*uses, parents.logging], **kw)


# ------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def price(text: str) -> tuple[str, float]:
    """``KIND=USD`` per GPU-hour."""
    from orchestrator.planning.planconfig import parse_price  # noqa: PLC0415

    try:
        return parse_price(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ----------------------------------------------------------------------- server plumbing


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def serve_metrics(registry: object, host: str, port: int) -> Any:
    """Prometheus ``/metrics`` on ``port`` (a daemon thread); None when port is 0."""
    if port <= 0:
        return None
    from prometheus_client import start_http_server  # noqa: PLC0415

    server, _thread = start_http_server(port, host, registry=registry)  # type: ignore[arg-type]
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
