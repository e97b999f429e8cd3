"""Placement: which workers run a request. Pure.

Prefill goes to the least-loaded prefill worker; decode to the decode worker with the most
KV headroom that can hold this request's KV (prompt + max output), ties broken by fewer
active sequences. When a whole pool is missing the request runs *aggregated* on a worker of
the other pool (``fallback="local"``) or is refused (``fallback="fail"``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from orchestrator.core.records import WorkerInfo
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
) -> Placement:
    """Pick workers for a request needing KV for ``total_tokens`` (prompt + max output).

    ``load``: worker id → (sequences, KV bytes) this replica has placed there and not yet
    finished (see `with_local_load`)."""
    banned = set(exclude)
    known = load or {}
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
    if decodes:
        fitting: list[tuple[int, int, str, WorkerInfo]] = []  # (headroom, -active, id, w)
        for w, active, used in decodes:
            free = max(0, w.kv_capacity_bytes - used)
            if free >= _kv_need(w, total_tokens):
                fitting.append((free, -active, w.worker_id, w))
        if not fitting:
            raise OverloadedError("no decode worker has KV room for this request", 1.0)
        decode = with_local_load(max(fitting, key=lambda f: f[:3])[3], known)
        if prefills:
            chosen = min(prefills, key=lambda p: (p[1], p[0].worker_id))[0]
            prefill = with_local_load(chosen, known)
            return Placement(Mode.DISAGGREGATED, prefill, decode, "both pools up")
        if fallback != "local":
            raise UnavailableError("prefill pool is down and fallback is 'fail'")
        return Placement(Mode.AGGREGATED, None, decode, "prefill pool down: aggregated")
    if fallback != "local":
        raise UnavailableError("decode pool is down and fallback is 'fail'")
    worker = with_local_load(min(prefills, key=lambda p: (p[1], p[0].worker_id))[0], known)
    return Placement(Mode.AGGREGATED, None, worker, "decode pool down: aggregated on prefill")
