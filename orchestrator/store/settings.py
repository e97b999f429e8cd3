"""The request store's settings, shared by every implementation of `Store`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from orchestrator.store.keys import DEFAULT_PREFIX
from orchestrator.store.url import redacted


@dataclass(frozen=True, slots=True)
class StoreSettings:
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    """Every key's prefix (`orchestrator.store.keys`): deployments sharing a Redis, or tests
    sharing a server, keep apart by it."""
    socket_timeout_s: float = 2.0
    """Every Redis call; a hung Redis surfaces as UnavailableError, not a hang."""
    connect_timeout_s: float = 1.0
    lease_ttl_s: float = 3.0
    """An orchestrator owns a request while it refreshes this lease; then others take over."""
    record_ttl_s: int = 24 * 3600
    """How long finished requests stay queryable (and resubmittable idempotently)."""
    max_connections: int = 128
    """Connections to Redis at most; more concurrent calls wait for one (a request in flight
    makes one call at a time, so thousands of requests share these)."""
    pool_timeout_s: float = 5.0
    """Longest wait for a free connection before the call fails as unavailable."""
    outage_s: float = 30.0
    """The store outage a running request outlasts: writes to its record are retried this
    long (a Redis restart with its AOF load, a managed Redis's failover), and a finishing
    request waits this long to journal and record its end. 0: fail at once."""

    def __repr__(self) -> str:
        """Every field, the URL's password masked (`store.url.redacted`): settings get logged,
        and show up in tracebacks."""
        shown = ", ".join(
            f"{f.name}={redacted(self.url) if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self)
        )
        return f"StoreSettings({shown})"
