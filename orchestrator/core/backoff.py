"""How long to wait before trying again: exponential backoff with jitter. Pure.

The two retry loops of a request — a store write outlasting an outage
(`orchestrator.store.outage`) and the failover drive (`orchestrator.control.failover`) —
sleep for `exponential_jitter` between tries; the loops themselves are a few lines each
where they run. They used tenacity, whose machinery cost ~40 µs of CPU per store write and
~85 µs per request drive even when the first try succeeds (every request, three times):
a request's fixed CPU cost, for a loop that almost never loops. The formula is tenacity's
``wait_exponential_jitter``, so the pauses are what they were.
"""

from __future__ import annotations

import random
from collections.abc import Callable


def exponential_jitter(
    tries: int,
    multiplier: float,
    max_s: float,
    jitter_s: float,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """The pause after the ``tries``-th failed try (1 for the first):
    ``min(multiplier * 2 ** (tries - 1) + uniform(0, jitter_s), max_s)``, never negative."""
    try:
        wait = multiplier * 2.0 ** (tries - 1) + uniform(0.0, jitter_s)
    except OverflowError:
        wait = max_s
    return max(0.0, min(wait, max_s))
