"""Pin a running process, every thread of it, to a set of cores (Linux).

``sched_setaffinity(pid)`` sets the mask of one thread only (the one whose id is ``pid``);
threads already running keep theirs. So, as ``taskset -a -p`` does, every thread listed in
``/proc/PID/task`` is pinned; threads created afterwards inherit their creator's mask.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


class PinError(Exception):
    """A process could not be pinned (gone, or this platform has no affinity)."""


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (what its children may be pinned to)."""
    if not hasattr(os, "sched_getaffinity"):
        raise PinError("this platform has no CPU affinity (Linux only)")
    return tuple(sorted(os.sched_getaffinity(0)))


def pin(pid: int, cores: Iterable[int]) -> None:
    """Restrict process ``pid`` (all its threads) to ``cores``."""
    mask = set(cores)
    try:
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError as exc:
        raise PinError(f"process {pid}: {exc}") from exc
    for tid in threads:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            raise PinError(f"process {pid} thread {tid}: {exc}") from exc
