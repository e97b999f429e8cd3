"""asyncio helpers for the I/O layers (``core`` stays free of asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any], *, retry_s: float = 0.1) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again while it runs on.

    One ``cancel()`` can be lost: Python 3.11's ``asyncio.wait_for`` returns the result —
    dropping the cancellation — when the cancel arrives just as the awaited operation
    completes (CPython gh-86296, fixed in 3.12), and redis-py wraps the send of every
    command in it. A loop cancelled there runs on, and a stop awaiting it hangs.

    For a task whose cancellation handler must run to its end (recording a request's end,
    say), cancelling again would interrupt that handler: pair one ``cancel()`` with a flag
    the task checks instead (see ``Orchestrator._stop_driving``).
    A task that failed re-raises its exception here, as ``await task`` would.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    with contextlib.suppress(asyncio.CancelledError):
        await task
