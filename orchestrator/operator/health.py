"""Children's readiness → the resource's status: conditions, ready counts, mode (pure).

Modes follow what the orchestrators do on their own (placement falls back to aggregated
when a pool has no live workers, per ``--fallback``):

    disaggregated        both pools have a ready pod
    aggregated-fallback  one pool has none and failover.fallback is local: requests run
                         whole on the other pool's workers
    unavailable          no pool has a ready pod, or one has none and the policy is fail

Conditions (metav1.Condition shape): Ready, PrefillPoolReady, DecodePoolReady, Degraded,
and with ``tls.mode: cert-manager`` CertificatesReady (each Certificate's own Ready
condition, as cert-manager sets it). A pool is ready with at least one ready pod (fewer
than desired shows in the message and the counts). Degraded is True with the first reason
that applies, in this order: ForeignObjects (a child's name is taken by an object we don't
control), CertificatesNotReady (pods cannot start without their Secret; a failed renewal
will expire), OrchestratorUnavailable, RedisUnavailable, NoWorkers, PrefillPoolUnavailable,
DecodePoolUnavailable. A condition's lastTransitionTime changes only when its status does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DISAGGREGATED = "disaggregated"
AGGREGATED_FALLBACK = "aggregated-fallback"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Workload:
    """What the API says of one child workload (a Deployment or StatefulSet)."""

    desired: int
    ready: int = 0
    exists: bool = True

    @property
    def up(self) -> bool:
        return self.exists and self.ready > 0

    def counts(self) -> dict[str, int]:
        return {"replicas": self.desired, "readyReplicas": self.ready if self.exists else 0}


def certificate_ready(live: Mapping[str, Any] | None) -> bool:
    """Whether cert-manager reports a Certificate issued and current (its Ready condition)."""
    conditions = (live or {}).get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def workload_from(live: Mapping[str, Any] | None, desired: int) -> Workload:
    if live is None:
        return Workload(desired=desired, exists=False)
    ready = live.get("status", {}).get("readyReplicas") or 0
    return Workload(desired=desired, ready=int(ready))


def assess(
    *,
    orchestrator: Workload,
    prefill: Workload,
    decode: Workload,
    redis: Workload | None,
    fallback: str,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]],
    now: str,
    foreign: Sequence[str] = (),
    certificates: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """The status to write. ``redis`` is None when Redis is external (a Secret's URL):
    the operator cannot see it, the orchestrators' readiness covers it. ``foreign``: the
    children that could not be applied because someone else's object has their name.
    ``certificates``: each Certificate's name → ready; None without cert-manager."""
    if certificates is None:  # TLS off (or not from cert-manager): no stale condition
        previous = [c for c in previous if c.get("type") != "CertificatesReady"]
    mode = _mode(prefill, decode, fallback)
    unissued = sorted(name for name, ok in (certificates or {}).items() if not ok)
    degraded = "ForeignObjects" if foreign else None
    degraded = degraded or ("CertificatesNotReady" if unissued else None)
    degraded = degraded or _degraded_reason(orchestrator, prefill, decode, redis)
    ready = orchestrator.up and mode != UNAVAILABLE and (redis is None or redis.up)
    conditions = [
        _condition(
            "Ready",
            ready,
            _mode_reason(mode) if ready else (degraded or "NotReady"),
            f"serving {mode}" if ready else "not serving",
        ),
        _pool_condition("PrefillPoolReady", prefill),
        _pool_condition("DecodePoolReady", decode),
        _condition(
            "Degraded",
            degraded is not None,
            degraded or "AllComponentsReady",
            _degraded_message(degraded, mode, foreign),
        ),
    ]
    if certificates is not None:
        conditions.append(
            _condition(
                "CertificatesReady",
                not unissued,
                "NotIssued" if unissued else "Issued",
                f"not ready: {', '.join(unissued)}" if unissued else "every Certificate is ready",
            )
        )
    status: dict[str, Any] = {
        "mode": mode,
        "orchestrator": orchestrator.counts(),
        "prefill": prefill.counts(),
        "decode": decode.counts(),
        "conditions": merge_conditions(previous, conditions, now, generation),
    }
    if redis is not None:
        status["redis"] = redis.counts()
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid_spec(
    message: str, generation: int | None, previous: Sequence[Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """Status for a resource whose spec cannot be rendered (nothing was applied)."""
    conditions = [
        _condition("Ready", False, "InvalidSpec", message),
        _condition("Degraded", True, "InvalidSpec", message),
    ]
    status: dict[str, Any] = {"conditions": merge_conditions(previous, conditions, now, generation)}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    new: Sequence[Mapping[str, Any]],
    now: str,
    generation: int | None,
) -> list[dict[str, Any]]:
    """`new` conditions, stamped: lastTransitionTime kept from `previous` when the status
    of that type did not change, else `now`; observedGeneration when known. Conditions of
    other types in `previous` are kept as they were."""
    before = {c.get("type"): c for c in previous}
    out: list[dict[str, Any]] = []
    for cond in new:
        old = before.pop(cond["type"], None)
        stamped = dict(cond)
        same = old is not None and old.get("status") == cond["status"]
        stamped["lastTransitionTime"] = old.get("lastTransitionTime", now) if same and old else now
        if generation is not None:
            stamped["observedGeneration"] = generation
        out.append(stamped)
    out.extend(dict(c) for c in previous if c.get("type") in before)
    return out


# ------------------------------------------------------------------------------- parts


def _mode(prefill: Workload, decode: Workload, fallback: str) -> str:
    if prefill.up and decode.up:
        return DISAGGREGATED
    if (prefill.up or decode.up) and fallback == "local":
        return AGGREGATED_FALLBACK
    return UNAVAILABLE


def _mode_reason(mode: str) -> str:
    return "Disaggregated" if mode == DISAGGREGATED else "AggregatedFallback"


def _degraded_reason(
    orchestrator: Workload, prefill: Workload, decode: Workload, redis: Workload | None
) -> str | None:
    if not orchestrator.up:
        return "OrchestratorUnavailable"
    if redis is not None and not redis.up:
        return "RedisUnavailable"
    if not prefill.up and not decode.up:
        return "NoWorkers"
    if not prefill.up:
        return "PrefillPoolUnavailable"
    if not decode.up:
        return "DecodePoolUnavailable"
    return None


def _degraded_message(reason: str | None, mode: str, foreign: Sequence[str]) -> str:
    if reason is None:
        return "every component has a ready pod"
    if foreign:
        return f"not ours, left alone: {', '.join(foreign)}; mode {mode}"
    return f"{reason}; mode {mode}"


def _pool_condition(kind: str, pool: Workload) -> dict[str, Any]:
    if not pool.exists:
        return _condition(kind, False, "NotCreated", "the Deployment does not exist yet")
    message = f"{pool.ready}/{pool.desired} pods ready"
    if pool.ready == 0:
        return _condition(kind, False, "NoReadyPods", message)
    reason = "AllPodsReady" if pool.ready >= pool.desired else "SomePodsReady"
    return _condition(kind, True, reason, message)


def _condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
    }
