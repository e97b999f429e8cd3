"""`pdorch down`: stop the cluster a running `pdorch up` started (found by its state file)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Mapping

from orchestrator.cli.common import CommandError, Commands, Parents, add_command, positive_float
from orchestrator.cli.state import alive, read_state, state_path

NAME = "down"
HELP = "stop the cluster `pdorch up` started"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    d = add_command(
        sub,
        NAME,
        parents,
        help=HELP,
        description=f"Send SIGTERM to the `pdorch up` named in {state_path(env)} "
        "($PDORCH_STATE) and wait until it has stopped its processes.",
    )
    d.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="seconds to wait for it to stop (default %(default)s)",
    )
    d.set_defaults(call=lambda args: run(args, env))


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    state = read_state(env)
    if state is None:
        raise CommandError(f"no `pdorch up` cluster is running (no live one in {state_path(env)})")
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while alive(state.pid):
        if time.monotonic() > deadline:
            raise CommandError(
                f"`pdorch up` (pid {state.pid}) still running after {args.timeout:g} s; "
                f"its logs: {state.logs}"
            )
        time.sleep(0.1)  # polling a process's exit with a deadline
    print(f"stopped the cluster of pid {state.pid} ({state.orchestrator})")
    return 0
