"""Which event loop a server process runs on: the orchestrator on uvloop where it is
installed, a worker on asyncio's.

The orchestrator's CPU per relayed message is spread over gRPC's Cython layer, the kernel
(wake-ups between gRPC's threads and the loop) and asyncio's own callbacks, ~9-10 per
message: uvloop (libuv under a Cython loop) runs those callbacks, its timers and the
``add_reader`` wake-up through which grpc.aio hands the loop its completions in C.
grpc.aio (server, client stubs, TLS, cancellation, graceful stop), redis-py's asyncio
client and uvicorn run on it unchanged (tests/integration/test_event_loop.py).

``--loop`` picks it per process (`pdorch orchestrator`, `pdorch worker`). Given, it is
obeyed (``uvloop`` not installed: an error). Not given, the command's loop (`ORCHESTRATOR_LOOP`,
`WORKER_LOOP`) is used when it imports; uvloop's absence is then said in one warning and
asyncio's loop runs, as correct, only slower.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from orchestrator.cli.common import CommandError

log = logging.getLogger(__name__)

ASYNCIO = "asyncio"
UVLOOP = "uvloop"
LOOPS = (UVLOOP, ASYNCIO)

ORCHESTRATOR_LOOP = UVLOOP
"""`pdorch orchestrator`'s loop when ``--loop`` is not given (and uvloop imports): 7-10 %
less CPU per request than asyncio's in 18 alternated pairs of `pdorch bench control-plane`,
tails unchanged (README: Control plane at scale)."""
WORKER_LOOP = ASYNCIO
"""`pdorch worker`'s. uvloop used to lose a busy worker's incoming KV links over TLS (the
receiver accepted plaintext and upgraded with `StreamWriter.start_tls`; uvloop had read the
sender's ClientHello into the stream by then): every loaded bench cluster with the
simulated fleet on uvloop failed requests over. The receiver now does TLS at accept, and
the fleet on uvloop completes them with no failover; but it saved no CPU either (6
alternated pairs of `pdorch bench control-plane`, fleet CPU per request uvloop/asyncio
0.85-1.07, median 1.00; README: Control plane at scale), so workers stay on asyncio's."""
WORKER_LOOP_NOTE = "uvloop works (TLS included) but saved the simulated fleet no CPU (README)"

FALLBACK_WARNING = (
    "uvloop is not installed: running on asyncio's default event loop, which costs more CPU "
    "per relayed message (pip install uvloop, or --loop asyncio to choose it and silence this)"
)

T = TypeVar("T")


def add_loop_flag(p: argparse.ArgumentParser, preferred: str, note: str = "") -> None:
    """``--loop``; not given (None), `choose` runs on ``preferred`` (`ORCHESTRATOR_LOOP`,
    `WORKER_LOOP`), kept in ``preferred_loop``. ``note``: a caveat for the help."""
    p.add_argument(
        "--loop",
        choices=LOOPS,
        default=None,
        help=f"the event loop (default: {preferred}"
        + (f" when installed, else {ASYNCIO} with a warning" if preferred != ASYNCIO else "")
        + (f"; {note}" if note else "; README: Control plane at scale")
        + ")",
    )
    p.set_defaults(preferred_loop=preferred)


def installed(name: str) -> bool:
    """Whether the loop ``name`` is there to run on: its module imports (a broken install
    counts as missing)."""
    if name == ASYNCIO:
        return True
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def choose(requested: str | None, preferred: str) -> str:
    """The loop to run on: ``requested`` (CommandError when it is not installed), or (None)
    ``preferred`` if installed, else asyncio's and one warning."""
    if requested is not None:
        if not installed(requested):
            raise CommandError(f"--loop {requested}: {requested} is not installed")
        return requested
    if installed(preferred):
        return preferred
    log.warning(FALLBACK_WARNING)
    return ASYNCIO


def factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A new-loop factory for `asyncio.Runner` (None: asyncio's default)."""
    if name == UVLOOP:
        import uvloop  # noqa: PLC0415 - only the processes that run on it load it

        return uvloop.new_event_loop
    return None


def run(main: Coroutine[Any, Any, T], name: str) -> T:
    """`asyncio.run` on the loop ``name`` (from `choose`)."""
    with asyncio.Runner(loop_factory=factory(name)) as runner:
        return runner.run(main)


def running() -> str:
    """The running loop's class, as a log line or a test reads it (``uvloop.Loop``,
    ``asyncio.unix_events._UnixSelectorEventLoop``)."""
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}"
