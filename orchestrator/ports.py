"""Free loopback ports for processes about to be started: the local cluster's workers and
orchestrators, the Redis launcher, tests. One registry, so no two callers get the same port.
"""

from __future__ import annotations

import collections
import secrets
import socket
from pathlib import Path

_PORT_FLOOR = 20000
"""Ports handed out come from [this, the kernel's ephemeral range): clear of well-known
services below, and of ephemeral ports above."""
_recent_ports: collections.deque[int] = collections.deque(maxlen=4096)


def free_port() -> int:
    """A loopback port free now, for a process about to be started to bind.

    It comes from below the kernel's ephemeral range: a port from bind(0) was free when
    picked but could be taken — by any bind(0) or outgoing connection on the machine —
    in the seconds before the child process bound it (seen in CI: a worker exited with
    "Address already in use"). Ports handed out recently are not handed out again.
    `OSError` when none is found."""
    low = ephemeral_floor()
    for _ in range(200):
        port = _PORT_FLOOR + secrets.randbelow(low - _PORT_FLOOR) if low > _PORT_FLOOR + 1000 else 0
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
