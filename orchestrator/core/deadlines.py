"""Deadlines per request state: no request sits in a non-terminal state forever. Pure.

The replica that drives a request has its own, shorter timeouts (prefill 120 s, KV adoption
30 s, token silence 60 s) and a lease (3 s) that lets another replica take over when it
dies. These deadlines are the backstop behind both: a request that made no progress — no
transition, no journalled token — for longer than its state allows is failed by any
replica's reaper, whoever owns it. Progress time is Redis's clock (``TIME``), so replicas
with skewed clocks agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.state import State


@dataclass(frozen=True, slots=True)
class StateDeadlines:
    queued_s: float = 60.0
    """Placement and retries between attempts take seconds; a minute means nobody drives it."""
    prefilling_s: float = 180.0
    """Beyond the driver's 120 s prefill timeout."""
    transferring_s: float = 90.0
    """Beyond the driver's 30 s wait for the decode worker to adopt the KV."""
    decoding_s: float = 120.0
    """Since the last journalled token; beyond the driver's 60 s token-silence timeout."""

    def limit(self, state: State) -> float | None:
        return {
            State.QUEUED: self.queued_s,
            State.PREFILLING: self.prefilling_s,
            State.TRANSFERRING: self.transferring_s,
            State.DECODING: self.decoding_s,
        }.get(state)


def overdue(
    state: State, updated_at_ms: float, now_ms: float, deadlines: StateDeadlines
) -> str | None:
    """Why the request must be failed now, or None. A record without a progress time (written
    before progress was tracked) is not judged: it has its record TTL."""
    limit = deadlines.limit(state)
    if limit is None or updated_at_ms <= 0:
        return None
    idle_s = (now_ms - updated_at_ms) / 1000
    if idle_s <= limit:
        return None
    return f"no progress in state {state} for {idle_s:.0f}s (deadline {limit:.0f}s)"
