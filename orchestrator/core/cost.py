"""What a request cost, and what a tenant's requests cost together. Pure.

A request's cost is the GPU time it held on each pool times that pool's price, plus the bytes
its KV cache travelled times a transfer price::

    usd = sum(gpu_seconds[pool] * price_per_hour[pool] / 3600) + transfer_bytes / 1e9 * usd_per_gb

``gpu_seconds`` is GPU-seconds: a tensor-parallel group of 4 GPUs busy for 1 s is 4
GPU-seconds, and a request sharing a decode batch of 32 for 1 s holds 1/32 of it. The
transfer price defaults to 0 (a local link inside a cluster costs nothing extra; cross-zone
or cross-region traffic does).

**KV reuse.** Prompt tokens the prefill worker found in its prefix cache (the worker says how
many: the engine knows what it computed) are not computed, so not billed; what they would
have cost is recorded beside the bill, at the same price, with the worker's measured prefill
rate::

    saved_usd = reused_tokens / tokens_per_second * price_per_hour / 3600
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
class Reuse:
    """Prompt tokens a prefill found cached, and what computing them would have cost."""

    tokens: int
    saved_gpu_s: float
    saved_usd: float


NO_REUSE = Reuse(0, 0.0, 0.0)


def reuse_saving(gpu: GpuProfile, reused_tokens: int, tokens_per_second: float | None) -> Reuse:
    """What ``reused_tokens`` would have cost to prefill on ``gpu`` at ``tokens_per_second``
    (``None`` or 0: rate unknown, the tokens are counted and the saving is 0)."""
    if reused_tokens < 0:
        raise ConfigError("reused_tokens", f"must be >= 0, got {reused_tokens!r}")
    if tokens_per_second is None or not (
        tokens_per_second > 0 and math.isfinite(tokens_per_second)
    ):
        return Reuse(reused_tokens, 0.0, 0.0)
    seconds = reused_tokens / tokens_per_second
    return Reuse(reused_tokens, seconds, gpu_usd(gpu, seconds))


def total_reuse(reuses: Iterable[Reuse]) -> Reuse:
    """Several prefills' reuse (a request re-prefilled after a failover) as one."""
    tokens, seconds, usd = 0, 0.0, 0.0
    for r in reuses:
        tokens, seconds, usd = tokens + r.tokens, seconds + r.saved_gpu_s, usd + r.saved_usd
    return Reuse(tokens, seconds, usd)


@dataclass(frozen=True, slots=True)
class RequestCost:
    gpu_usd: tuple[tuple[str, float], ...]
    """(pool, USD) in the order the usages came, one entry per pool."""
    transfer_usd: float = 0.0
    transfer_bytes: int = 0
    reuse: Reuse = NO_REUSE
    """Prompt tokens not computed (cached) and what they would have cost; not in the total."""

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
    usages: Sequence[PoolUsage],
    transfer_bytes: int = 0,
    usd_per_gb: float = 0.0,
    reuse: Reuse = NO_REUSE,
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
        reuse=reuse,
    )


@dataclass(frozen=True, slots=True)
class TenantCost:
    tenant: str
    requests: int
    gpu_usd: float
    transfer_usd: float
    transfer_bytes: int
    reused_tokens: int = 0
    reuse_saved_usd: float = 0.0

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
            t.reused_tokens + cost.reuse.tokens,
            t.reuse_saved_usd + cost.reuse.saved_usd,
        )
    return totals


TENANT_FLOAT_FIELDS = (
    "usd",
    "prefill_gpu_s",
    "decode_gpu_s",
    "aggregated_gpu_s",
    "transfer_usd",
    "reuse_saved_usd",
)
"""The `cost_fields` a store sums per tenant as floats (besides ``requests``)."""
TENANT_INT_FIELDS = ("transfer_bytes", "prefill_reused_tokens")
"""The `cost_fields` a store sums per tenant as integers."""


def cost_fields(
    usages: Sequence[PoolUsage],
    transfer_bytes: int,
    usd_per_gb: float,
    tenant: str,
    reuse: Reuse = NO_REUSE,
) -> dict[str, float | int | str]:
    """A request's cost as stored on its record and sent to clients (`Cost` in the protos)."""
    cost = request_cost(usages, transfer_bytes, usd_per_gb, reuse)
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
        "prefill_reused_tokens": reuse.tokens,
        "reuse_saved_gpu_s": reuse.saved_gpu_s,
        "reuse_saved_usd": reuse.saved_usd,
    }
