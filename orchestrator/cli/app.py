"""The `pdorch` parser, built from the command modules, and `main`: parse, set up logging,
run the chosen command (a plain ``call``, or an async ``run`` in a fresh event loop).

`main` builds only the chosen command's parser: a first pass with every command as a bare
name finds it. Building a command's parser imports the settings its defaults come from (the
worker's, the control plane's: grpc, redis), so `pdorch plan` stays as quick to start as it
was; `build_parser()` without ``only`` builds them all (tests, documentation).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol, cast

from orchestrator.cli import (
    bench,
    certs,
    chaos,
    cost,
    demo,
    down,
    event_loop,
    generate,
    log_file,
    migrate,
    operator,
    orchestrator,
    plan,
    status,
    up,
    worker,
)
from orchestrator.cli.common import (
    CommandError,
    Commands,
    Parents,
    Parser,
    add_logging_flags,
    resolve_redis,
)

DESCRIPTION = """pdorch: prefill/decode disaggregated LLM serving.

Prompts are prefilled on one pool of workers, their KV cache moved (UCX or TCP) to a decode
worker, and the tokens streamed back through an orchestrator that survives worker, Redis and
orchestrator failures. Start here: `pdorch up` brings a local cluster up and prints what to
run next; `pdorch demo` runs a few prompts through one and checks them.
"""

EPILOG = """Flags after a command (pdorch COMMAND --help) are that command's; --log-level,
--log-format and --debug go before or after it. Exit status: 0 success, 1 failure, 2 usage error.
"""


class Command(Protocol):
    """What a command module provides (`orchestrator.cli.worker`, ...)."""

    NAME: str
    HELP: str

    def register(self, sub: Commands, parents: Parents, env: Mapping[str, str]) -> None: ...


COMMANDS: tuple[Command, ...] = (
    up,
    status,
    down,
    generate,
    cost,
    demo,
    orchestrator,
    worker,
    operator,
    chaos,
    migrate,
    bench,
    certs,
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
    p = Parser(
        prog="pdorch",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    add_logging_flags(p, env, top=True)
    # Every command's parser is a `Parser` too (argparse makes them of the parent's class).
    sub = cast(Commands, p.add_subparsers(dest="command", required=True))
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
    """Run the command ``argv`` names. A failure a user can cause (a bad flag, an unreachable
    Redis, a port in use) ends in one line on stderr and a non-zero exit; ``--debug`` adds the
    traceback."""
    args = build_parser(only=_chosen(argv)).parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    log_file.follow(os.environ)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        resolve_redis(args, os.environ)
        if getattr(args, "call", None) is not None:
            return int(args.call(args))
        loop = _loop(args)
        if getattr(args, "profile", ""):
            return _profiled(args, loop)
        return int(event_loop.run(args.run(args), loop))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        message = failure(exc)
        if message is None or args.debug:
            raise
        print(f"pdorch {args.command}: {message}", file=sys.stderr)
        return 1


def failure(exc: BaseException) -> str | None:
    """The one-line message for an error a user can cause; None for a bug (re-raised: its
    traceback is what a bug report needs)."""
    from orchestrator.cluster import ClusterError  # noqa: PLC0415
    from orchestrator.errors import PdorchError  # noqa: PLC0415

    if isinstance(exc, CommandError):
        return str(exc)
    if isinstance(exc, PdorchError | ClusterError | OSError):
        first = (str(exc) or type(exc).__name__).splitlines()[0]
        return f"{first} (--debug shows where)"
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("pdorch")
    except PackageNotFoundError:
        return "unknown"


def _loop(args: argparse.Namespace) -> str:
    """The event loop ``args``' command runs on: a command with ``--loop`` (a server) gets
    `event_loop.choose`'s; the others, asyncio's."""
    if not hasattr(args, "loop"):
        return event_loop.ASYNCIO
    return event_loop.choose(args.loop, args.preferred_loop)


def _profiled(args: argparse.Namespace, loop: str) -> int:
    """Run a server command under cProfile; the stats go to ``--profile`` when it exits."""
    import cProfile  # noqa: PLC0415

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return int(event_loop.run(args.run(args), loop))
    finally:
        profiler.disable()
        profiler.dump_stats(args.profile)
