"""The `pdorch` parser, built from the command modules, and `main`: parse, set up logging,
run the chosen command (a plain ``call``, or an async ``run`` in a fresh event loop).

`main` builds only the chosen command's parser: a first pass with every command as a bare
name finds it. Building a command's parser imports the settings its defaults come from (the
worker's, the control plane's: grpc, redis), so `pdorch plan` stays as quick to start as it
was; `build_parser()` without ``only`` builds them all (tests, documentation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

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
from orchestrator.cli.common import Commands, Parents, add_logging_flags

DESCRIPTION = """`pdorch` command line: the composition root.

The only module that reads the environment and picks concrete parts (the Redis store, the
UCX or TCP transport, the engine) and wires them together.
"""


class Command(Protocol):
    """What a command module provides (`orchestrator.cli.worker`, ...)."""

    NAME: str
    HELP: str

    def register(self, sub: Commands, parents: Parents, env: Mapping[str, str]) -> None: ...


COMMANDS: tuple[Command, ...] = (
    orchestrator,
    worker,
    operator,
    generate,
    demo,
    cost,
    chaos,
    migrate,
    bench,
    plan,
)
"""In the order `pdorch --help` lists them."""

ALL = None
NAMES_ONLY = ""


def build_parser(
    env: Mapping[str, str] | None = None, only: str | None = ALL
) -> argparse.ArgumentParser:
    """The parser of every command, or with ``only``, of that command alone: the others are
    bare names (listed by ``--help``, taking any arguments)."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(prog="pdorch", description=DESCRIPTION)
    add_logging_flags(p, env, top=True)
    sub = p.add_subparsers(dest="command", required=True)
    shared = Parents(env)
    for command in COMMANDS:
        if only is ALL or only == command.NAME:
            command.register(sub, shared, env)
        else:
            sub.add_parser(command.NAME, help=command.HELP, add_help=False)
    return p


def _chosen(argv: Sequence[str] | None) -> str:
    """The command ``argv`` names (usage errors and the top-level ``--help`` exit here)."""
    known, _rest = build_parser(only=NAMES_ONLY).parse_known_args(argv)
    return str(known.command)


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
    args = build_parser(only=_chosen(argv)).parse_args(argv)
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
