"""The placement ledger: what this replica knows of its workers beyond their heartbeats.

Heartbeats say what a worker holds; the ledger adds what this replica has *sent* it and not
seen finish (sequences and KV bytes per worker, requests and prompt tokens waiting in each
prefill worker's queue), the measured prefill rates and KV transfer costs (`Rates`), and
per-worker circuit breakers (`Breakers`). From these it answers the two questions the pure
core decides: admit this prompt now (`estimate`, `orchestrator.core.admission.admit`), and
where it runs — disaggregated or not (`place`, `orchestrator.core.scheduler.place` with the
conditional-disaggregation rule `disaggregate_or_not`).

Both run per request over a listing of the live workers that serves many requests: what
depends only on the listing (its pools, what the prefix caches hold) is derived once per
listing (`orchestrator.core.fleet.Fleet`), and placement over a pool larger than
``placement_sample`` chooses among that many of its workers drawn at random (plus the
holders of the request's prefix; the whole listing again if none of them has room, or if
the draw would run the request aggregated where it need not).

A placement is *booked* (`Booking`) for the length of one attempt and released after it,
whatever its end. The first attempt's is booked before the request's record is created, so
that the record is created placed (`placed`: one store call less per request).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator import errors
from orchestrator.control.settings import ControlSettings
from orchestrator.core.admission import Decision, PrefillQueue, admit, disaggregate_or_not
from orchestrator.core.breaker import Breakers
from orchestrator.core.fleet import Fleet
from orchestrator.core.hardware import get_gpu
from orchestrator.core.prefix import PrefixIndex
from orchestrator.core.rates import Rates
from orchestrator.core.records import WorkerInfo
from orchestrator.core.routing import Hint, hint_from
from orchestrator.core.scheduler import Mode, Placement, place
from orchestrator.core.state import Edge


def breaker_key(w: WorkerInfo) -> str:
    """Breakers follow a worker *process*: a restarted worker (new address) starts closed."""
    return f"{w.worker_id}@{w.address}"


@dataclass(slots=True)
class Booking:
    """One attempt's placement, counted in the ledger until `Ledger.release`."""

    placement: Placement
    kv_need: int
    chosen: dict[str, WorkerInfo]
    queued: tuple[str, int] | None = None
    """(prefill worker, tokens) while the attempt waits in that worker's queue."""
    used: list[str] = field(default_factory=list)
    """The breaker keys of the chosen workers."""
    decode_prefix: tuple[int, int] = (0, 0)
    """(leading tokens, block size) of the request's KV the decode worker holds, as the
    prefix index says: what a suffix-only transfer may leave out."""


def placed(placement: Placement) -> tuple[Edge, dict[str, str]]:
    """The edge out of queued that ``placement`` takes and the fields it records: the same
    whether an attempt takes it as a transition (`orchestrator.control.dispatch`) or the
    request's record is created with it (`orchestrator.control.intake`)."""
    if placement.mode is Mode.DISAGGREGATED:
        assert placement.prefill is not None
        return Edge.PREFILL, {
            "mode": str(Mode.DISAGGREGATED),
            "placement": placement.reason,
            "prefill_worker": placement.prefill.worker_id,
            "decode_worker": placement.decode.worker_id,
        }
    return Edge.AGGREGATE, {
        "mode": str(Mode.AGGREGATED),
        "placement": placement.reason,
        "decode_worker": placement.decode.worker_id,
        "prefill_worker": "",
    }


class Ledger:
    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self.breakers = Breakers(settings.breaker_cooldown_s)
        self.rates = Rates()
        """Measured prefill rates and KV transfer costs (admission and placement read them)."""
        self._load: dict[str, tuple[int, int]] = {}
        """Worker id -> (sequences, KV bytes) this replica placed there and has not finished."""
        self._queue: dict[str, tuple[int, int]] = {}
        """Prefill worker id -> (requests, prompt tokens) this replica sent and not yet
        prefilled: the bounded queues admission checks."""
        self.prefixes = PrefixIndex()
        """What the workers' prefix caches hold, as their last heartbeats said."""
        self._fleet: Fleet | None = None
        """The last listing, split (`fleet`)."""
        self.rng = random.Random()  # noqa: S311 - spreads load, not secrets
        """Draws sampled placement's candidates (seeded by tests)."""

    def fleet(self, workers: Sequence[WorkerInfo]) -> Fleet:
        """``workers`` split once per listing (the directory hands out one list object per
        listing); a new listing also brings the prefix index up to its heartbeats."""
        fleet = self._fleet
        if fleet is None or fleet.workers is not workers:
            fleet = self._fleet = Fleet.of(workers)
            if self.settings.routing.enabled:
                self.prefixes.sync(fleet.prefixes)
        return fleet

    def booked(self) -> dict[str, tuple[int, int]]:
        """Worker id -> (sequences, KV bytes) booked here and not released (a copy): empty
        when this replica drives nothing."""
        return dict(self._load)

    # ------------------------------------------------------------------ admission

    def estimate(
        self, workers: Sequence[WorkerInfo], prompt_tokens: int, driving: int
    ) -> float | None:
        """The estimated TTFT of a new prompt (None before rates are measured); raises
        OverloadedError (with a retry-after) for what would only queue to time out.

        Over a prefill pool larger than ``placement_sample``, estimated from that many
        queues drawn at random (never below the estimate over all of them); a refusal is
        confirmed over every queue, so a draw refuses nothing a scan would admit."""
        fleet = self.fleet(workers)
        prefills, sample = fleet.prefill, self.settings.placement_sample
        if sample and len(prefills) > sample:
            drawn = self.rng.sample(prefills, sample)
            try:
                return self._estimate(drawn, fleet.decode, prompt_tokens, driving)
            except errors.OverloadedError:
                pass  # confirmed over every queue: a draw never refuses what a scan admits
        return self._estimate(prefills, fleet.decode, prompt_tokens, driving)

    def _estimate(
        self,
        prefills: Sequence[WorkerInfo],
        decodes: Sequence[WorkerInfo],
        prompt_tokens: int,
        driving: int,
    ) -> float | None:
        queues = []
        for w in prefills:
            requests, tokens = self._queue.get(w.worker_id, (0, 0))
            rate = self.rates.prefill_rate(w.worker_id, w.gpu_kind)
            queues.append(PrefillQueue(w.worker_id, requests, tokens, rate))
        transfer = self.rates.transfer_model()
        kv_bytes = prompt_tokens * (decodes[0].kv_bytes_per_token if decodes else 0)
        transfer_s = transfer.seconds(kv_bytes) if transfer is not None and decodes else 0.0
        return admit(
            prompt_tokens, queues, transfer_s, self.settings.admission, driving
        ).ttft_estimate_s

    # ------------------------------------------------------------------ placement

    def place(
        self,
        workers: Sequence[WorkerInfo],
        *,
        need: int,
        prefill_tokens: int,
        excluded: set[str],
        now: float,
        tokens: Sequence[int] = (),
    ) -> Booking:
        """Place an attempt (``need``: context tokens; ``prefill_tokens``: what a prefill
        computes, ``tokens`` those tokens for KV-aware routing) avoiding ``excluded`` and,
        while others are left, workers whose breakers hold them back
        (`orchestrator.core.scheduler.place` says how)."""
        fleet = self.fleet(workers)
        hint = hint_from(self.prefixes, tokens, self.settings.routing)
        sample = self.settings.placement_sample
        placement: Placement | None = None
        if fleet.sampled(sample):
            # The holders of the longest prefixes (a prefix every worker holds, e.g. a
            # shared system prompt, would otherwise bring the whole pool back).
            keep = heapq.nlargest(sample, hint.cached, key=hint.cached.__getitem__) if hint else ()
            candidates = fleet.candidates(sample, self.rng, keep)
            try:
                placement = self._place(candidates, need, prefill_tokens, excluded, now, hint)
            except (errors.OverloadedError, errors.UnavailableError):
                placement = None  # none drawn has room (or can be used): the whole listing
            aggregated = placement is not None and placement.mode is Mode.AGGREGATED
            if aggregated and placement is not None and not placement.by_choice:
                placement = None  # no pair among those drawn (transports, breakers): all
        if placement is None:
            placement = self._place(workers, need, prefill_tokens, excluded, now, hint)
        chosen = {w.worker_id: w for w in (placement.prefill, placement.decode) if w}
        booking = Booking(placement, need * placement.decode.kv_bytes_per_token, chosen)
        self._count(placement.decode.worker_id, 1, booking.kv_need)
        if placement.prefill is not None:
            wid = placement.prefill.worker_id
            # What it will compute: its cache's share is no queue (routing's estimate).
            compute = prefill_tokens - (hint.reused(wid) if hint is not None else 0)
            requests, queued = self._queue.get(wid, (0, 0))
            self._queue[wid] = (requests + 1, queued + compute)
            booking.queued = (wid, compute)
        if hint is not None and placement.prefill is not None:
            did = placement.decode.worker_id
            booking.decode_prefix = (hint.cached.get(did, 0), self.prefixes.block_size(did))
        booking.used = [breaker_key(w) for w in chosen.values()]
        for key in booking.used:
            self.breakers.placed(key, now)
        return booking

    def _place(
        self,
        workers: Sequence[WorkerInfo],
        need: int,
        prefill_tokens: int,
        excluded: set[str],
        now: float,
        hint: Hint | None,
    ) -> Placement:
        held = self.breakers.held_back(now)
        held_back = (
            {w.worker_id: held[k] for w in workers if (k := breaker_key(w)) in held} if held else {}
        )  # (none held back, as most of the time: no key built per worker)
        queue = {wid: queued for wid, (_, queued) in self._queue.items()}
        rates: dict[str, float] = {}
        for w in workers:
            if w.role == "prefill" and (r := self.rates.prefill_rate(w.worker_id, w.gpu_kind)):
                rates[w.worker_id] = r

        def decide(prefill: WorkerInfo, decode: WorkerInfo) -> Decision:
            return self.decide(prefill_tokens, prefill, decode)

        return place(
            workers, need, fallback=self.settings.fallback, exclude=excluded,
            held_back=held_back, load=self._load, queue=queue, rates=rates, decide=decide,
            hint=hint,
        )  # fmt: skip

    def decide(self, tokens: int, prefill: WorkerInfo, decode: WorkerInfo) -> Decision:
        """Conditional disaggregation for a prompt of ``tokens`` (see `disaggregate_or_not`)."""
        policy = self.settings.admission
        if policy.aggregate_below is not None:
            return disaggregate_or_not(
                tokens, policy.aggregate_below, transfer=None, kv_bytes_per_token=0,
                prefill_rate=None, local_speedup=1.0, decode_active=decode.active,
            )  # fmt: skip
        return disaggregate_or_not(
            tokens,
            None,
            transfer=self.rates.transfer_model(),
            kv_bytes_per_token=decode.kv_bytes_per_token,
            prefill_rate=self.rates.prefill_rate(prefill.worker_id, prefill.gpu_kind),
            local_speedup=self._speedup(decode.gpu_kind, prefill.gpu_kind),
            decode_active=decode.active,
        )

    def _speedup(self, kind: str, than: str) -> float:
        """Peak compute of GPU ``kind`` over ``than`` (1.0 when either is not priced)."""
        if kind == than:
            return 1.0
        try:
            a, b = get_gpu(self.settings.prices, kind), get_gpu(self.settings.prices, than)
        except errors.ConfigError:
            return 1.0
        return (a.bf16_tflops or a.fp16_tflops) / (b.bf16_tflops or b.fp16_tflops)

    # ------------------------------------------------------------- attempt's end

    def prefilled(self, booking: Booking) -> None:
        """The attempt left its prefill worker's queue (prefilled, failed or cancelled)."""
        if booking.queued is None:
            return
        worker_id, tokens = booking.queued
        booking.queued = None
        requests, queued = self._queue.get(worker_id, (1, tokens))
        if requests <= 1:
            self._queue.pop(worker_id, None)
        else:
            self._queue[worker_id] = (requests - 1, max(0, queued - tokens))

    def release(self, booking: Booking) -> None:
        """The attempt ended, however: its load leaves the ledger."""
        self._count(booking.placement.decode.worker_id, -1, -booking.kv_need)
        self.prefilled(booking)

    def failed(self, booking: Booking, worker_id: str, now: float) -> None:
        """``worker_id`` failed the attempt: open its breaker (if it was one of ours)."""
        if worker_id in booking.chosen:
            self.breakers.failure(breaker_key(booking.chosen[worker_id]), now)

    def answered(self, booking: Booking, worker_id: str) -> None:
        """``worker_id`` answered the attempt (a prefill's reply): its breaker closes — a
        half-open worker's probe is over at its first answer, not at the stream's end."""
        if worker_id in booking.chosen:
            self.breakers.success(breaker_key(booking.chosen[worker_id]))

    def succeeded(self, booking: Booking) -> None:
        """Every worker of the attempt answered (its first token reached the relay)."""
        for key in booking.used:
            self.breakers.success(key)

    def _count(self, worker_id: str, sequences: int, kv_bytes: int) -> None:
        active, kv = self._load.get(worker_id, (0, 0))
        active, kv = active + sequences, kv + kv_bytes
        if active <= 0:
            self._load.pop(worker_id, None)
        else:
            self._load[worker_id] = (active, kv)
