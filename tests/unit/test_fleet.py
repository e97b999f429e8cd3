"""A listing split once (`Fleet`), and placement over sampled candidates: pools larger than
``placement_sample`` are drawn from per request, prefix holders always considered, the
whole listing again when none drawn has room, small fleets placed exactly as scanned."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Sequence

import pytest

from orchestrator.control.ledger import Ledger
from orchestrator.control.settings import ControlSettings
from orchestrator.core.fleet import Fleet
from orchestrator.core.records import WorkerInfo
from orchestrator.errors import OverloadedError
from tests.unit.test_routing import _reporting
from tests.unit.test_scheduler import decode, prefill, worker

SAMPLE = 8


def _fleet(n_prefill: int, n_decode: int) -> list[WorkerInfo]:
    return [prefill(f"p{i}", active=i % 5) for i in range(n_prefill)] + [
        decode(f"d{i}", active=i % 7) for i in range(n_decode)
    ]


def _ledger(sample: int = SAMPLE, seed: int = 0) -> Ledger:
    ledger = Ledger(dataclasses.replace(ControlSettings(), placement_sample=sample))
    ledger.rng.seed(seed)
    return ledger


def test_a_listing_is_split_once() -> None:
    workers = [*_fleet(3, 2), worker("x", "router")]
    fleet = Fleet.of(workers)
    assert fleet.workers is workers
    assert [w.worker_id for w in fleet.prefill] == ["p0", "p1", "p2"]
    assert [w.worker_id for w in fleet.decode] == ["d0", "d1"]
    assert fleet.by_id["x"].role == "router"
    assert fleet.fingerprints == {"f"}
    ledger = _ledger()
    assert ledger.fleet(workers) is ledger.fleet(workers)  # one listing, one split
    assert ledger.fleet(list(workers)) is not ledger.fleet(workers)  # a new listing


@pytest.mark.parametrize(("n_prefill", "n_decode"), [(3, 5), (SAMPLE, SAMPLE), (0, 2)])
def test_pools_of_at_most_the_sample_are_taken_whole(n_prefill: int, n_decode: int) -> None:
    workers = _fleet(n_prefill, n_decode)
    fleet = Fleet.of(workers)
    assert not fleet.sampled(SAMPLE)
    assert fleet.candidates(SAMPLE, random.Random(1)) is workers
    assert Fleet.of(_fleet(100, 100)).candidates(0, random.Random(1)) == _fleet(100, 100)


def test_a_larger_pool_is_drawn_from_and_the_kept_are_added() -> None:
    fleet = Fleet.of(_fleet(5, 40))
    assert fleet.sampled(SAMPLE)
    drawn = fleet.candidates(SAMPLE, random.Random(3), keep={"d39", "d38", "p1", "nobody"})
    ids = [w.worker_id for w in drawn]
    assert ids[:5] == ["p0", "p1", "p2", "p3", "p4"]  # the small pool whole, p1 once
    decodes = ids[5:]
    assert len(set(decodes)) == len(decodes)
    assert {"d39", "d38"} <= set(decodes)
    assert SAMPLE <= len(decodes) <= SAMPLE + 2
    draws = {
        tuple(w.worker_id for w in fleet.candidates(SAMPLE, random.Random(s))) for s in range(20)
    }
    assert len(draws) > 1  # random, not a fixed subset


def test_small_fleets_are_placed_exactly_as_a_scan() -> None:
    workers = _fleet(SAMPLE, SAMPLE)
    for seed in range(5):
        sampled = _ledger(SAMPLE, seed).place(
            workers, need=100, prefill_tokens=50, excluded=set(), now=0.0
        )
        scanned = _ledger(0).place(workers, need=100, prefill_tokens=50, excluded=set(), now=0.0)
        assert sampled.placement == scanned.placement


def test_a_large_pool_is_placed_on_a_light_worker_of_the_draw() -> None:
    """Among 200 decode workers (active 0-6), the chosen one is the least active of the
    ones drawn: an idle worker is among 8 draws of a pool where 1 in 7 is idle most of the
    time, and never worse than the draw's best."""
    workers = _fleet(4, 200)
    chosen = []
    for seed in range(40):
        ledger = _ledger(SAMPLE, seed)
        booking = ledger.place(workers, need=100, prefill_tokens=50, excluded=set(), now=0.0)
        chosen.append(booking.placement.decode.active)
    assert max(chosen) <= 3
    assert chosen.count(0) >= 20


def test_when_none_drawn_has_room_the_whole_listing_is_placed_on() -> None:
    full = [decode(f"d{i}", free=0) for i in range(50)]
    roomy = decode("d-room", active=6)
    workers = [prefill("p0"), *full, roomy]
    for seed in range(10):
        booking = _ledger(SAMPLE, seed).place(
            workers, need=100, prefill_tokens=50, excluded=set(), now=0.0
        )
        assert booking.placement.decode.worker_id == "d-room"


def test_the_holder_of_a_prefix_is_considered_whatever_the_draw() -> None:
    turn1 = list(range(100, 164))
    turn2 = [*turn1, *range(300, 320)]
    workers = [
        *(prefill(f"p{i}") for i in range(40)),
        _reporting(prefill("p-holder"), turn1),
        *(decode(f"d{i}") for i in range(40)),
        _reporting(decode("d-holder", active=2), turn1),
    ]
    for seed in range(10):
        booking = _ledger(SAMPLE, seed).place(
            workers, need=200, prefill_tokens=len(turn2), excluded=set(), now=0.0, tokens=turn2
        )
        placement = booking.placement
        assert placement.prefill is not None
        assert (placement.prefill.worker_id, placement.decode.worker_id) == (
            "p-holder",
            "d-holder",
        )


def test_admission_over_a_draw_refuses_only_what_every_queue_refuses() -> None:
    """100 prefill queues at their cap but one: a draw of 8 that misses the open one would
    refuse; the refusal is confirmed over every queue, so the request is admitted."""
    policy = dataclasses.replace(ControlSettings().admission, max_queue=1)
    settings = dataclasses.replace(ControlSettings(), placement_sample=SAMPLE, admission=policy)
    workers = [*(prefill(f"p{i}") for i in range(100)), decode("d0")]
    for seed in range(10):
        ledger = Ledger(settings)
        ledger.rng.seed(seed)
        ledger._queue = {f"p{i}": (1, 100) for i in range(99)}  # p99 alone is open
        assert ledger.estimate(workers, 50, driving=0) is None  # admitted (no rates yet)
        ledger._queue["p99"] = (1, 100)
        with pytest.raises(OverloadedError, match="every prefill queue is full"):
            ledger.estimate(workers, 50, driving=0)


def test_a_draw_with_no_pair_places_over_the_whole_listing() -> None:
    """Only one prefill worker (tcp) can send to the tcp decode pool: a draw that misses it
    would run the request aggregated; the whole listing pairs it, as a scan does."""
    ucx = [dataclasses.replace(prefill(f"p{i}"), transport="ucx") for i in range(100)]
    workers = [*ucx, prefill("p-tcp"), *(decode(f"d{i}") for i in range(20))]
    for seed in range(10):
        booking = _ledger(SAMPLE, seed).place(
            workers, need=100, prefill_tokens=50, excluded=set(), now=0.0
        )
        assert booking.placement.prefill is not None
        assert booking.placement.prefill.worker_id == "p-tcp"


def test_a_prefix_every_worker_holds_keeps_the_draw_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shared system prompt in every decode worker's cache: the draw adds at most
    ``sample`` holders (the longest prefixes first), not the whole pool."""
    system = list(range(100, 164))
    longer = [*system, *range(500, 564)]
    decodes = [_reporting(decode(f"d{i}"), system) for i in range(100)]
    decodes.append(_reporting(decode("d-long"), longer))
    workers = [prefill("p0"), *decodes]
    sizes: list[int] = []
    original = Fleet.candidates

    def counted(
        self: Fleet, sample: int, rng: random.Random, keep: Collection[str] = ()
    ) -> Sequence[WorkerInfo]:
        out = original(self, sample, rng, keep)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(Fleet, "candidates", counted)
    booking = _ledger(SAMPLE, 1).place(
        workers, need=200, prefill_tokens=140, excluded=set(), now=0.0, tokens=[*longer, 1, 2]
    )
    assert sizes
    assert sizes[0] <= 1 + 2 * SAMPLE  # the prefill pool, the draw, the longest holders
    assert booking.placement.decode.worker_id == "d-long"
