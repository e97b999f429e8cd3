"""Routing, sampling, window statistics and the rollback rule. Pure.

**Routing is deterministic per request key**: a request's key (its ``Idempotency-Key`` or
``X-Request-Id`` header, else a hash of its body) and the migration's name are hashed into one
of 10,000 buckets; a canary at P % sends buckets below ``P × 100`` to pdorch, and shadow
sampling at share S mirrors buckets below ``S × 10,000``. So a retry of a request takes the
same path, raising P only adds requests to pdorch, and tests can pick keys for each path.

**The rollback rule**: over the pdorch path's last ``window`` requests, once there are at
least ``min_samples``, the canary rolls back when the error rate exceeds ``max_error_rate``
or the p99 TTFT or TPOT (nearest rank, over the streamed requests among them) exceeds its
limit. Errors are what pdorch could have avoided: 5xx, 429, a transport failure or timeout,
a stream that broke or ended without ``[DONE]``; a 4xx is the client's and counts as ok.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.migrate.settings import Limits

BUCKETS = 10_000


def bucket(name: str, key: str) -> int:
    digest = hashlib.sha256(f"{name}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def routes_to_pdorch(name: str, key: str, percent: float) -> bool:
    """Canary: does this request go to pdorch at ``percent`` %?"""
    return bucket(name, key) < round(percent * BUCKETS / 100)


def sampled(name: str, key: str, share: float) -> bool:
    """Shadow: is this request mirrored to pdorch at ``share`` (0..1)?"""
    return bucket(name, key) < round(share * BUCKETS)


def body_key(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


def counts_as_failure(status: int, error: str) -> bool:
    """A failure pdorch (or the existing service) is to blame for; see the module doc."""
    if status >= 500 or status in {429, 0}:
        return True
    return status < 400 and bool(error)


@dataclass(slots=True)
class Sample:
    """One answer from one path, as recorded."""

    ts: float
    """Unix seconds when the request arrived."""
    request_id: str
    path: str
    """"existing" or "pdorch"."""
    role: str
    """"answer" (the client got it) or "shadow" (mirrored, the client never saw it)."""
    stream: bool
    status: int
    """HTTP status from the upstream (0: no answer — refused, reset, timed out)."""
    failed: bool
    error: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    total_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    """pdorch's own price of the request (``usage.pdorch_cost_usd``), when it sent one."""
    text: str = ""
    """The output, cut to `TEXT_KEPT` characters."""
    match: bool | None = None
    """Shadow samples: the output equals the existing service's (None: nothing to compare)."""
    char_similarity: float | None = None
    token_similarity: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


TEXT_KEPT = 2000


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True, slots=True)
class WindowStats:
    count: int
    failures: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.failures / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"error_rate": self.error_rate}


def window_stats(samples: Iterable[Sample]) -> WindowStats:
    items = list(samples)
    ttft = [s.ttft_ms for s in items if s.ttft_ms is not None and not s.failed]
    tpot = [s.tpot_ms for s in items if s.tpot_ms is not None and not s.failed]
    return WindowStats(
        count=len(items),
        failures=sum(s.failed for s in items),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
    )


def breach(stats: WindowStats, limits: Limits) -> str | None:
    """Why these statistics break the limits (the rollback's reason), or None."""
    if stats.count < limits.min_samples:
        return None
    if stats.error_rate > limits.max_error_rate:
        return (
            f"error rate {stats.error_rate:.1%} ({stats.failures}/{stats.count}) "
            f"> {limits.max_error_rate:.1%}"
        )
    if limits.max_ttft_p99_ms and (stats.ttft_p99_ms or 0.0) > limits.max_ttft_p99_ms:
        return f"TTFT p99 {stats.ttft_p99_ms:.0f} ms > {limits.max_ttft_p99_ms:.0f} ms"
    if limits.max_tpot_p99_ms and (stats.tpot_p99_ms or 0.0) > limits.max_tpot_p99_ms:
        return f"TPOT p99 {stats.tpot_p99_ms:.1f} ms > {limits.max_tpot_p99_ms:.1f} ms"
    return None


@dataclass(slots=True)
class Window:
    """The last ``size`` samples of one path."""

    size: int
    samples: deque[Sample] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.size)

    def add(self, sample: Sample) -> WindowStats:
        self.samples.append(sample)
        return self.stats()

    def stats(self) -> WindowStats:
        return window_stats(self.samples)

    def clear(self) -> None:
        self.samples.clear()
