"""The receiver's inbox (`transport.base.Inbox`): hand-over, epoch fence, memory budget.

Each test runs its scenario under `asyncio.run` with a hard deadline, and fails if the event
loop reported anything (e.g. a future whose exception nobody retrieved). Nothing here waits
on wall-clock sleeps: a waiting `take` is observed by yielding to the loop, and is woken by
the inbox itself.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import errors
from transport.base import Inbox
from transport.wire import DType, KvCache, header_for

T = TypeVar("T")

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

LONG = 30.0  # a take() timeout no passing test ever comes close to


def run(
    scenario: Callable[[], Coroutine[Any, Any, T]], limit_s: float = 10.0, collect: bool = True
) -> T:
    """Run ``scenario`` on a fresh loop; fail on anything the loop reports as unhandled.

    ``collect`` runs a full garbage collection at the end, so that a dropped future with an
    unretrieved exception reports even when caught in a reference cycle (most report as soon
    as their last reference goes, without it).
    """
    reported: list[dict[str, Any]] = []

    async def main() -> T:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        try:
            return await asyncio.wait_for(scenario(), limit_s)
        finally:
            if collect:
                gc.collect()

    result = asyncio.run(main())
    assert not reported, reported
    return result


def kv(request_id: str = "r", epoch: int = 1, nbytes: int = 8) -> KvCache:
    k = np.zeros(nbytes, np.uint8)
    v = np.zeros(0, np.uint8)
    return KvCache(header_for(request_id, epoch, "m", DType.FLOAT8_E4M3, [(k, v)]), ((k, v),))


async def parked(task: asyncio.Task[Any]) -> None:
    """Let ``task`` run until it blocks (a few loop turns, no timed wait); it must be waiting."""
    for _ in range(10):
        await asyncio.sleep(0)
    assert not task.done()


def take_task(inbox: Inbox, request_id: str, epoch: int, timeout_s: float = LONG) -> Any:
    return asyncio.create_task(inbox.take(request_id, epoch, timeout_s))


async def finished(task: asyncio.Task[T]) -> T:
    """The task's result, which must come promptly (well before any take() timeout)."""
    return await asyncio.wait_for(task, 5.0)


# ------------------------------------------------------------------ hand-over


def test_reserve_complete_take_hands_over_the_cache() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        cache = kv(nbytes=40)
        inbox.reserve("r", 1, 40)
        assert inbox.bytes_in_use == 40
        assert inbox.held() == ["r"]
        assert inbox.is_current("r", 1)
        inbox.complete("r", 1, cache)
        assert not inbox.is_current("r", 1)
        assert inbox.bytes_in_use == 40  # held until the decode side takes it
        started = time.monotonic()
        assert await inbox.take("r", 1, LONG) is cache
        assert time.monotonic() - started < 1.0
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []
        assert inbox.min_epoch("r") == 1
        # Handed over means closed: a second take is refused at once, however long it waits.
        started = time.monotonic()
        with pytest.raises(errors.StaleEpochError, match="already taken"):
            await inbox.take("r", 1, LONG)
        assert time.monotonic() - started < 1.0

    run(scenario)


def test_requests_are_kept_apart() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        a, b = kv("a", nbytes=10), kv("b", nbytes=20)
        inbox.reserve("a", 1, 10)
        inbox.reserve("b", 1, 20)
        inbox.complete("b", 1, b)
        inbox.complete("a", 1, a)
        assert sorted(inbox.held()) == ["a", "b"]
        assert await inbox.take("b", 1, LONG) is b
        assert inbox.bytes_in_use == 10
        assert await inbox.take("a", 1, LONG) is a
        assert inbox.bytes_in_use == 0

    run(scenario)


def test_complete_without_a_reservation_is_refused() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        with pytest.raises(errors.StaleEpochError):
            inbox.complete("r", 1, kv())
        inbox.reserve("r", 1, 8)
        with pytest.raises(errors.StaleEpochError):
            inbox.complete("r", 2, kv(epoch=2))
        inbox.complete("r", 1, kv())
        with pytest.raises(errors.StaleEpochError):
            inbox.complete("r", 1, kv())  # twice
        assert inbox.bytes_in_use == 8

    run(scenario)


def test_the_same_epoch_cannot_be_received_twice_at_once() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 3, 30)
        with pytest.raises(errors.HeaderRejectedError) as info:
            inbox.reserve("r", 3, 30)
        assert not isinstance(info.value, errors.StaleEpochError)
        assert inbox.bytes_in_use == 30
        assert inbox.is_current("r", 3)

    run(scenario)


# ------------------------------------------------------------------ epoch fence


def test_a_stale_epoch_is_refused_at_reserve() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 5, 10)
        inbox.complete("r", 5, kv(epoch=5))
        await inbox.take("r", 5, LONG)
        for stale in (0, 4):
            with pytest.raises(errors.StaleEpochError):
                inbox.reserve("r", stale, 10)
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []
        assert inbox.min_epoch("r") == 5
        inbox.reserve("r", 6, 10)  # a newer one is fine
        assert inbox.min_epoch("r") == 6

    run(scenario)


def test_a_stale_epoch_is_refused_at_take_at_once() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 5, 10)
        started = time.monotonic()
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 4, LONG)
        assert time.monotonic() - started < 1.0
        inbox.complete("r", 5, kv(epoch=5))
        await inbox.take("r", 5, LONG)
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 2, LONG)

    run(scenario)


def test_a_newer_epoch_supersedes_an_older_one_in_flight() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 30)
        waiting_old = take_task(inbox, "r", 1)
        await parked(waiting_old)
        inbox.reserve("r", 2, 40)
        assert inbox.bytes_in_use == 40  # the old reservation is released
        assert not inbox.is_current("r", 1)
        assert inbox.is_current("r", 2)
        with pytest.raises(errors.StaleEpochError):
            await finished(waiting_old)
        # The old transfer's late events change nothing.
        with pytest.raises(errors.StaleEpochError):
            inbox.complete("r", 1, kv(epoch=1))
        inbox.fail("r", 1, errors.PeerLostError("old link broke"))
        assert inbox.bytes_in_use == 40
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 1, LONG)
        cache = kv(epoch=2, nbytes=40)
        inbox.complete("r", 2, cache)
        assert await inbox.take("r", 2, LONG) is cache
        assert inbox.bytes_in_use == 0

    run(scenario)


def test_a_newer_epoch_replaces_a_completed_older_one() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 30)
        inbox.complete("r", 1, kv(epoch=1))
        inbox.reserve("r", 2, 20)
        assert inbox.bytes_in_use == 20
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 1, LONG)

    run(scenario)


def test_the_epoch_fence_forgets_the_least_recently_seen_requests() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=2)
        for rid in ("a", "b", "c"):
            inbox.reserve(rid, 7, 1)
            inbox.complete(rid, 7, kv(rid, 7, 1))
            await inbox.take(rid, 7, LONG)
        assert [inbox.min_epoch(r) for r in ("a", "b", "c")] == [0, 7, 7]

    run(scenario)


def test_a_held_transfer_fences_its_request_even_once_its_epoch_is_forgotten() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=1)
        inbox.reserve("a", 5, 10)
        inbox.reserve("b", 1, 10)  # pushes "a" out of the remembered epochs
        assert inbox.min_epoch("a") == 5  # ... but its transfer in flight still fences it
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("a", 3, 10)
        assert inbox.is_current("a", 5)
        assert inbox.bytes_in_use == 20
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("a", 3, LONG)

    run(scenario)


# ------------------------------------------------------------------ replays


def test_a_replay_after_take_is_refused_and_cannot_be_taken() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 2, 40)
        inbox.complete("r", 2, kv(epoch=2, nbytes=40))
        await inbox.take("r", 2, LONG)
        with pytest.raises(errors.StaleEpochError, match="replay"):
            inbox.reserve("r", 2, 40)
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 2, LONG)
        inbox.reserve("r", 3, 40)  # the next attempt is fine

    run(scenario)


def test_a_replay_of_a_held_kv_is_refused_and_leaves_it_in_place() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        cache = kv(epoch=2, nbytes=40)
        inbox.reserve("r", 2, 40)
        inbox.complete("r", 2, cache)
        with pytest.raises(errors.HeaderRejectedError, match="already received") as info:
            inbox.reserve("r", 2, 40)
        assert not isinstance(info.value, errors.StaleEpochError)
        assert inbox.bytes_in_use == 40
        assert await inbox.take("r", 2, LONG) is cache

    run(scenario)


def test_a_failed_transfer_is_not_received_again_once_its_error_was_taken() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 40)
        inbox.fail("r", 1, errors.PeerLostError("gone"))
        with pytest.raises(errors.HeaderRejectedError):
            inbox.reserve("r", 1, 40)  # its failure is still held for the decode side
        with pytest.raises(errors.PeerLostError):
            await inbox.take("r", 1, LONG)
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("r", 1, 40)

    run(scenario)


def test_a_reaped_kv_is_closed() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 40)
        inbox.complete("r", 1, kv(nbytes=40))
        assert inbox.reap(time.monotonic() + 60, hold_s=30) == ["r"]
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("r", 1, 40)
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 1, LONG)

    run(scenario)


def test_a_release_closes_its_epoch_even_before_the_transfer_arrives() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        waiting = take_task(inbox, "r", 3)
        await parked(waiting)
        assert not inbox.discard("r", 3)  # nothing held yet
        with pytest.raises(errors.StaleEpochError):
            await finished(waiting)  # woken: that epoch is over
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("r", 3, 10)  # the late transfer is refused, not held
        assert inbox.bytes_in_use == 0
        inbox.reserve("r", 4, 10)

    run(scenario)


def test_a_release_of_an_older_epoch_leaves_a_newer_transfer_alone() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 5, 10)
        assert not inbox.discard("r", 4)  # a late Release of the previous attempt
        assert inbox.is_current("r", 5)
        assert inbox.min_epoch("r") == 5
        assert inbox.discard("r", 5)
        assert inbox.held() == []
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("r", 5, 10)

    run(scenario)


def test_the_replay_guard_is_bounded_by_epoch_memory() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=2)
        for rid in ("a", "b", "c"):
            inbox.reserve(rid, 1, 1)
            inbox.complete(rid, 1, kv(rid, 1, 1))
            await inbox.take(rid, 1, LONG)
        assert len(inbox._epochs) == 2  # the bound: epoch_memory ids, no more
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("c", 1, 1)
        inbox.reserve("a", 1, 1)  # forgotten: accepted again (then reaped if never taken)

    run(scenario)


# ------------------------------------------------------------------ budget


def test_budget_exceeded_reserves_nothing() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("a", 1, 60)
        with pytest.raises(errors.BudgetExceededError) as info:
            inbox.reserve("b", 4, 41)
        assert info.value.retryable
        assert inbox.bytes_in_use == 60
        assert inbox.held() == ["a"]
        assert inbox.min_epoch("b") == 0  # not even its epoch was recorded
        inbox.reserve("b", 1, 40)  # exactly the rest fits
        assert inbox.bytes_in_use == 100
        with pytest.raises(errors.BudgetExceededError):
            inbox.reserve("c", 1, 1)
        assert inbox.discard("a")
        inbox.reserve("c", 1, 60)
        assert inbox.bytes_in_use == 100

    run(scenario)


def test_a_transfer_larger_than_the_whole_budget_is_refused() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        with pytest.raises(errors.BudgetExceededError):
            inbox.reserve("r", 1, 101)
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []
        inbox.reserve("r", 1, 100)

    run(scenario)


def test_a_budget_refusal_leaves_an_older_epoch_in_place() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 30)
        with pytest.raises(errors.BudgetExceededError):
            inbox.reserve("r", 2, 80)
        assert inbox.is_current("r", 1)
        assert inbox.min_epoch("r") == 1
        assert inbox.bytes_in_use == 30

    run(scenario)


# ------------------------------------------------------------------ fail / discard


def test_fail_releases_the_bytes_and_take_raises_the_error() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        exc = errors.ChecksumMismatchError("layer 3: payload checksum mismatch")
        inbox.fail("r", 1, exc)
        assert inbox.bytes_in_use == 0
        assert not inbox.is_current("r", 1)
        inbox.reserve("other", 1, 100)  # the bytes really are free again
        with pytest.raises(errors.ChecksumMismatchError) as info:
            await inbox.take("r", 1, LONG)
        assert info.value is exc
        assert inbox.held() == ["other"]
        assert inbox.bytes_in_use == 100

    run(scenario)


def test_fail_wakes_a_waiting_take() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        waiting = take_task(inbox, "r", 1)
        await parked(waiting)
        inbox.fail("r", 1, errors.PeerLostError("sender died"))
        with pytest.raises(errors.PeerLostError, match="sender died"):
            await finished(waiting)
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []

    run(scenario)


def test_a_failure_nobody_takes_is_not_reported_as_unhandled() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        inbox.fail("r", 1, errors.PeerLostError("gone"))
        inbox.reserve("s", 1, 10)
        inbox.discard("s")
        inbox.reserve("t", 1, 10)
        inbox.reserve("t", 2, 10)  # supersedes: epoch 1's future fails, unobserved
        assert inbox.bytes_in_use == 10

    run(scenario)  # run() fails on "Future exception was never retrieved"


def test_fail_for_another_epoch_or_request_is_ignored() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 2, 60)
        inbox.fail("r", 1, errors.PeerLostError("old"))
        inbox.fail("r", 3, errors.PeerLostError("future"))
        inbox.fail("nobody", 2, errors.PeerLostError("unknown"))
        assert inbox.bytes_in_use == 60
        assert inbox.is_current("r", 2)

    run(scenario)


def test_fail_twice_releases_the_bytes_once() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("a", 1, 30)
        inbox.reserve("r", 1, 60)
        inbox.fail("r", 1, errors.PeerLostError("one"))
        inbox.fail("r", 1, errors.PeerLostError("two"))
        assert inbox.bytes_in_use == 30
        inbox.discard("r")
        assert inbox.bytes_in_use == 30
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 1, 0.0)

    run(scenario)


def test_discard_frees_the_bytes() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        assert not inbox.discard("r")
        inbox.reserve("r", 1, 60)
        assert inbox.discard("r")
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []
        assert not inbox.discard("r")
        # A completed, untaken cache is freed the same way.
        inbox.reserve("r", 2, 70)
        inbox.complete("r", 2, kv(epoch=2, nbytes=70))
        assert inbox.discard("r")
        assert inbox.bytes_in_use == 0
        with pytest.raises(errors.StaleEpochError):
            await inbox.take("r", 2, 0.0)
        # The epoch fence outlives the discard.
        with pytest.raises(errors.StaleEpochError):
            inbox.reserve("r", 1, 10)

    run(scenario)


def test_discard_wakes_a_waiting_take_with_closed() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        waiting = take_task(inbox, "r", 1)
        await parked(waiting)
        assert inbox.discard("r")
        with pytest.raises(errors.TransportClosedError):
            await finished(waiting)
        assert inbox.bytes_in_use == 0

    run(scenario)


# ------------------------------------------------------------------ take: waiting and timeouts


def test_take_times_out_when_nothing_arrives() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        started = time.monotonic()
        with pytest.raises(errors.TransferTimeoutError, match="no KV") as info:
            await inbox.take("r", 1, 0.05)
        elapsed = time.monotonic() - started
        assert 0.04 <= elapsed < 2.0
        assert info.value.retryable
        with pytest.raises(errors.TransferTimeoutError):
            await inbox.take("r", 1, 0.0)
        with pytest.raises(errors.TransferTimeoutError):
            await inbox.take("r", 1, -1.0)

    run(scenario)


def test_take_times_out_when_the_transfer_does_not_complete() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        with pytest.raises(errors.TransferTimeoutError, match="incomplete"):
            await inbox.take("r", 1, 0.05)
        # The transfer is still being received: a later completion is still handed over.
        assert inbox.is_current("r", 1)
        assert inbox.bytes_in_use == 60
        cache = kv(nbytes=60)
        inbox.complete("r", 1, cache)
        assert await inbox.take("r", 1, 0.0) is cache
        assert inbox.bytes_in_use == 0

    run(scenario)


def test_a_take_waiting_before_reserve_wakes_when_the_transfer_arrives() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        started = time.monotonic()
        waiting = take_task(inbox, "r", 1)
        await parked(waiting)
        inbox.reserve("r", 1, 60)
        await parked(waiting)  # arrived, but not complete yet: still waiting
        cache = kv(nbytes=60)
        inbox.complete("r", 1, cache)
        assert await finished(waiting) is cache
        assert time.monotonic() - started < LONG / 3
        assert inbox.bytes_in_use == 0
        assert inbox.held() == []

    run(scenario)


def test_a_waiting_take_ignores_other_requests_and_older_epochs() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        waiting = take_task(inbox, "r", 2)
        await parked(waiting)
        inbox.reserve("other", 2, 10)
        await parked(waiting)
        inbox.reserve("r", 1, 10)  # an older epoch arriving does not satisfy it
        inbox.complete("r", 1, kv(epoch=1))
        await parked(waiting)
        inbox.reserve("r", 2, 10)  # supersedes epoch 1
        cache = kv(epoch=2, nbytes=10)
        inbox.complete("r", 2, cache)
        assert await finished(waiting) is cache
        assert inbox.held() == ["other"]
        assert inbox.bytes_in_use == 10

    run(scenario)


def test_a_waiting_take_for_an_older_epoch_is_told_it_is_stale() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        waiting = take_task(inbox, "r", 1)
        await parked(waiting)
        inbox.reserve("r", 2, 10)
        with pytest.raises(errors.StaleEpochError):
            await finished(waiting)
        assert inbox.is_current("r", 2)

    run(scenario)


def test_many_takes_waiting_for_different_requests_all_wake() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=1000, epoch_memory=64)
        rids = [f"r{i}" for i in range(20)]
        tasks = {rid: take_task(inbox, rid, 1) for rid in rids}
        for task in tasks.values():
            await parked(task)
        caches = {rid: kv(rid, 1, 10) for rid in rids}
        for rid in reversed(rids):
            inbox.reserve(rid, 1, 10)
            inbox.complete(rid, 1, caches[rid])
        for rid, task in tasks.items():
            assert await finished(task) is caches[rid]
        assert inbox.bytes_in_use == 0

    run(scenario)


def test_a_cancelled_take_leaves_the_transfer_in_place() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=100, epoch_memory=16)
        inbox.reserve("r", 1, 60)
        waiting = take_task(inbox, "r", 1)
        await parked(waiting)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert inbox.is_current("r", 1)
        cache = kv(nbytes=60)
        inbox.complete("r", 1, cache)
        assert await inbox.take("r", 1, LONG) is cache

    run(scenario)


# ------------------------------------------------------------------ model-based accounting


@dataclass
class _Slot:
    epoch: int
    nbytes: int
    state: str  # "in flight" | "done" | "failed"
    cache: KvCache | None = None
    error: errors.TransportError | None = None


class Model:
    """What the inbox should do, written out plainly."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.slots: dict[str, _Slot] = {}
        self.seen: dict[str, int] = {}

    @property
    def in_use(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def min_epoch(self, rid: str) -> int:
        slot = self.slots.get(rid)
        return max(self.seen.get(rid, 0), slot.epoch if slot else 0)

    def closed(self, rid: str, epoch: int) -> bool:
        """Received once and no longer held: taken, discarded, or its failure taken."""
        slot = self.slots.get(rid)
        held = slot is not None and slot.epoch == epoch
        return not held and rid in self.seen and self.seen[rid] >= epoch

    def reserve(self, rid: str, epoch: int, nbytes: int) -> type[Exception] | None:
        slot = self.slots.get(rid)
        if epoch < self.min_epoch(rid) or self.closed(rid, epoch):
            return errors.StaleEpochError
        if slot is not None and slot.epoch == epoch:  # in flight, or held: once only
            return errors.HeaderRejectedError
        if self.in_use + nbytes > self.budget:
            return errors.BudgetExceededError
        self.seen[rid] = max(epoch, self.seen.get(rid, 0))
        self.slots[rid] = _Slot(epoch, nbytes, "in flight")
        return None

    def complete(self, rid: str, epoch: int, cache: KvCache) -> type[Exception] | None:
        slot = self.slots.get(rid)
        if slot is None or slot.epoch != epoch or slot.state != "in flight":
            return errors.StaleEpochError
        slot.state, slot.cache = "done", cache
        return None

    def fail(self, rid: str, epoch: int, exc: errors.TransportError) -> None:
        slot = self.slots.get(rid)
        if slot is None or slot.epoch != epoch:
            return
        slot.nbytes = 0
        if slot.state == "in flight":
            slot.state, slot.error = "failed", exc

    def release(self, rid: str, epoch: int) -> bool:
        slot = self.slots.get(rid)
        if slot is not None and slot.epoch > epoch:
            return False
        self.seen[rid] = max(epoch, self.seen.get(rid, epoch))
        return self.slots.pop(rid, None) is not None

    def take(self, rid: str, epoch: int) -> KvCache | errors.TransportError | type[Exception]:
        """With a zero timeout: the cache, the stored error, or the class of the refusal."""
        if epoch < self.min_epoch(rid) or self.closed(rid, epoch):
            return errors.StaleEpochError
        slot = self.slots.get(rid)
        if slot is None or slot.epoch != epoch or slot.state == "in flight":
            return errors.TransferTimeoutError
        del self.slots[rid]
        if slot.state == "done":
            assert slot.cache is not None
            return slot.cache
        assert slot.error is not None
        return slot.error


rids = st.sampled_from(["a", "b", "c"])
small_epochs = st.integers(0, 3)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), rids, small_epochs, st.integers(0, 60)),
        st.tuples(st.just("complete"), rids, small_epochs, st.just(0)),
        st.tuples(st.just("fail"), rids, small_epochs, st.just(0)),
        st.tuples(st.just("discard"), rids, st.just(0), st.just(0)),
        st.tuples(st.just("release"), rids, small_epochs, st.just(0)),
        st.tuples(st.just("take"), rids, small_epochs, st.just(0)),
    ),
    max_size=40,
)


@FUZZ
@given(script=ops)
def test_the_inbox_follows_the_model(script: list[tuple[str, str, int, int]]) -> None:
    budget = 100

    async def scenario() -> None:
        inbox = Inbox(budget_bytes=budget, epoch_memory=1000)
        model = Model(budget)
        for op, rid, epoch, nbytes in script:
            if op == "reserve":
                want = model.reserve(rid, epoch, nbytes)
                if want is None:
                    inbox.reserve(rid, epoch, nbytes)
                else:
                    with pytest.raises(want):
                        inbox.reserve(rid, epoch, nbytes)
            elif op == "complete":
                cache = kv(rid, epoch)
                want = model.complete(rid, epoch, cache)
                if want is None:
                    inbox.complete(rid, epoch, cache)
                else:
                    with pytest.raises(want):
                        inbox.complete(rid, epoch, cache)
            elif op == "fail":
                exc = errors.PeerLostError(f"{rid}@{epoch}")
                model.fail(rid, epoch, exc)
                inbox.fail(rid, epoch, exc)
            elif op == "discard":
                assert inbox.discard(rid) == (model.slots.pop(rid, None) is not None)
            elif op == "release":
                assert inbox.discard(rid, epoch) == model.release(rid, epoch)
            else:
                outcome = model.take(rid, epoch)
                if isinstance(outcome, KvCache):
                    assert await inbox.take(rid, epoch, 0.0) is outcome
                elif isinstance(outcome, errors.TransportError):
                    with pytest.raises(type(outcome)) as info:
                        await inbox.take(rid, epoch, 0.0)
                    assert info.value is outcome
                else:
                    with pytest.raises(outcome):
                        await inbox.take(rid, epoch, 0.0)
            assert inbox.bytes_in_use == model.in_use
            assert 0 <= inbox.bytes_in_use <= budget
            assert sorted(inbox.held()) == sorted(model.slots)
            for r in ("a", "b", "c"):
                assert inbox.min_epoch(r) == model.min_epoch(r)
                slot = model.slots.get(r)
                for e in range(4):
                    current = slot is not None and slot.epoch == e and slot.state == "in flight"
                    assert inbox.is_current(r, e) == current

    run(scenario, collect=False)


def test_reap_frees_a_held_kv_after_its_lease_and_keeps_fresh_ones() -> None:
    async def scenario() -> None:
        inbox = Inbox(budget_bytes=1 << 20, epoch_memory=16)
        released: list[str] = []
        for rid in ("old", "new"):
            inbox.reserve(rid, 1, 64)
            layers = [(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32))]
            header = header_for(rid, 1, "fp", DType.FLOAT32, layers)
            cache = KvCache(header, tuple(layers), [lambda r=rid: released.append(r)])
            inbox.complete(rid, 1, cache)
        slots = inbox._slots
        slots["old"].done_at = 100.0
        slots["new"].done_at = 129.0
        assert inbox.reap(now=131.0, hold_s=30.0) == ["old"]
        assert released == ["old"]
        assert inbox.held() == ["new"]
        assert inbox.bytes_in_use == 64

    asyncio.run(scenario())
