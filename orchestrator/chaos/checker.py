"""The chaos checker: a history and a fault-free reference in, a verdict out. Pure.

Per request, the client's chunks (across every reconnect) must tile [0, n) exactly: an index
received twice is a *duplicate*, an index skipped is a *gap* — including a stream that ended
"length" short of its max_tokens (silent truncation). An acknowledged request (the client
saw a token, or the store has its record) that has no terminal state after the quiet period
is *lost*. A completed output that differs from the reference run's is *mismatched*.
Recovery of a fault: for every stream it hit, the time from the fault to that stream's next
token (or its end, if no token was left to send). Leaks (`leaks`): after the quiet period
every worker's KV in use and active sequences are back to 0, and every vLLM block pool has
its free blocks back (``leaked_blocks``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.chaos.history import FaultRecord, History
from orchestrator.chaos.leaks import LeakReport
from orchestrator.core.state import TERMINAL

TERMINAL_STATES = frozenset(str(s) for s in TERMINAL)


@dataclass(slots=True)
class RequestVerdict:
    request_id: str
    outcome: str
    """ok | fail | indeterminate (the client gave up without a definite answer)"""
    tokens: int
    duplicates: int
    gaps: int
    lost: bool
    mismatched: bool
    first_divergence: int | None = None


@dataclass(slots=True)
class RunVerdict:
    run: int
    seed: int
    requests: list[RequestVerdict]
    recoveries: list[tuple[str, str, float]]
    """(fault label, request id, seconds from fault to next token)"""
    unrecovered: list[tuple[str, str]]
    errors: Counter[str]
    faults: int
    failovers: int = 0
    """Reassignments the store recorded (epoch - 1 summed over the run's requests)."""
    leaks: LeakReport | None = None
    """The workers' gauges after the quiet period (None: not checked)."""
    fault_errors: int = 0
    """Faults that could not be injected (or whose trigger was never met), or not healed."""
    late_faults: int = 0
    """Faults executed later than the scenario's bound after they were due."""
    late_max_s: float = 0.0
    """The latest any fault was executed after it was due (late or not: how close the run
    came to its bound)."""
    fault_notes: list[str] = field(default_factory=list)
    """What went wrong with each fault not injected or late."""

    @property
    def clean(self) -> bool:
        leaking = self.leaks is not None and not self.leaks.clean
        dishonest = self.fault_errors or self.late_faults  # the run did not test its plan
        return (
            not leaking
            and not dishonest
            and not any(r.lost or r.duplicates or r.gaps for r in self.requests)
        )


def check_run(
    history: History,
    reference: Mapping[int, tuple[int, ...]],
    server_states: Mapping[str, str],
    epochs: Mapping[str, int] | None = None,
    leaks: LeakReport | None = None,
) -> RunVerdict:
    """Judge one run. ``server_states``: request id → state read from the store after the
    quiet period ("" when the store has no record); ``epochs``: request id → final epoch;
    ``leaks``: the workers' gauges checked after it (`leaks.check_leaks`)."""
    verdicts = [
        _request(history, rid, reference, server_states.get(rid, "")) for rid in history.requests
    ]
    errors: Counter[str] = Counter(op.code for op in history.ops if op.type in {"fail", "info"})
    recoveries: list[tuple[str, str, float]] = []
    unrecovered: list[tuple[str, str]] = []
    for fault in history.faults:
        for rid in fault.affected:
            # The first token produced after the fault: with the journal's length at the
            # fault known, chunks already on their way (produced before it) don't count.
            first_new = fault.journalled.get(rid, 0)
            after = next(
                (
                    op
                    for op in history.ops
                    if op.request == rid
                    and op.t > fault.at
                    and (
                        (op.type == "chunk" and op.tokens and op.index + len(op.tokens) > first_new)
                        or op.type == "ok"
                    )
                ),
                None,
            )
            if after is None:
                unrecovered.append((fault.label(), rid))
            else:
                recoveries.append((fault.label(), rid, after.t - fault.at))
    failovers = sum(max(0, e - 1) for e in (epochs or {}).values())
    return RunVerdict(
        history.run,
        history.seed,
        verdicts,
        recoveries,
        unrecovered,
        errors,
        len(history.faults),
        failovers,
        leaks,
        sum(1 for f in history.faults if f.error),
        sum(1 for f in history.faults if f.late),
        max((f.late_s for f in history.faults), default=0.0),
        [
            f"{f.label()} at {f.at:.3f}s: "
            + (f.error or f"executed {f.late_s * 1000:.0f} ms after it was due" + _why_late(f))
            for f in history.faults
            if f.error or f.late
        ],
    )


def _why_late(fault: FaultRecord) -> str:
    """A late fault's cause, from the runner's CPU time while it was late."""
    share = fault.late_cpu_share
    if share is None:
        return ""
    cause = "the runner was busy" if share >= 0.5 else "the machine did not run the runner"
    return f" (the runner's process used {share:.0%} of a core meanwhile: {cause})"


def _request(
    history: History, rid: str, reference: Mapping[int, tuple[int, ...]], state: str
) -> RequestVerdict:
    spec = history.requests[rid]
    ops = history.of(rid)
    received: list[int] = []
    duplicates = gaps = 0
    for op in ops:
        if op.type != "chunk" or not op.tokens:
            continue
        end = op.index + len(op.tokens)
        if op.index < len(received):  # overlap with what the client already has
            duplicates += min(end, len(received)) - op.index
        elif op.index > len(received):
            gaps += op.index - len(received)
            received.extend([-1] * (op.index - len(received)))
        received.extend(op.tokens[max(0, len(received) - op.index) :])
    final = next((op for op in reversed(ops) if op.type in {"ok", "fail"}), None)
    outcome = "indeterminate" if final is None else final.type
    if final is not None and final.type == "ok" and final.code in {"cancelled", "error"}:
        outcome = "fail"  # the stream ended, but not because the output was complete
    if final is not None and final.type == "ok" and final.code == "length":
        gaps += max(0, spec.max_tokens - len(received))  # ended "length" short: truncated
    acknowledged = bool(received) or bool(state)
    lost = acknowledged and state not in TERMINAL_STATES
    mismatched = False
    divergence: int | None = None
    expected = reference.get(spec.key)
    if outcome == "ok" and expected is not None and tuple(received) != expected:
        mismatched = True
        divergence = next(
            (i for i, (a, b) in enumerate(zip(received, expected, strict=False)) if a != b),
            min(len(received), len(expected)),
        )
    return RequestVerdict(rid, outcome, len(received), duplicates, gaps, lost, mismatched,
                          divergence)  # fmt: skip


# ----------------------------------------------------------------------------- summary


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(slots=True)
class Summary:
    scenario: str
    runs: list[RunVerdict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        reqs = [r for run in self.runs for r in run.requests]
        recovery = [s for run in self.runs for _, _, s in run.recoveries]
        errors: Counter[str] = Counter()
        for run in self.runs:
            errors.update(run.errors)
        p50, p99 = percentile(recovery, 50), percentile(recovery, 99)
        leaks = [run.leaks.to_json() for run in self.runs if run.leaks is not None]
        settled = [x["settle_s"] for x in leaks if x["settle_s"] is not None]
        return {
            "scenario": self.scenario,
            "runs": len(self.runs),
            "requests": len(reqs),
            "lost": sum(r.lost for r in reqs),
            "duplicates": sum(r.duplicates for r in reqs),
            "gaps": sum(r.gaps for r in reqs),
            "mismatched": sum(r.mismatched for r in reqs),
            "failed": sum(r.outcome == "fail" for r in reqs),
            "indeterminate": sum(r.outcome == "indeterminate" for r in reqs),
            "faults": sum(run.faults for run in self.runs),
            "fault_errors": sum(run.fault_errors for run in self.runs),
            "late_faults": sum(run.late_faults for run in self.runs),
            "late_max_s": max((run.late_max_s for run in self.runs), default=0.0),
            "failovers": sum(run.failovers for run in self.runs),
            "recoveries": len(recovery),
            "unrecovered": sum(len(run.unrecovered) for run in self.runs),
            "recovery_p50_s": None if p50 is None else round(p50, 4),
            "recovery_p99_s": None if p99 is None else round(p99, 4),
            "recovery_max_s": None if not recovery else round(max(recovery), 4),
            "errors": dict(sorted(errors.items())),
            "leak_checks": len(leaks),
            "leaked_blocks": sum(x["leaked_blocks"] for x in leaks),
            "kv_in_use_bytes": sum(x["kv_in_use_bytes"] for x in leaks),
            "active_after_quiet": sum(x["active_after_quiet"] for x in leaks),
            "pool_blocks_checked": sum(x["pool_blocks_checked"] for x in leaks),
            "leak_settle_max_s": round(max(settled), 3) if settled else None,
        }

    def violations(self, invariants: Iterable[str]) -> list[str]:
        s = self.to_json()
        wanted = set(invariants)
        # Always: a fault not injected, or injected late, means the run did not test its plan.
        out = [f"{key}={s[key]}" for key in ("fault_errors", "late_faults") if s[key]]
        for inv, key in (("no_lost", "lost"), ("no_duplicates", "duplicates"),
                         ("no_gaps", "gaps"), ("outputs_match", "mismatched"),
                         ("no_leaks", "leaked_blocks"), ("no_leaks", "kv_in_use_bytes"),
                         ("no_leaks", "active_after_quiet")):  # fmt: skip
            if inv in wanted and s[key]:
                out.append(f"{key}={s[key]}")
        return out

    def human(self) -> str:
        s = self.to_json()
        lines = [
            f"scenario {s['scenario']}: {s['runs']} run(s), {s['requests']} requests, "
            f"{s['faults']} faults"
            + (f" (at most {s['late_max_s'] * 1000:.0f} ms late)" if s["faults"] else "")
            + f", {s['failovers']} failovers (epoch bumps)",
            f"  lost {s['lost']}  duplicates {s['duplicates']}  gaps {s['gaps']}  "
            f"mismatched {s['mismatched']}  failed {s['failed']}  "
            f"indeterminate {s['indeterminate']}",
        ]
        if s["recoveries"]:
            lines.append(
                f"  recovery (fault → next token, {s['recoveries']} streams): "
                f"p50 {s['recovery_p50_s'] * 1000:.0f} ms  p99 {s['recovery_p99_s'] * 1000:.0f} ms"
                f"  max {s['recovery_max_s'] * 1000:.0f} ms; unrecovered {s['unrecovered']}"
            )
        if s["leak_checks"]:
            settle = s["leak_settle_max_s"]
            lines.append(
                f"  after the quiet period: leaked blocks {s['leaked_blocks']}  KV in use "
                f"{s['kv_in_use_bytes']} bytes  active {s['active_after_quiet']}"
                + ("" if settle is None else f"  (settled within {settle * 1000:.0f} ms)")
            )
        if s["fault_errors"] or s["late_faults"]:
            lines.append(
                f"  faults not injected or not healed {s['fault_errors']}  late {s['late_faults']}"
            )
            for run in self.runs:
                lines += [f"  run {run.run} (seed {run.seed}) fault: {e}" for e in run.fault_notes]
        if s["errors"]:
            codes = ", ".join(f"{k} {v}" for k, v in s["errors"].items())
            lines.append(f"  errors seen by clients (incl. retried): {codes}")
        for run in self.runs:
            for r in run.requests:
                if r.lost or r.duplicates or r.gaps or r.mismatched:
                    lines.append(
                        f"  run {run.run} (seed {run.seed}) {r.request_id}: outcome {r.outcome}, "
                        f"lost {r.lost}, duplicates {r.duplicates}, gaps {r.gaps}, "
                        f"mismatched {r.mismatched} (first divergence {r.first_divergence})"
                    )
            if run.leaks is not None and not run.leaks.clean:
                by = run.leaks.to_json()["by_worker"]
                lines.append(f"  run {run.run} (seed {run.seed}) leaks: {by}")
        return "\n".join(lines)
