"""Per-worker circuit breakers. Pure: time is passed in.

A worker call that fails with a retryable error *opens* that worker's breaker: placement
avoids it for ``cooldown`` seconds, without waiting for its heartbeat to expire. Then it is
*half-open*: one request may probe it, and placement avoids it while that probe has not
answered. The probe's answer is the worker's first response — a prefill's reply, a stream's
first token — not the end of its stream: a probe that streams for a minute must not keep a
healthy worker out of placement for that minute. An answer closes the breaker; a failure
opens it again for twice as long (up to ``max_cooldown``).

Breakers are advice (`held_back`): placement prefers workers they don't hold back, then
half-open ones, and never calls a pool *down* because of them
(`orchestrator.core.scheduler.place`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(slots=True)
class _Entry:
    cooldown: float
    open_until: float
    probing: bool = False


@dataclass
class Breakers:
    cooldown_s: float = 2.0
    max_cooldown_s: float = 60.0
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def state(self, worker: str, now: float) -> BreakerState:
        e = self._entries.get(worker)
        if e is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < e.open_until else BreakerState.HALF_OPEN

    def held_back(self, now: float) -> dict[str, BreakerState]:
        """Workers placement should avoid now, and why: OPEN ones (cooling down), and
        HALF_OPEN ones whose probe has not answered yet."""
        out: dict[str, BreakerState] = {}
        for w, e in self._entries.items():
            if now < e.open_until:
                out[w] = BreakerState.OPEN
            elif e.probing:
                out[w] = BreakerState.HALF_OPEN
        return out

    def blocked(self, now: float) -> set[str]:
        """The workers `held_back` names."""
        return set(self.held_back(now))

    def placed(self, worker: str, now: float) -> None:
        """A request was placed on ``worker``; if half-open, it is the probe."""
        e = self._entries.get(worker)
        if e is not None and now >= e.open_until:
            e.probing = True

    def failure(self, worker: str, now: float) -> None:
        e = self._entries.get(worker)
        if e is None:
            self._entries[worker] = _Entry(self.cooldown_s, now + self.cooldown_s)
            return
        e.cooldown = min(e.cooldown * 2, self.max_cooldown_s) if e.probing else e.cooldown
        e.open_until = now + e.cooldown
        e.probing = False

    def success(self, worker: str) -> None:
        """``worker`` answered a call (its first response, not the end of a stream): close."""
        self._entries.pop(worker, None)
