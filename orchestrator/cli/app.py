"""The `pdorch` parser, built from the command modules, and `main`: parse, set up logging,
run the chosen command (a plain ``call``, or an async ``run`` in a fresh event loop)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from orchestrator.cli import (
    bench,
    chaos,
    cost,
    demo,
    generate,
    migrate,
    operator,
    orchestrator,
    plan,
    worker,
)
from orchestrator.cli.common import Commands, Parents, add_logging_flags, parents

DESCRIPTION = """`pdorch` command line: the composition root.

The only module that reads the environment and picks concrete parts (the Redis store, the
UCX or TCP transport, the engine) and wires them together.
"""

Register = Callable[[Commands, Parents, Mapping[str, str]], None]

COMMANDS: tuple[Register, ...] = (
    orchestrator.register,
    worker.register,
    operator.register,
    generate.register,
    demo.register,
    cost.register,
    chaos.register,
    migrate.register,
    bench.register,
    plan.register,
)
"""In the order `pdorch --help` lists them."""


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="pdorch", description=DESCRIPTION)
    add_logging_flags(p, env, top=True)
    sub = p.add_subparsers(dest="command", required=True)
    shared = parents(env)
    for register in COMMANDS:
        register(sub, shared, env)
    return p


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


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
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
