"""Children's readiness → the resource's status: conditions, ready counts, mode (pure).

Modes follow what the orchestrators do on their own (placement falls back to aggregated
when a pool has no live workers, per ``--fallback``):

    disaggregated        both pools have a ready pod
    aggregated           one pool is scaled to 0 replicas by the spec, the other has a
                         ready pod and failover.fallback is local: requests run whole on
                         the other pool's workers, as asked (not degraded)
    aggregated-fallback  the same, but the pool with no ready pod should have some
    unavailable          no pool has a ready pod, or one has none and the policy is fail

Conditions (metav1.Condition shape): Ready, PrefillPoolReady, DecodePoolReady, Degraded,
Progressing, Reconciled, and with ``tls.mode: cert-manager`` CertificatesReady (each
Certificate's own Ready condition, as cert-manager sets it). A pool is ready with at least
one ready pod (fewer than desired shows in the message and the counts).

Ready is True when the service serves (an orchestrator, a mode other than unavailable, the
dev Redis if any) *and* what serves is what the spec asks for: not when an object was
refused by the API (ApplyFailed) or a rollout is stuck (RolloutStuck) — the previous pods
may still serve, which the message says.

Progressing is True while a workload rolls out (its controller has not seen the latest
spec, or fewer pods run the current template than desired, or old pods remain), False with
the controller's reason when one stopped (a Deployment's Progressing False, e.g.
ProgressDeadlineExceeded: new pods that never become ready), else False RolloutComplete.

Reconciled is False when an object could not be applied: ApplyFailed (the API's messages)
or ForeignObjects (a child's name is taken by an object we don't control); InvalidSpec
when nothing was.

Degraded is True with the first reason that applies, in this order: ApplyFailed,
ForeignObjects, CertificatesNotReady (pods cannot start without their Secret; a failed
renewal will expire), OrchestratorUnavailable, RedisUnavailable, NoWorkers,
PrefillPoolUnavailable, DecodePoolUnavailable, RolloutStuck; else False, reason
RollingUpdate during a rollout, ScaledToZero when a pool is at 0 replicas by the spec,
AllComponentsReady otherwise. A pool the spec scales to 0 is never a reason to be
degraded: its pool condition reads ScaledToZero, and with no serving pool left (both at 0,
or one at 0 with failover.fallback fail) Ready is False, reason ScaledToZero.
A condition's lastTransitionTime changes only when its status does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DISAGGREGATED = "disaggregated"
AGGREGATED = "aggregated"
AGGREGATED_FALLBACK = "aggregated-fallback"
UNAVAILABLE = "unavailable"
MODES = (DISAGGREGATED, AGGREGATED, AGGREGATED_FALLBACK, UNAVAILABLE)  # the CRD's enum


# Longest API message kept per refused object in the Reconciled condition.
_MESSAGE_LIMIT = 400


@dataclass(frozen=True)
class Workload:
    """What the API says of one child workload (a Deployment or StatefulSet)."""

    desired: int
    ready: int = 0
    exists: bool = True
    # The rollout, as the controller reports it. None: not reported (no controller has
    # written a status yet; the tests' API emulator runs none).
    updated: int | None = None  # pods running the current template
    current: int | None = None  # every pod, old template or new
    observed: bool = True  # the controller has seen the latest spec (observedGeneration)
    stalled: str | None = None  # why the controller stopped rolling out (Progressing False)

    @property
    def up(self) -> bool:
        return self.exists and self.ready > 0

    @property
    def scaled_to_zero(self) -> bool:
        """The spec asks for no pod: its absence is no fault."""
        return self.desired == 0

    @property
    def rolling(self) -> bool:
        """A rollout (or scaling) is under way and has not stopped."""
        if not self.exists or self.stalled is not None:
            return False
        if not self.observed:
            return True
        if self.updated is None:
            return False
        return self.updated < self.desired or (self.current or 0) > self.updated

    def counts(self) -> dict[str, int]:
        return {"replicas": self.desired, "readyReplicas": self.ready if self.exists else 0}


def certificate_ready(live: Mapping[str, Any] | None) -> bool:
    """Whether cert-manager reports a Certificate issued and current (its Ready condition)."""
    conditions = (live or {}).get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def workload_from(live: Mapping[str, Any] | None, desired: int) -> Workload:
    if live is None:
        return Workload(desired=desired, exists=False)
    status = live.get("status") or {}
    generation = (live.get("metadata") or {}).get("generation")
    seen = status.get("observedGeneration")
    observed = generation is None or (seen is not None and int(seen) >= int(generation))

    def count(key: str) -> int | None:
        # The API omits zero counts: once the controller has written a status, absent is 0.
        value = status.get(key)
        if value is None:
            return 0 if seen is not None else None
        return int(value)

    stalled = None
    if observed:  # a condition from before the latest spec says nothing of its rollout
        for cond in status.get("conditions") or []:
            if cond.get("type") == "Progressing" and cond.get("status") == "False":
                stalled = str(cond.get("reason") or "ProgressStopped")
    return Workload(
        desired=desired,
        ready=count("readyReplicas") or 0,
        updated=count("updatedReplicas"),
        current=count("replicas"),
        observed=observed,
        stalled=stalled,
    )


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
    failed: Mapping[str, str] | None = None,
    certificates: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """The status to write. ``redis`` is None when Redis is external (a Secret's URL):
    the operator cannot see it, the orchestrators' readiness covers it. ``foreign``: the
    children that could not be applied because someone else's object has their name.
    ``failed``: the children the API refused → its message.
    ``certificates``: each Certificate's name → ready; None without cert-manager."""
    failed = failed or {}
    if certificates is None:  # TLS off (or not from cert-manager): no stale condition
        previous = [c for c in previous if c.get("type") != "CertificatesReady"]
    workloads = {"orchestrator": orchestrator, "prefill": prefill, "decode": decode}
    if redis is not None:
        workloads["redis"] = redis
    stuck = {name: w.stalled for name, w in workloads.items() if w.stalled is not None}
    rolling = [name for name, w in workloads.items() if w.rolling]
    mode = _mode(prefill, decode, fallback)
    unissued = sorted(name for name, ok in (certificates or {}).items() if not ok)
    degraded = "ApplyFailed" if failed else None
    degraded = degraded or ("ForeignObjects" if foreign else None)
    degraded = degraded or ("CertificatesNotReady" if unissued else None)
    degraded = degraded or _degraded_reason(orchestrator, prefill, decode, redis)
    degraded = degraded or ("RolloutStuck" if stuck else None)
    zero = [name for name, w in (("prefill", prefill), ("decode", decode)) if w.scaled_to_zero]
    at_zero = f"{' and '.join(zero)} scaled to 0 by the spec" if zero else ""
    serving = orchestrator.up and mode != UNAVAILABLE and (redis is None or redis.up)
    ready = serving and not failed and not stuck
    if ready:
        ready_message = f"serving {mode} ({at_zero})" if zero else f"serving {mode}"
    elif serving:
        ready_message = f"serving {mode}, but not as specified: {degraded}"
    elif degraded is None and zero:
        ready_message = f"not serving: {at_zero}" + (
            f" and failover.fallback is {fallback}" if len(zero) == 1 else ""
        )
    else:
        ready_message = "not serving"
    calm = "RollingUpdate" if rolling else ("ScaledToZero" if zero else "AllComponentsReady")
    conditions = [
        _condition(
            "Ready",
            ready,
            _mode_reason(mode) if ready else (degraded or ("ScaledToZero" if zero else "NotReady")),
            ready_message,
        ),
        _pool_condition("PrefillPoolReady", prefill),
        _pool_condition("DecodePoolReady", decode),
        _condition(
            "Degraded",
            degraded is not None,
            degraded or calm,
            _degraded_message(degraded, mode, foreign, failed, stuck, at_zero),
        ),
        _progressing(workloads, stuck, rolling),
        _reconciled(foreign, failed),
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
        _condition("Reconciled", False, "InvalidSpec", message),
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
    """What the orchestrators do: their placement falls back to aggregated when a pool has
    no live worker, whatever the reason (README "Failover")."""
    if prefill.up and decode.up:
        return DISAGGREGATED
    if (prefill.up or decode.up) and fallback == "local":
        missing = decode if prefill.up else prefill
        return AGGREGATED if missing.scaled_to_zero else AGGREGATED_FALLBACK
    return UNAVAILABLE


def _mode_reason(mode: str) -> str:
    return {DISAGGREGATED: "Disaggregated", AGGREGATED: "Aggregated"}.get(
        mode, "AggregatedFallback"
    )


def _degraded_reason(
    orchestrator: Workload, prefill: Workload, decode: Workload, redis: Workload | None
) -> str | None:
    if not orchestrator.up:
        return "OrchestratorUnavailable"
    if redis is not None and not redis.up:
        return "RedisUnavailable"
    # A pool is missing only if the spec wants pods in it.
    prefill_missing = not prefill.up and not prefill.scaled_to_zero
    decode_missing = not decode.up and not decode.scaled_to_zero
    if prefill_missing and decode_missing:
        return "NoWorkers"
    if prefill_missing:
        return "PrefillPoolUnavailable"
    if decode_missing:
        return "DecodePoolUnavailable"
    return None


def _degraded_message(
    reason: str | None,
    mode: str,
    foreign: Sequence[str],
    failed: Mapping[str, str],
    stuck: Mapping[str, str],
    at_zero: str,
) -> str:
    if reason is None:
        return f"{at_zero}; mode {mode}" if at_zero else "every component has a ready pod"
    if failed:
        return f"refused by the API (see Reconciled): {', '.join(failed)}; mode {mode}"
    if foreign:
        return f"not ours, left alone: {', '.join(foreign)}; mode {mode}"
    if reason == "RolloutStuck":
        return f"rollout stopped: {_stuck_list(stuck)}; mode {mode}"
    return f"{reason}; mode {mode}"


def _stuck_list(stuck: Mapping[str, str]) -> str:
    return ", ".join(f"{name} ({why})" for name, why in stuck.items())


def _progressing(
    workloads: Mapping[str, Workload], stuck: Mapping[str, str], rolling: Sequence[str]
) -> dict[str, Any]:
    if stuck:
        reason = next(iter(stuck.values()))
        return _condition(
            "Progressing",
            False,
            reason,
            f"rollout stopped: {_stuck_list(stuck)}; the previous pods, if any, keep serving",
        )
    if rolling:
        parts = []
        for name in rolling:
            w = workloads[name]
            detail = "spec not yet seen" if not w.observed else f"{w.updated}/{w.desired} updated"
            parts.append(f"{name} {detail}")
        return _condition("Progressing", True, "RollingUpdate", "rolling out: " + ", ".join(parts))
    return _condition("Progressing", False, "RolloutComplete", "every workload runs the spec")


def _reconciled(foreign: Sequence[str], failed: Mapping[str, str]) -> dict[str, Any]:
    if failed:
        messages = "; ".join(f"{ref}: {msg[:_MESSAGE_LIMIT]}" for ref, msg in failed.items())
        return _condition("Reconciled", False, "ApplyFailed", messages)
    if foreign:
        return _condition(
            "Reconciled", False, "ForeignObjects", f"not ours, left alone: {', '.join(foreign)}"
        )
    return _condition("Reconciled", True, "Applied", "every object applied")


def _pool_condition(kind: str, pool: Workload) -> dict[str, Any]:
    if pool.scaled_to_zero:
        still = f" ({pool.ready} pods still ready)" if pool.up else ""
        return _condition(kind, False, "ScaledToZero", f"scaled to 0 by the spec{still}")
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
