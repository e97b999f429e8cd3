"""CompletionPoller: waits for native requests without keeping the event loop busy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from transport.completion import CompletionPoller


class FakeRequest:
    """Completes (or fails) from another thread, like a UCX request on its progress thread."""

    def __init__(self, error: Exception | None = None) -> None:
        self._done = threading.Event()
        self._error = error

    @property
    def completed(self) -> bool:
        return self._done.is_set()

    def complete_in(self, delay_s: float) -> None:
        threading.Timer(delay_s, self._done.set).start()

    def check_error(self) -> None:
        if self._error is not None:
            raise self._error


async def _timed_wait(poller: CompletionPoller, request: FakeRequest, delay_s: float) -> float:
    request.complete_in(delay_s)
    started = time.monotonic()
    await asyncio.wait_for(poller.wait(request), 5)
    return time.monotonic() - started


def test_wakes_the_waiter_soon_after_completion() -> None:
    poller = CompletionPoller()
    took = asyncio.run(_timed_wait(poller, FakeRequest(), 0.05))
    assert 0.045 <= took < 0.05 + 0.04  # an interval of 0.1 ms, plus a loaded machine's slack
    assert poller.pending == 0


def test_the_event_loop_stays_idle_while_waiting() -> None:
    """UCXX's own wait() is a sleep(0) loop: a full core for as long as the request is
    pending. Waiting through the poller costs a small fraction of that."""
    poller = CompletionPoller()
    cpu = time.process_time()
    asyncio.run(_timed_wait(poller, FakeRequest(), 0.4))
    assert time.process_time() - cpu < 0.2  # busy-waiting would spend ~0.4 s


def test_a_failed_request_raises_its_error() -> None:
    poller = CompletionPoller()
    with pytest.raises(ConnectionResetError, match="peer went away"):
        asyncio.run(_timed_wait(poller, FakeRequest(ConnectionResetError("peer went away")), 0))


def test_an_already_completed_request_returns_at_once() -> None:
    poller = CompletionPoller()
    request = FakeRequest()
    request._done.set()
    asyncio.run(poller.wait(request))
    assert poller.pending == 0


def test_a_cancelled_wait_leaves_no_waiter_behind() -> None:
    poller = CompletionPoller()

    async def main() -> None:
        task = asyncio.create_task(poller.wait(FakeRequest()))  # never completes
        await asyncio.sleep(0.01)
        assert poller.pending == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert poller.pending == 0


def test_serves_several_event_loops_and_concurrent_waiters() -> None:
    """One poller per process: each waiter is woken in its own loop (tests and workers run
    more than one loop in a process over time)."""
    poller = CompletionPoller()

    async def many() -> list[float]:
        requests = [FakeRequest() for _ in range(16)]
        return await asyncio.gather(
            *(_timed_wait(poller, r, 0.01 * (i % 4)) for i, r in enumerate(requests))
        )

    for _ in range(2):
        took = asyncio.run(many())
        assert all(t < 0.5 for t in took)
    assert poller.pending == 0
