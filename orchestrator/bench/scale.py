"""Where `pdorch bench control-plane` runs each process, and what its CPU figures project to.

Pure: no processes, no clock; `orchestrator.bench.control_plane` measures, this decides and
computes.

**Cores** (`assign_cores`). The processes whose scaling the bench is about — each
orchestrator replica and each Redis shard — are *pinned*: each gets one core. They are
single-core by design (redis-server runs commands on one thread; an orchestrator runs
pdorch's code on one asyncio loop, gRPC core's few threads aside), so one core each is what
a deployment gives them. With more cores than pinned processes, each gets a core of its own
and everything else (the simulated fleet, the load clients) shares the cores left: no
replica or shard competes with anything. With fewer, the pinned processes are dealt the
cores round-robin and everything else may run anywhere: pinning then only keeps replicas
(and shards) off each other's core and says nothing about what a core sustains; the
per-token CPU figures below are what carries over to a larger machine.

**Projection** (`project`). A tier (the replicas, or the shards) whose processes used
``c`` CPU-seconds per relayed token in all sustains ``1 / c`` tokens per second per core
of that tier, the load spread evenly; with one core per process, the tier saturates when
its busiest process does, at ``tokens / max(cpu_i)`` tokens per second. Divided by what one
decode GPU produces, that is the fleet one core (one tier) can front. It is a projection
from CPU counters under the measured load, not a measurement of a fleet: per-token costs
change with tokens per message (the coalescing window, the decode step) and with contention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.errors import ConfigError

TIERS = ("orchestrators", "redis")
"""The tiers projected: the replicas and the Redis shards."""


@dataclass(frozen=True, slots=True)
class CoreAssignment:
    """Which cores each process may run on."""

    pinned: Mapping[str, int]
    """Pinned process name -> its core."""
    rest: tuple[int, ...]
    """The cores every other process (fleet, load clients) may use."""
    dedicated: bool
    """Every pinned process has a core nothing else runs on."""

    def to_dict(self) -> dict[str, object]:
        return {"cores": dict(self.pinned), "others": list(self.rest), "dedicated": self.dedicated}

    def describe(self) -> str:
        cores = ", ".join(f"{name}→{core}" for name, core in self.pinned.items())
        rest = ",".join(map(str, self.rest))
        how = "each its own core" if self.dedicated else "cores shared round-robin"
        return f"{cores}; others on {rest} ({how})"


def assign_cores(pinned: Sequence[str], cores: Sequence[int]) -> CoreAssignment:
    """One core per name in ``pinned`` out of ``cores`` (the ones this process may use):
    dedicated when there are more cores than pinned processes, else round-robin."""
    if not cores:
        raise ConfigError("pin", "no core to pin to")
    if len(set(pinned)) != len(pinned):
        raise ConfigError("pin", "process names must be distinct")
    ordered = sorted(set(cores))
    if len(ordered) > len(pinned):
        return CoreAssignment(
            dict(zip(pinned, ordered, strict=False)), tuple(ordered[len(pinned) :]), True
        )
    placed = {name: ordered[i % len(ordered)] for i, name in enumerate(pinned)}
    return CoreAssignment(placed, tuple(ordered), False)


@dataclass(frozen=True, slots=True)
class Usage:
    """What each measured process used over the load phase, and what the load did."""

    cpu_s: Mapping[str, float]
    """Process (or group: ``prefill_fleet``, ``clients``) -> user + system CPU seconds."""
    tier: Mapping[str, str]
    """Process -> its tier (`TIERS`); processes outside the projected tiers are absent."""
    requests: int
    """Completed requests."""
    tokens: int
    """Tokens relayed to the clients (completed or not)."""

    def per_process(self) -> dict[str, dict[str, float]]:
        """CPU ms per completed request and µs per relayed token, per process."""
        return {
            name: {
                "cpu_ms_per_request": round(cpu * 1e3 / max(1, self.requests), 2),
                "cpu_us_per_token": round(cpu * 1e6 / max(1, self.tokens), 1),
            }
            for name, cpu in self.cpu_s.items()
        }


@dataclass(frozen=True, slots=True)
class TierProjection:
    processes: int
    us_per_token: float
    """The tier's CPU per relayed token, all its processes together (fixed per-request
    costs amortised over the request's tokens)."""
    tokens_per_s_per_core: float
    """``1 / us_per_token``: what one core of this tier sustains, the load spread evenly."""
    busiest_share: float
    """The busiest process's share of the tier's CPU (1/processes when balanced)."""
    tier_tokens_per_s: float
    """With one core per process: when the busiest one saturates."""
    decode_gpus_per_core: float
    tier_decode_gpus: float

    def to_dict(self) -> dict[str, float]:
        return {
            "processes": self.processes,
            "us_per_token": round(self.us_per_token, 1),
            "tokens_per_s_per_core": round(self.tokens_per_s_per_core),
            "busiest_share": round(self.busiest_share, 3),
            "tier_tokens_per_s": round(self.tier_tokens_per_s),
            "decode_gpus_per_core": round(self.decode_gpus_per_core, 2),
            "tier_decode_gpus": round(self.tier_decode_gpus, 2),
        }


def project(usage: Usage, tier: str, gpu_tokens_per_s: float) -> TierProjection | None:
    """The projection for ``tier``; None when it used no CPU or relayed no token (nothing
    to project from)."""
    if gpu_tokens_per_s <= 0:
        raise ConfigError("gpu_tokens_per_s", "must be > 0")
    cpu = [c for name, c in usage.cpu_s.items() if usage.tier.get(name) == tier]
    total = sum(cpu)
    if not cpu or total <= 0 or usage.tokens <= 0:
        return None
    per_token_s = total / usage.tokens
    per_core = 1 / per_token_s
    ceiling = usage.tokens / max(cpu)
    return TierProjection(
        processes=len(cpu),
        us_per_token=per_token_s * 1e6,
        tokens_per_s_per_core=per_core,
        busiest_share=max(cpu) / total,
        tier_tokens_per_s=ceiling,
        decode_gpus_per_core=per_core / gpu_tokens_per_s,
        tier_decode_gpus=ceiling / gpu_tokens_per_s,
    )
