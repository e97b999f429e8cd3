"""`pdorch down`: stop the cluster a running `pdorch up` started (found by its state file)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections.abc import Mapping

from orchestrator.cli.common import CommandError, Commands, Parents, add_command, positive_float
from orchestrator.cli.state import (
    ClusterState,
    leftovers,
    live_state,
    ours,
    remove_state,
    stale_state,
    state_path,
    still_running,
)
from orchestrator.procs import alive

NAME = "down"
HELP = "stop the cluster `pdorch up` started"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    d = add_command(
        sub,
        NAME,
        parents,
        help=HELP,
        description=f"Send SIGTERM to the `pdorch up` named in {state_path(env)} "
        "($PDORCH_STATE) and wait until it has stopped its processes. When that `pdorch up` "
        "was killed and left them running, stop them (SIGTERM, then SIGKILL).",
    )
    d.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="seconds to wait for it to stop (default %(default)s)",
    )
    d.set_defaults(call=lambda args: run(args, env))


def run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    state = live_state(env)
    if state is None:
        left = stale_state(env)
        if left is not None:
            stopped = _stop_leftovers(left, args.timeout)
            remove_state(env, left.pid)
            if stopped:
                print(
                    f"`pdorch up` (pid {left.pid}) was gone; stopped what it left running: "
                    + ", ".join(stopped)
                )
                return 0
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
    if state.ready:
        print(f"stopped the cluster of pid {state.pid} ({state.orchestrator})")
    else:
        print(f"stopped `pdorch up` (pid {state.pid}) while it was starting")
    return 0


def _stop_leftovers(state: ClusterState, timeout_s: float) -> list[str]:
    """Stop the processes a killed `pdorch up` left running — each one's process group (as
    `cluster.Proc.stop` does): SIGTERM, then SIGKILL to what is left after ``timeout_s``.
    Their names.

    Only what is still its own: a group while its leader is the process it started (pid and
    start time) or while no process has that pid — a worker killed alone (``kill -9``) has
    left its group running (a vLLM worker's engine core), and Linux reuses no pid that is
    still a group's id; a pid that another process has taken means the group is empty.
    A process leading no group (the Redis of an older `pdorch up`) is signalled alone,
    while it is the process it started."""

    def left(name: str) -> bool:
        return still_running(state, name)

    def signal_all(names: list[str], sig: int) -> None:
        for name in names:
            if not left(name):  # checked again each time: its pid may be reused meanwhile
                continue
            pid, start = state.procs[name]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
                continue
            if ours(pid, start):  # leading no group after all (a Redis of an older `up`)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    running = leftovers(state)
    signal_all(running, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(left(name) for name in running) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling their exits with a deadline (not our children)
    signal_all(running, signal.SIGKILL)  # what is left of each group
    return running
