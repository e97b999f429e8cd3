"""A process's identity and its group's, read from the OS (Linux's ``/proc``): whether a pid
is taken or runs, when a process started, whether a process group has a member left.

`orchestrator.cluster` stops the process groups it started with them; `pdorch down`
(`orchestrator.cli.state`, `cli.down`) stops what a killed `pdorch up` left running — both
must tell a process they started from one that took its pid over since.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def pid_taken(pid: int) -> bool:
    """Whether a process (running, or a zombie) has pid ``pid``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one its parent has not reaped yet does not)."""
    if not pid_taken(pid):
        return False
    with contextlib.suppress(OSError, IndexError):  # Linux: state after "(comm)"
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return stat.rpartition(")")[2].split()[0] != "Z"
    return True


def started(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat``'s 22nd
    field): with its pid, a process's identity — a pid reused later starts later. 0 when
    it cannot be read (no such process; not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def group_runs(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` runs. A zombie does not count: the
    group's exited leader before it is reaped, or an orphan a container's init never
    reaps. Read from ``/proc`` (Linux); elsewhere any member counts."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return True
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
            state, _ppid, pgrp = stat.rpartition(")")[2].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                return True
    return False
