"""The history of a chaos run, after Jepsen: every client operation and every fault.

Pure. Times are seconds since the run's workload started, from one monotonic clock in the
process that drives the clients and injects the faults, so fault and token times compare.

A request's operations: ``invoke`` (a Generate call opened, attempt n), ``chunk`` (tokens
[index, index + len) arrived), then one of ``ok`` (the stream ended with a finish reason),
``fail`` (a definite error: the request is over) or ``info`` (indeterminate: the stream broke;
the client reconnects and resumes from the next index it needs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Op:
    t: float
    type: str
    """invoke | chunk | ok | fail | info"""
    request: str
    attempt: int = 0
    orchestrator: str = ""
    index: int = -1
    tokens: tuple[int, ...] = ()
    code: str = ""
    """fail / info: the gRPC status code name; ok: the finish reason."""
    detail: str = ""


@dataclass(slots=True)
class FaultRecord:
    at: float
    kind: str
    target: str
    resolved: str
    """What the target resolved to (worker or replica names), or why it was skipped."""
    affected: tuple[str, ...]
    """Request ids whose streams the fault hit (active at ``at`` and served by the target)."""
    healed_at: float | None = None
    error: str = ""
    wall_at: float = 0.0
    """Wall-clock time of the fault (to line it up with the processes' logs)."""
    journalled: dict[str, int] = field(default_factory=dict)
    """Affected request id → tokens in its journal once the fault took effect (a killed
    process reaped, a stopped one signalled): tokens below that index were produced before
    the fault, however late they reach the client, so they don't count as its recovery."""
    trigger: str = ""
    """For a fault with a trigger: the request and phase that fired it."""
    planned_at: float = 0.0
    """The fault's time in the plan (``at`` is when it was executed)."""
    late_s: float = 0.0
    """Executed this long after it was due: its time, the heals it waited for, or the moment
    its trigger was seen."""
    late: bool = False
    """``late_s`` is over the scenario's bound: the run's verdict fails."""
    late_cpu_share: float | None = None
    """A late fault: the runner process's CPU time over the wall time while it was late
    (`orchestrator.chaos.pace`): near 1 or more, the runner was busy; far less, the machine
    did not run it."""
    records_age_s: float | None = None
    """Age of the request records the target and the affected streams were read from (a
    watcher reads them all along, so a fault never waits for a read)."""
    outcome: str = ""
    """What the fault led to, once seen (a Redis Cluster primary's replica promoted, when)."""
    promoted_at: float | None = None
    """A ``redis:primary`` fault: when its replica served the primary's slots (None: not)."""

    def label(self) -> str:
        return f"{self.kind} {self.resolved or self.target}"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    key: int
    """Index in the workload: the reference output is looked up by it."""
    max_tokens: int


@dataclass(slots=True)
class History:
    run: int
    seed: int
    requests: dict[str, RequestSpec] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    end: float = 0.0

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def of(self, request_id: str) -> list[Op]:
        return [op for op in self.ops if op.request == request_id]

    def active_at(self, t: float) -> set[str]:
        """Requests invoked by ``t`` that had not ended (ok or fail) by then."""
        started: set[str] = set()
        ended: set[str] = set()
        for op in self.ops:
            if op.t > t:
                break
            if op.type == "invoke":
                started.add(op.request)
            elif op.type in {"ok", "fail"}:
                ended.add(op.request)
        return started - ended

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "seed": self.seed,
            "requests": [asdict(r) for r in self.requests.values()],
            "ops": [asdict(op) for op in self.ops],
            "faults": [asdict(f) for f in self.faults],
            "end": self.end,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json())
