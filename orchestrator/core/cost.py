"""What a request cost, and what a tenant's requests cost together. Pure.

A request's cost is the GPU time it held on each pool times that pool's price, plus the bytes
its KV cache travelled times a transfer price::

    usd = sum(gpu_seconds[pool] * price_per_hour[pool] / 3600) + transfer_bytes / 1e9 * usd_per_gb

``gpu_seconds`` is GPU-seconds: a tensor-parallel group of 4 GPUs busy for 1 s is 4
GPU-seconds, and a request sharing a decode batch of 32 for 1 s holds 1/32 of it. The
transfer price defaults to 0 (a local link inside a cluster costs nothing extra; cross-zone
or cross-region traffic does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchestrator.core.hardware import GpuProfile
from orchestrator.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """GPU time one request held on one pool."""

    pool: str
    """"prefill", "decode", "aggregated" or any label."""
    gpu: GpuProfile
    gpu_seconds: float


@dataclass(frozen=True, slots=True)
class RequestCost:
    gpu_usd: tuple[tuple[str, float], ...]
    """(pool, USD) in the order the usages came, one entry per pool."""
    transfer_usd: float = 0.0
    transfer_bytes: int = 0

    @property
    def gpu_total_usd(self) -> float:
        return sum(usd for _, usd in self.gpu_usd)

    @property
    def total_usd(self) -> float:
        return self.gpu_total_usd + self.transfer_usd

    def pool_usd(self, pool: str) -> float:
        return sum(usd for name, usd in self.gpu_usd if name == pool)


def gpu_usd(gpu: GpuProfile, gpu_seconds: float) -> float:
    return gpu_seconds * gpu.price_per_hour / 3600.0


def request_cost(
    usages: Sequence[PoolUsage], transfer_bytes: int = 0, usd_per_gb: float = 0.0
) -> RequestCost:
    """The cost of one request; pools named twice are summed."""
    if transfer_bytes < 0:
        raise ConfigError("transfer_bytes", f"must be >= 0, got {transfer_bytes!r}")
    if not (usd_per_gb >= 0 and math.isfinite(usd_per_gb)):
        raise ConfigError("transfer_usd_per_gb", f"must be >= 0, got {usd_per_gb!r}")
    by_pool: dict[str, float] = {}
    for usage in usages:
        if not (usage.gpu_seconds >= 0 and math.isfinite(usage.gpu_seconds)):
            raise ConfigError(
                f"{usage.pool}.gpu_seconds", f"must be >= 0, got {usage.gpu_seconds!r}"
            )
        by_pool[usage.pool] = by_pool.get(usage.pool, 0.0) + gpu_usd(usage.gpu, usage.gpu_seconds)
    return RequestCost(
        gpu_usd=tuple(by_pool.items()),
        transfer_usd=transfer_bytes / 1e9 * usd_per_gb,
        transfer_bytes=transfer_bytes,
    )


@dataclass(frozen=True, slots=True)
class TenantCost:
    tenant: str
    requests: int
    gpu_usd: float
    transfer_usd: float
    transfer_bytes: int

    @property
    def total_usd(self) -> float:
        return self.gpu_usd + self.transfer_usd

    @property
    def usd_per_1k_requests(self) -> float:
        return self.total_usd / self.requests * 1000 if self.requests else 0.0


def aggregate_by_tenant(costs: Iterable[tuple[str, RequestCost]]) -> dict[str, TenantCost]:
    """Sum ``(tenant, cost)`` pairs per tenant; tenants in order of first appearance."""
    totals: dict[str, TenantCost] = {}
    for tenant, cost in costs:
        t = totals.get(tenant) or TenantCost(tenant, 0, 0.0, 0.0, 0)
        totals[tenant] = TenantCost(
            tenant,
            t.requests + 1,
            t.gpu_usd + cost.gpu_total_usd,
            t.transfer_usd + cost.transfer_usd,
            t.transfer_bytes + cost.transfer_bytes,
        )
    return totals


def cost_fields(
    usages: Sequence[PoolUsage], transfer_bytes: int, usd_per_gb: float, tenant: str
) -> dict[str, float | int | str]:
    """A request's cost as stored on its record and sent to clients (`Cost` in the protos)."""
    cost = request_cost(usages, transfer_bytes, usd_per_gb)
    seconds = {u.pool: 0.0 for u in usages}
    kinds: dict[str, str] = {}
    for u in usages:
        seconds[u.pool] += u.gpu_seconds
        kinds.setdefault(u.pool, u.gpu.name)
    return {
        "usd": cost.total_usd,
        "prefill_gpu_s": seconds.get("prefill", 0.0),
        "decode_gpu_s": seconds.get("decode", 0.0),
        "aggregated_gpu_s": seconds.get("aggregated", 0.0),
        "transfer_bytes": transfer_bytes,
        "transfer_usd": cost.transfer_usd,
        "prefill_gpu": kinds.get("prefill", ""),
        "decode_gpu": kinds.get("decode", kinds.get("aggregated", "")),
        "tenant": tenant,
    }
