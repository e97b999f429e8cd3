"""Placement: which workers run a request. Pure.

Prefill goes to the worker whose queue clears first (queued prompt tokens over its measured
rate; queued tokens alone before rates are known), ties broken by fewer active sequences.
Decode goes, among the workers with KV headroom for this request (prompt + max output), to
the one running the fewest sequences (a decode step's time, so every stream's TPOT, grows
with the batch), ties broken by more headroom. With both pools up, ``decide`` may keep a
short prompt on the decode worker (conditional disaggregation, `orchestrator.core.admission`).
When a whole pool is missing the request runs *aggregated* on a worker of the other pool
(``fallback="local"``) or is refused (``fallback="fail"``).

A prefill and a decode worker are paired only if the decode's KV receiver takes the
prefill's sender (`transport.backend_names.receiver_takes`: a ``tcp`` decode worker takes
only ``tcp`` prefill workers; either UCX backend takes either; a worker that publishes no
transport is assumed to match). A decode worker no prefill worker can reach — a
misconfigured ``--transport`` — is left out of disaggregated placement (otherwise every
request placed there would fail its transfer and be re-prefilled); when no pair can move
KV at all, requests run aggregated on the decode pool, and the reason says why.

A pool is *down* only when it has no live worker this request may use (none registered, or
every one failed this request: ``exclude``). Circuit breakers (``held_back``) are advice:
within a pool, workers they don't hold back come first, then half-open ones (a probe in
flight: a live worker, likely healthy), then open ones. Only a pool whose every worker's
breaker is *open* is bypassed for the other pool (aggregated, ``fallback="local"``). The
placement's ``reason`` — written on the request's record — says which of these happened.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from orchestrator.core.admission import Decision
from orchestrator.core.breaker import BreakerState
from orchestrator.core.records import WorkerInfo
from orchestrator.core.routing import Hint, pick_decode, pick_prefill
from orchestrator.errors import OverloadedError, UnavailableError
from transport.backend_names import receiver_takes


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


_TIER = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
"""Placement's preference by breaker state (lower first)."""


def _down(role: str, workers: Sequence[WorkerInfo], banned: set[str]) -> str:
    """Why the ``role`` pool cannot take this request: none live, or all failed it."""
    failed = sorted(w.worker_id for w in workers if w.role == role and w.worker_id in banned)
    if failed:
        return f"{role} pool unusable: its live workers failed this request ({', '.join(failed)})"
    return f"{role} pool down: no live {role} worker"


def reaches(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """Whether ``prefill``'s KV sender can reach ``decode``'s receiver (a worker that
    publishes no transport, e.g. an older one, is assumed to match)."""
    if not prefill.transport or not decode.transport:
        return True
    return receiver_takes(decode.transport, prefill.transport)


_UNPAIRED = "no prefill worker's KV transport reaches a decode worker (check --transport)"

_Pool = list[tuple[WorkerInfo, int, int]]


def _takes(receiver: str, senders: set[str]) -> bool:
    """Whether a decode worker whose receiver is ``receiver`` takes KV from some prefill
    worker whose sender is in ``senders`` (`reaches`, asked once per transport rather than
    per pair of workers: this runs per request over every worker)."""
    if not receiver or "" in senders:
        return True
    return any(receiver_takes(receiver, sender) for sender in senders)


def _pair(prefills: _Pool, decodes: _Pool) -> tuple[_Pool, _Pool, str]:
    """The decode workers some prefill worker can send KV to; none: no prefill worker
    (aggregated) and why."""
    if not prefills or not decodes:
        return prefills, decodes, ""
    senders = {p[0].transport for p in prefills}
    takes = {t: _takes(t, senders) for t in {d[0].transport for d in decodes}}
    paired = [d for d in decodes if takes[d[0].transport]]
    if not paired:
        return [], decodes, _UNPAIRED
    return prefills, paired, ""


def _held(role: str, chosen: WorkerInfo, state: BreakerState) -> str:
    """A note for a reason: ``chosen`` was placed on although its breaker holds it back."""
    if state is BreakerState.HALF_OPEN:
        return f"{role} {chosen.worker_id} half-open, probed again (no closed {role} worker)"
    return f"{role} {chosen.worker_id}'s breaker open, placed anyway (no other {role} worker)"


def _bypass(
    prefill: WorkerInfo, p_state: BreakerState, decode: WorkerInfo, d_state: BreakerState
) -> Placement | None:
    """When one pool's every usable worker just failed (breakers open) and the other's
    did not, the other pool runs the request alone, saying so. Both pools open: breakers
    are advice, disaggregate anyway (None)."""
    if (d_state is BreakerState.OPEN) == (p_state is BreakerState.OPEN):
        return None
    if d_state is BreakerState.OPEN:
        reason = "every decode worker's breaker is open (all just failed): aggregated on prefill"
        return Placement(Mode.AGGREGATED, None, prefill, reason)
    reason = "every prefill worker's breaker is open (all just failed): aggregated"
    return Placement(Mode.AGGREGATED, None, decode, reason)


def _pick_decode(
    decodes: Sequence[tuple[WorkerInfo, int, int]],
    total_tokens: int,
    breaker: Callable[[WorkerInfo], BreakerState],
    hint: Hint | None,
) -> tuple[WorkerInfo, str]:
    """Among (worker, active, KV used) with KV room for the request, the least held back;
    among those the fewest sequences, then the most headroom — or, with a routing ``hint``,
    the holder of the longest prefix within its slack. And a note for the reason."""
    fitting: list[tuple[int, int, int, str, WorkerInfo]] = []  # (tier, active, -headroom, id, w)
    for w, active, used in decodes:
        free = max(0, w.kv_capacity_bytes - used)
        if free >= _kv_need(w, total_tokens):
            fitting.append((_TIER[breaker(w)], active, -free, w.worker_id, w))
    if not fitting:
        raise OverloadedError("no decode worker has KV room for this request", 1.0)
    tier = min(f[0] for f in fitting)
    best = [f[1:] for f in fitting if f[0] == tier]
    if hint is None:
        return min(best, key=lambda f: f[:3])[3], ""
    return pick_decode(best, hint)


def place(
    workers: Sequence[WorkerInfo],
    total_tokens: int,
    *,
    fallback: str = "local",
    exclude: Iterable[str] = (),
    held_back: Mapping[str, BreakerState] | None = None,
    load: Mapping[str, tuple[int, int]] | None = None,
    queue: Mapping[str, int] | None = None,
    rates: Mapping[str, float] | None = None,
    decide: Callable[[WorkerInfo, WorkerInfo], Decision] | None = None,
    hint: Hint | None = None,
) -> Placement:
    """Pick workers for a request needing KV for ``total_tokens`` (prompt + max output).

    ``exclude``: workers this request must not use (they failed it). ``held_back``: worker
    id -> its breaker's state, for workers the breakers advise against (see the module's
    docstring). ``load``: worker id -> (sequences, KV bytes) this replica has placed there
    and not yet finished (see `with_local_load`). ``queue``: prefill worker id -> prompt
    tokens this replica placed there and not yet prefilled; ``rates``: prefill worker id ->
    measured tokens/s. ``decide(prefill, decode)``: whether to run aggregated anyway.
    ``hint``: the prefixes workers hold (`orchestrator.core.routing`): it orders workers
    within a breaker tier, never across; its notes join the reason."""
    banned = set(exclude)
    held = held_back or {}
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
    prefills, decodes, unpaired = _pair(prefills, decodes)

    def breaker(w: WorkerInfo) -> BreakerState:
        return held.get(w.worker_id, BreakerState.CLOSED)

    def prefill_key(p: tuple[WorkerInfo, int, int]) -> tuple[int, float, int, str]:
        w, active, _ = p
        tokens = queued.get(w.worker_id, 0)
        rate = speed.get(w.worker_id)
        return (_TIER[breaker(w)], tokens / rate if rate else float(tokens), active, w.worker_id)

    def best_prefill() -> tuple[WorkerInfo, str]:
        if hint is None:
            return min(prefills, key=prefill_key)[0], ""
        tier = min(_TIER[breaker(p[0])] for p in prefills)
        best = [(w, active) for w, active, _ in prefills if _TIER[breaker(w)] == tier]
        return pick_prefill(best, queued, speed, hint)

    def why(reason: str, *notes: str) -> str:
        return "; ".join([reason, *(n for n in notes if n)])

    if not decodes:
        if fallback != "local":
            raise UnavailableError("decode pool is down and fallback is 'fail'")
        picked, pnote = best_prefill()
        reason = why(f"{_down('decode', workers, banned)}: aggregated on prefill", pnote)
        return Placement(Mode.AGGREGATED, None, with_local_load(picked, known), reason)
    chosen, dnote = _pick_decode(decodes, total_tokens, breaker, hint)
    decode = with_local_load(chosen, known)
    if not prefills:
        if fallback != "local":
            raise UnavailableError(f"{unpaired or 'prefill pool is down'} and fallback is 'fail'")
        reason = why(f"{unpaired or _down('prefill', workers, banned)}: aggregated", dnote)
        return Placement(Mode.AGGREGATED, None, decode, reason)
    senders = {t: _takes(chosen.transport, {t}) for t in {p[0].transport for p in prefills}}
    prefills = [p for p in prefills if senders[p[0].transport]]  # not empty: chosen is paired
    picked, pnote = best_prefill()
    prefill = with_local_load(picked, known)
    d_state, p_state = breaker(decode), breaker(prefill)
    if fallback == "local" and (bypass := _bypass(prefill, p_state, decode, d_state)):
        return bypass
    notes = [
        _held(role, w, state)
        for role, w, state in (("prefill", prefill, p_state), ("decode", decode, d_state))
        if state is not BreakerState.CLOSED
    ]
    if decide is not None:
        decision = decide(prefill, decode)
        if decision.aggregate:
            return Placement(
                Mode.AGGREGATED, None, decode, why(decision.reason, dnote, *notes), True
            )
        reason = why(decision.reason, pnote, dnote, *notes)
        return Placement(Mode.DISAGGREGATED, prefill, decode, reason)
    return Placement(
        Mode.DISAGGREGATED, prefill, decode, why("both pools up", pnote, dnote, *notes)
    )
