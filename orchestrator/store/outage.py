"""Outlasting a store outage: the writes a running request cannot do without.

A Redis restart — stop, start, load its AOF — took 1.5–2 s on the chaos runs of issue 18; a
managed Redis's failover takes tens of seconds. The failover loop's 4 attempts with backoff
(under half a second in all) did not outlast even the first, and a request was given up.

So a write to a request's record (`Store.transition`, `Store.set_fields`) retries an
unreachable store (`StoreUnavailableError`) for ``StoreSettings.outage_s``, with exponential
backoff and jitter (`orchestrator.core.backoff`), then fails with a `StoreUnavailableError`
naming the window. A write can land and its reply be lost (the connection dropped after Redis
ran the command): a transition carries a token, so the retry of one that landed is answered
as done, never applied twice; field writes are idempotent. Error replies (a bug, not an
outage) are never retried.

Other calls fail at once, because their callers already cope: journal appends are buffered
(`orchestrator.control.journal`), admissions are refused with UNAVAILABLE (the client
retries), heartbeats, leases and reaper scans run again within a second, and a one-shot
command (``pdorch status``) should say that Redis is down rather than wait. The control plane
wraps the reads its drive loop needs (`outlasting`) itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from orchestrator import errors
from orchestrator.core.backoff import exponential_jitter

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY_S = 0.05
"""The first pause: a dropped connection is often back at once (the pool reconnects)."""
MAX_DELAY_S = 1.0
"""The longest pause: once the store is back, a waiting call notices within a second."""
JITTER_S = 0.1
"""Spread over every pause, so the replicas' waiting calls don't all land at once."""


async def outlasting(outage_s: float, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, tried again while it raises `StoreUnavailableError`, for up to
    ``outage_s`` seconds (0: once). After that, a `StoreUnavailableError` that says so.

    A plain loop: the first try — nearly every call's only one — costs an await, nothing
    more (this wraps a request's transitions and its end)."""
    if outage_s <= 0:
        return await call()
    started = time.monotonic()
    tries = 1
    while True:
        try:
            result = await call()
        except errors.StoreUnavailableError as exc:
            waited = time.monotonic() - started
            if waited >= outage_s:
                raise errors.StoreUnavailableError(
                    f"request store unreachable for {waited:.1f} s, longer than "
                    f"its outage window of {outage_s:g} s ({what})"
                ) from exc
            await asyncio.sleep(exponential_jitter(tries, FIRST_DELAY_S, MAX_DELAY_S, JITTER_S))
            tries += 1
            continue
        if tries > 1:
            log.warning(
                "request store back after %.1f s (%s, %d tries)",
                time.monotonic() - started, what, tries,
            )  # fmt: skip
        return result
