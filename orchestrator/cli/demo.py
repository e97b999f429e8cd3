"""`pdorch demo`: start a local cluster (Redis, workers, an orchestrator) and run prompts
through it; with ``--serve``, keep it up behind the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import (
    ENGINES,
    Commands,
    Parents,
    add_command,
    check_engine,
    check_port_free,
    check_transport,
    port,
    positive_int,
)
from orchestrator.cli.progress import Progress

NAME = "demo"
HELP = "start a local cluster and run prompts through it"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    d = add_command(
        sub,
        NAME,
        parents,
        parents.model,
        parents.model_cache,
        parents.transport,
        parents.json,
        help=HELP,
    )
    d.add_argument(
        "--max-tokens",
        type=positive_int,
        default=32,
        help="tokens per prompt at most (default %(default)s)",
    )
    d.add_argument(
        "--serve",
        action="store_true",
        help="then keep the cluster up with the OpenAI-compatible gateway until Ctrl-C "
        "(`pdorch up` does this without the prompts)",
    )
    d.add_argument(
        "--http-port", type=port, default=0, help="--serve: gateway port (0: a free one)"
    )
    d.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help="the workers' engine (vllm: from the vllm extra's environment, --model smollm2; "
        "default %(default)s)",
    )
    d.set_defaults(call=run)


def run(args: argparse.Namespace) -> int:
    check_engine(args.engine, args.model)
    check_transport(args.transport)
    check_port_free("127.0.0.1", args.http_port, "--http-port")
    from orchestrator.demo import run_demo  # noqa: PLC0415

    return run_demo(
        model=args.model,
        transport=args.transport,
        as_json=args.json,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        max_tokens=args.max_tokens,
        serve=args.serve,
        http_port=args.http_port,
        engine=args.engine,
        step=Progress(quiet=args.json).step,
    )
