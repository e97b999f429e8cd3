"""Awaiting native requests (UCX) from asyncio without a busy event loop.

A UCXX request completes on UCX's progress thread; the asyncio side can only read its
``completed`` flag. UCXX's own ``wait()`` reads it in a ``sleep(0)`` loop, which keeps a core
busy per waiting task — on the 2-core machines this runs on, the core the CMA copy and the
checksums need. Sleeping between reads is no better: the event loop's timers have 1 ms
resolution (epoll), so each completion would be seen up to 1 ms late.

`CompletionPoller` reads the flags instead from one daemon thread, every ``interval_s``
(0.2 ms) while any request is pending and not at all otherwise, and wakes each waiter in its
own event loop (``call_soon_threadsafe``). Cost: a wake-up of a few microseconds per
interval while transfers are in flight; latency: about one interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Protocol


class NativeRequest(Protocol):
    """What the poller needs of a request (UCXX's ``UCXRequest`` has both)."""

    @property
    def completed(self) -> bool: ...

    def check_error(self) -> object:
        """Raise the request's error, if it failed."""


@dataclass(eq=False, slots=True)
class _Waiter:
    request: NativeRequest
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class CompletionPoller:
    def __init__(self, interval_s: float = 200e-6) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: list[_Waiter] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    async def wait(self, request: NativeRequest) -> None:
        """Return once ``request`` completed; raise its error if it failed. Cancelling the
        wait does not cancel the request (the caller owns that, e.g. by aborting its
        endpoint)."""
        if not request.completed:
            loop = asyncio.get_running_loop()
            waiter = _Waiter(request, loop.create_future(), loop)
            with self._lock:
                self._pending.append(waiter)
                self._start()
                if not self._wake.is_set():  # set() costs a futex wake-up: only when idle
                    self._wake.set()
            try:
                await waiter.future
            finally:
                with self._lock:
                    if waiter in self._pending:
                        self._pending.remove(waiter)
        request.check_error()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="pdorch-ucx-completions", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self.interval_s)
            done: list[_Waiter] = []
            with self._lock:
                still: list[_Waiter] = []
                for w in self._pending:
                    (done if w.request.completed else still).append(w)
                self._pending = still
                if not still:
                    self._wake.clear()  # under the lock: a new waiter sets it after
            for w in done:
                # RuntimeError: that event loop is closed, so nobody waits any more.
                with contextlib.suppress(RuntimeError):
                    w.loop.call_soon_threadsafe(_resolve, w.future)
