"""The orchestrator's Prometheus metrics (served on ``--metrics-port`` at ``/metrics``).

One object per orchestrator, on its own registry (so tests can run several in a process).
Label values are bounded: outcomes are states, causes are phases. Tenants are what callers
send (any 1-64 printable bytes without a tokens file), so the tenant label keeps the first
`MAX_TENANTS` seen and counts every later one under `OTHER_TENANTS`: a client naming 10,000
tenants cannot make 10,000 series (`pdorch cost` has every tenant's totals, from Redis).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

MAX_TENANTS = 100
"""Distinct tenant label values one orchestrator exports; later tenants share `OTHER_TENANTS`."""
OTHER_TENANTS = "(other)"
"""The tenant label of every tenant past `MAX_TENANTS` (a tenant so named joins them)."""


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdorch_requests", "Requests that ended, by state and finish reason",
            ["state", "reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "pdorch_ttft_seconds", "Time to first token (admission to token 0 sent)",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdorch_tpot_seconds", "Time per output token after the first",
            buckets=_PER_TOKEN, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "pdorch_queue_seconds", "Admission until a worker started on the request",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            "pdorch_transfer_bytes", "KV bytes moved from prefill to decode workers", registry=r
        )
        self.transfer_seconds = Counter(
            "pdorch_transfer_seconds", "Time spent moving KV caches", registry=r
        )
        self.failovers = Counter(
            "pdorch_failovers", "Reassignments to other workers, by the phase that failed",
            ["cause"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "pdorch_fallbacks", "Requests run aggregated because a pool was down",
            ["pool_down"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "pdorch_rejections", "Requests refused at admission, by status",
            ["code"], registry=r,
        )  # fmt: skip
        self.placements = Counter(
            "pdorch_placements", "Attempts placed, by mode (aggregated: a pool down or a "
            "prompt too short to be worth a transfer)", ["mode"], registry=r,
        )  # fmt: skip
        self.cost = Counter(
            "pdorch_cost_usd", f"What finished requests cost, by tenant (the first {MAX_TENANTS} "
            f"seen; later ones as {OTHER_TENANTS!r})", ["tenant"], registry=r,
        )  # fmt: skip
        self._tenants: set[str] = set()
        self.gpu_seconds = Counter(
            "pdorch_gpu_seconds", "Engine seconds requests held, by pool and GPU kind",
            ["pool", "gpu"], registry=r,
        )  # fmt: skip

    def finished(self, state: str, reason: str, timings: Mapping[str, float],
                 cost: Mapping[str, Any]) -> None:  # fmt: skip
        self.requests.labels(state, reason or state).inc()
        if (ttft := timings.get("ttft_ms")) is not None:
            self.ttft.observe(ttft / 1000)
        if (tpot := timings.get("tpot_ms")) is not None:
            self.tpot.observe(tpot / 1000)
        if (queue := timings.get("queue_ms")) is not None:
            self.queue.observe(queue / 1000)
        tenant = self._tenant_label(str(cost.get("tenant") or "default"))
        self.cost.labels(tenant).inc(float(cost.get("usd", 0.0)))
        for pool, gpu_key in (("prefill", "prefill_gpu"), ("decode", "decode_gpu"),
                              ("aggregated", "decode_gpu")):  # fmt: skip
            seconds = float(cost.get(f"{pool}_gpu_s", 0.0))
            if seconds > 0:
                self.gpu_seconds.labels(pool, str(cost.get(gpu_key, ""))).inc(seconds)

    def _tenant_label(self, tenant: str) -> str:
        """``tenant`` while fewer than `MAX_TENANTS` are labelled, else `OTHER_TENANTS`."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < MAX_TENANTS:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANTS
