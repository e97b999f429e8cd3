"""The pause between tries (`orchestrator.core.backoff`): tenacity's exponential jitter."""

from __future__ import annotations

import pytest

from orchestrator.core.backoff import exponential_jitter


def _low(_a: float, _b: float) -> float:
    return 0.0


def _high(_a: float, b: float) -> float:
    return b


@pytest.mark.parametrize(
    ("tries", "low", "high"),
    [(1, 0.05, 0.15), (2, 0.1, 0.2), (3, 0.2, 0.3), (4, 0.4, 0.5), (5, 0.8, 0.9), (6, 1.0, 1.0)],
)
def test_the_pause_doubles_from_the_multiplier_plus_jitter_up_to_the_cap(
    tries: int, low: float, high: float
) -> None:
    assert exponential_jitter(tries, 0.05, 1.0, 0.1, _low) == pytest.approx(low)
    assert exponential_jitter(tries, 0.05, 1.0, 0.1, _high) == pytest.approx(high)


def test_the_jitter_is_drawn_between_zero_and_its_bound() -> None:
    drawn: list[tuple[float, float]] = []

    def uniform(a: float, b: float) -> float:
        drawn.append((a, b))
        return (a + b) / 2

    assert exponential_jitter(1, 0.05, 1.0, 0.1, uniform) == pytest.approx(0.1)
    assert drawn == [(0.0, 0.1)]


def test_a_huge_try_count_is_the_cap_not_an_overflow() -> None:
    assert exponential_jitter(10_000, 0.05, 1.0, 0.1) == 1.0
