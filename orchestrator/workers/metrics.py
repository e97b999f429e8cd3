"""A worker's Prometheus metrics (``pdorch worker --metrics-port``, ``/metrics``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFILL = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prefill_seconds = Histogram(
            "pdorch_worker_prefill_seconds", "Prefill compute per request", buckets=_PREFILL,
            registry=r,
        )  # fmt: skip
        self.transfer_seconds = Counter(
            "pdorch_worker_kv_send_seconds", "Time spent sending KV caches", registry=r
        )
        self.kv_sent_bytes = Counter(
            "pdorch_worker_kv_sent_bytes", "KV bytes sent to decode workers", registry=r
        )
        self.tokens = Counter(
            "pdorch_worker_tokens", "Output tokens streamed by this worker", registry=r
        )
        self.compute_seconds = Counter(
            "pdorch_worker_compute_seconds", "Engine time spent on requests", registry=r
        )
        self.kv_used = Gauge(
            "pdorch_worker_kv_used_bytes", "KV held (decoding and received)", registry=r
        )
        self.active = Gauge("pdorch_worker_active_sequences", "Sequences decoding", registry=r)

    def watch(self, kv_used: Callable[[], float], active: Callable[[], float]) -> None:
        """Read the gauges from the worker at scrape time."""
        self.kv_used.set_function(kv_used)
        self.active.set_function(active)
