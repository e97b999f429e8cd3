"""Free loopback ports for processes about to be started: the local cluster's workers and
orchestrators, the Redis launcher, tests. One registry, so no two callers get the same port.
"""

from __future__ import annotations

import collections
import os
import secrets
import socket
from pathlib import Path

_PORT_FLOOR = 20000
"""Ports handed out come from [this, the kernel's ephemeral range): clear of well-known
services below, and of ephemeral ports above."""
_recent_ports: collections.deque[int] = collections.deque(maxlen=4096)
SLICE_ENV = "PDORCH_PORT_SLICE"
"""``i/n``: hand out only ports ``p`` with ``p % n == i`` — for test runs in parallel
(pytest-xdist: tests/conftest.py gives each worker its own slice). Processes that pick
ports independently never pick the same one, even while one of them is down (a killed
orchestrator is restarted on its port: a parallel run once took it meanwhile)."""


def port_slice() -> tuple[int, int]:
    """(i, n) from `SLICE_ENV`; (0, 1), every port, when unset. ValueError when malformed."""
    raw = os.environ.get(SLICE_ENV, "")
    if not raw:
        return 0, 1
    i, _, n = raw.partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise ValueError(f"{SLICE_ENV}={raw!r}: want i/n with 0 <= i < n")
    return index, count


def free_port() -> int:
    """A loopback port free now, for a process about to be started to bind.

    It comes from below the kernel's ephemeral range: a port from bind(0) was free when
    picked but could be taken — by any bind(0) or outgoing connection on the machine —
    in the seconds before the child process bound it (seen in CI: a worker exited with
    "Address already in use"). Ports handed out recently are not handed out again, nor
    ports outside this process's slice (`SLICE_ENV`). `OSError` when none is found."""
    low = ephemeral_floor()
    index, count = port_slice()
    first = _PORT_FLOOR + (index - _PORT_FLOOR) % count  # the slice's first port
    choices = (low - first + count - 1) // count
    for _ in range(200):
        port = first + count * secrets.randbelow(choices) if choices > 1000 else 0
        if port in _recent_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _recent_ports.append(port)
        return port
    raise OSError("no free loopback port found")


def ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
