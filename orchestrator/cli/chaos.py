"""`pdorch chaos`: list the shipped failover scenarios, or run one on a local cluster and
check its history."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import (
    Commands,
    Parents,
    add_command,
    positive_float,
    positive_int,
    redis_url,
)
from orchestrator.cli.progress import Progress
from transport.backend_names import BACKENDS

TRANSPORTS = ("auto", *BACKENDS)
"""`orchestrator.chaos.scenario.TRANSPORTS` (not imported at parse time: it loads the
scenarios' parser; a unit test keeps the two equal)."""

NAME = "chaos"
HELP = "chaos-test failover on a local cluster"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    c = add_command(sub, NAME, parents, help=HELP)
    csub = c.add_subparsers(dest="chaos_command", required=True)
    cl = add_command(csub, "list", parents, help="list the shipped scenarios")
    cl.set_defaults(call=_list)
    cr = add_command(
        csub,
        "run",
        parents,
        parents.json,
        parents.model_cache,
        help="run a scenario (shipped name or YAML file) and check it",
    )
    cr.add_argument(
        "scenario", help="a shipped scenario's name (`pdorch chaos list`) or a YAML file"
    )
    cr.add_argument("--seed", type=int, default=0, help="run i uses seed + i for its faults")
    cr.add_argument("--runs", type=positive_int, default=1, help="runs, each on a fresh cluster")
    cr.add_argument(
        "--redis",
        type=redis_url,
        default=None,
        help="run on this Redis (redis+cluster://…, redis+sentinel://…, redis://…) instead of "
        "a redis-server of the cluster's own; scenarios that fault Redis refuse it",
    )
    cr.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="run the scenario with workers on this KV transport (auto: ucx where UCXX is "
        "installed, else tcp) instead of its cluster.transport (default: the scenario's)",
    )
    cr.add_argument(
        "--late-bound",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="a fault executed more than this after it was due fails the run (default: the "
        "scenario's late_bound_s, 0.5 s); on a loaded machine the runner itself runs late",
    )
    cr.add_argument(
        "--out",
        default="",
        help="folder for histories and timelines (default: chaos-out/SCENARIO, ignored by git)",
    )
    cr.set_defaults(call=_run)


def _list(args: argparse.Namespace) -> int:
    from orchestrator.chaos.scenario import ScenarioError, load, shipped  # noqa: PLC0415

    for name, path in sorted(shipped().items()):
        try:
            description = load(str(path)).description
        except ScenarioError as exc:
            description = f"(invalid: {exc})"
        print(f"{name:24s} {description}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace  # noqa: PLC0415

    from orchestrator.chaos.runner import check_runnable, run_chaos  # noqa: PLC0415
    from orchestrator.chaos.scenario import (  # noqa: PLC0415
        MIN_LATE_BOUND_S,
        ScenarioError,
        load,
        with_transport,
    )

    try:
        scenario = load(args.scenario)
        if args.transport is not None:
            scenario = with_transport(scenario, args.transport)
        if args.late_bound is not None:
            if args.late_bound < MIN_LATE_BOUND_S:
                raise ScenarioError(f"--late-bound: at least {MIN_LATE_BOUND_S} s")
            scenario = replace(scenario, late_bound_s=args.late_bound)
        check_runnable(scenario, seed=args.seed, runs=args.runs, redis=args.redis or "")
        if args.out:
            _out_folder(Path(args.out))
    except ScenarioError as exc:  # refused before the run is announced
        print(f"pdorch chaos: {exc}", file=sys.stderr)
        return 2
    progress = Progress(quiet=args.json)
    progress.say(
        f"chaos {scenario.name}: {args.runs} run(s) on a fresh local cluster "
        "(a minute or more each on the reference engine)"
    )
    return run_chaos(
        scenario,
        seed=args.seed,
        runs=args.runs,
        out_dir=Path(args.out) if args.out else None,
        model_cache=Path(args.model_cache) if args.model_cache else None,
        as_json=args.json,
        steps=progress.step,
        redis=args.redis or "",
    )


def _out_folder(out: Path) -> None:
    """Create ``--out`` (a folder: the runs' histories and timelines go in it) or raise
    `ScenarioError` saying why it cannot be one."""
    from orchestrator.chaos.scenario import ScenarioError  # noqa: PLC0415

    if out.exists() and not out.is_dir():
        raise ScenarioError(f"--out {out}: must be a folder, and it is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = f"must be a folder, and cannot be created: {exc.strerror or exc}"
        raise ScenarioError(f"--out {out}: {why}") from None
