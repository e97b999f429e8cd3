from __future__ import annotations

from orchestrator.core.breaker import Breakers, BreakerState


def test_failure_opens_then_half_opens_after_cooldown() -> None:
    b = Breakers(cooldown_s=2.0)
    assert b.state("w", 0.0) is BreakerState.CLOSED
    b.failure("w", 10.0)
    assert b.state("w", 11.9) is BreakerState.OPEN
    assert b.blocked(11.9) == {"w"}
    assert b.state("w", 12.0) is BreakerState.HALF_OPEN
    assert b.blocked(12.0) == set()


def test_half_open_admits_one_probe_and_success_closes() -> None:
    b = Breakers(cooldown_s=2.0)
    b.failure("w", 0.0)
    b.placed("w", 3.0)  # the probe
    assert b.blocked(3.0) == {"w"}  # no second request while probing
    b.success("w")
    assert b.state("w", 3.0) is BreakerState.CLOSED
    assert b.blocked(3.0) == set()


def test_failed_probe_reopens_for_twice_as_long_capped() -> None:
    b = Breakers(cooldown_s=2.0, max_cooldown_s=5.0)
    b.failure("w", 0.0)
    b.placed("w", 2.0)
    b.failure("w", 2.5)
    assert b.state("w", 6.4) is BreakerState.OPEN  # 2.5 + 4
    assert b.state("w", 6.5) is BreakerState.HALF_OPEN
    b.placed("w", 6.5)
    b.failure("w", 7.0)
    assert b.state("w", 11.9) is BreakerState.OPEN  # capped at 5
    assert b.state("w", 12.0) is BreakerState.HALF_OPEN


def test_placing_on_a_closed_worker_changes_nothing() -> None:
    b = Breakers()
    b.placed("w", 1.0)
    assert b.blocked(1.0) == set()
    assert b.state("w", 1.0) is BreakerState.CLOSED


def test_held_back_says_why_open_or_probing() -> None:
    b = Breakers(cooldown_s=2.0)
    b.failure("a", 0.0)
    b.failure("b", 0.0)
    b.failure("c", 1.0)
    b.placed("a", 2.5)  # a's probe is in flight; b is half-open, not probed yet
    assert b.held_back(2.5) == {"a": BreakerState.HALF_OPEN, "c": BreakerState.OPEN}
    assert b.blocked(2.5) == {"a", "c"}


def test_a_probe_answered_closes_the_breaker_while_its_stream_goes_on() -> None:
    """The probe is over at the worker's first answer: ``success`` then, not at the end."""
    b = Breakers(cooldown_s=2.0)
    b.failure("w", 0.0)
    b.placed("w", 2.0)
    b.success("w")  # the first token
    assert b.held_back(2.1) == {}
    b.placed("w", 2.2)  # the next request: a closed worker, no probe
    assert b.state("w", 2.2) is BreakerState.CLOSED
