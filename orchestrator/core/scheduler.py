"""Placement: which workers run a request. Pure.

Prefill goes to the worker whose queue clears first (queued prompt tokens over its measured
rate; queued tokens alone before rates are known), ties broken by fewer active sequences.
Decode goes, among the workers with KV headroom for this request (prompt + max output), to
the one running the fewest sequences (a decode step's time, so every stream's TPOT, grows
with the batch), ties broken by more headroom. With both pools up, ``decide`` may keep a
short prompt on the decode worker (conditional disaggregation, `orchestrator.core.admission`).
When a whole pool is missing the request runs *aggregated* on a worker of the other pool
(``fallback="local"``) or is refused (``fallback="fail"``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from orchestrator.core.admission import Decision
from orchestrator.core.records import WorkerInfo
from orchestrator.core.routing import Hint, pick_decode, pick_prefill
from orchestrator.errors import OverloadedError, UnavailableError


class Mode(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


@dataclass(frozen=True, slots=True)
class Placement:
    mode: Mode
    prefill: WorkerInfo | None
    """None when aggregated."""
    decode: WorkerInfo
    """The worker that decodes (and, aggregated, also prefills)."""
    reason: str
    by_choice: bool = False
    """Aggregated by conditional disaggregation, not because a pool is down."""


def _kv_need(w: WorkerInfo, tokens: int) -> int:
    return tokens * w.kv_bytes_per_token


def with_local_load(w: WorkerInfo, load: Mapping[str, tuple[int, int]]) -> WorkerInfo:
    """``w`` as this replica knows it: heartbeats lag (one a second), so requests this replica
    placed since may be missing from them. Its own (sequences, KV bytes) on ``w`` are a lower
    bound of the worker's load; without this, a burst of admissions all lands on one worker."""
    active, kv = load.get(w.worker_id, (0, 0))
    if active <= w.active and kv <= w.kv_used_bytes:
        return w
    return replace(w, active=max(w.active, active), kv_used_bytes=max(w.kv_used_bytes, kv))


def place(
    workers: Sequence[WorkerInfo],
    total_tokens: int,
    *,
    fallback: str = "local",
    exclude: Iterable[str] = (),
    load: Mapping[str, tuple[int, int]] | None = None,
    queue: Mapping[str, int] | None = None,
    rates: Mapping[str, float] | None = None,
    decide: Callable[[WorkerInfo, WorkerInfo], Decision] | None = None,
    hint: Hint | None = None,
) -> Placement:
    """Pick workers for a request needing KV for ``total_tokens`` (prompt + max output).

    ``load``: worker id → (sequences, KV bytes) this replica has placed there and not yet
    finished (see `with_local_load`). ``queue``: prefill worker id → prompt tokens this
    replica placed there and not yet prefilled; ``rates``: prefill worker id → measured
    tokens/s. ``decide(prefill, decode)``: whether to run aggregated anyway. ``hint``: the
    prefixes workers hold (`orchestrator.core.routing`); its notes join the reason."""
    banned = set(exclude)
    known = load or {}
    queued = queue or {}
    speed = rates or {}
    # (worker, active, KV used) as this replica knows them: the workers themselves are only
    # copied for the ones chosen (this runs per request over every worker).
    prefills: list[tuple[WorkerInfo, int, int]] = []
    decodes: list[tuple[WorkerInfo, int, int]] = []
    for w in workers:
        if w.worker_id in banned or w.role not in ("prefill", "decode"):
            continue
        active, kv = known.get(w.worker_id, (0, 0))
        pool = prefills if w.role == "prefill" else decodes
        pool.append((w, max(w.active, active), max(w.kv_used_bytes, kv)))
    if not prefills and not decodes:
        raise UnavailableError("no workers available")

    def prefill_key(p: tuple[WorkerInfo, int, int]) -> tuple[float, int, str]:
        w, active, _ = p
        tokens = queued.get(w.worker_id, 0)
        rate = speed.get(w.worker_id)
        return (tokens / rate if rate else float(tokens), active, w.worker_id)

    def best_prefill() -> tuple[WorkerInfo, str]:
        if hint is None:
            return min(prefills, key=prefill_key)[0], ""
        return pick_prefill([(p[0], p[1]) for p in prefills], queued, speed, hint)

    def why(reason: str, *notes: str) -> str:
        return "; ".join([reason, *(n for n in notes if n)])

    if decodes:
        fitting: list[tuple[int, int, str, WorkerInfo]] = []  # (active, -headroom, id, w)
        for w, active, used in decodes:
            free = max(0, w.kv_capacity_bytes - used)
            if free >= _kv_need(w, total_tokens):
                fitting.append((active, -free, w.worker_id, w))
        if not fitting:
            raise OverloadedError("no decode worker has KV room for this request", 1.0)
        chosen, dnote = (
            (min(fitting, key=lambda f: f[:3])[3], "")
            if hint is None
            else pick_decode(fitting, hint)
        )
        decode = with_local_load(chosen, known)
        if prefills:
            picked, pnote = best_prefill()
            prefill = with_local_load(picked, known)
            if decide is not None:
                decision = decide(prefill, decode)
                if decision.aggregate:
                    return Placement(
                        Mode.AGGREGATED, None, decode, why(decision.reason, dnote), True
                    )
                return Placement(
                    Mode.DISAGGREGATED, prefill, decode, why(decision.reason, pnote, dnote)
                )
            reason = why("both pools up", pnote, dnote)
            return Placement(Mode.DISAGGREGATED, prefill, decode, reason)
        if fallback != "local":
            raise UnavailableError("prefill pool is down and fallback is 'fail'")
        return Placement(Mode.AGGREGATED, None, decode, why("prefill pool down: aggregated", dnote))
    if fallback != "local":
        raise UnavailableError("decode pool is down and fallback is 'fail'")
    picked, pnote = best_prefill()
    reason = why("decode pool down: aggregated on prefill", pnote)
    return Placement(Mode.AGGREGATED, None, with_local_load(picked, known), reason)
