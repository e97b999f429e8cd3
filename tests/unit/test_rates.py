"""Measured rates: prefill EWMAs with fallbacks, the transfer least-squares line."""

from __future__ import annotations

import pytest

from orchestrator.core.rates import Ewma, Rates, TransferModel


def test_ewma_starts_at_the_first_sample_then_moves_by_alpha() -> None:
    e = Ewma(alpha=0.5)
    e.add(10.0)
    assert e.value == 10.0
    e.add(20.0)
    assert e.value == 15.0
    assert e.samples == 2


def test_prefill_rate_unknown_until_min_samples() -> None:
    r = Rates(min_samples=3)
    for _ in range(2):
        r.prefill("p1", "H100", 1000, 0.1)
    assert r.prefill_rate("p1", "H100") is None
    r.prefill("p1", "H100", 1000, 0.1)
    assert r.prefill_rate("p1", "H100") == pytest.approx(10_000)


def test_a_new_worker_is_estimated_from_its_kind_then_the_pool() -> None:
    r = Rates(min_samples=2)
    for _ in range(2):
        r.prefill("p1", "H100", 1000, 0.1)  # 10 000 tok/s
        r.prefill("p2", "L4", 1000, 1.0)  # 1 000 tok/s
    assert r.prefill_rate("p3", "H100") == pytest.approx(10_000)  # same kind
    assert r.prefill_rate("p4", "L4") == pytest.approx(1_000)
    pool = r.prefill_rate("p5", "T4")  # unknown kind: the whole pool's mean
    assert pool is not None
    assert 1_000 < pool < 10_000


def test_degenerate_samples_are_ignored() -> None:
    r = Rates(min_samples=1)
    r.prefill("p1", "H100", 0, 0.1)
    r.prefill("p1", "H100", 10, 0.0)
    r.transfer(0, 0.1)
    assert r.prefill_rate("p1", "H100") is None
    assert r.transfer_model() is None


def test_transfer_line_recovers_fixed_cost_and_bandwidth() -> None:
    r = Rates(min_samples=3)
    for nbytes in (1_000, 10_000, 100_000, 1_000_000):
        r.transfer(nbytes, 0.002 + nbytes * 1e-9)  # 2 ms + 1 GB/s
    m = r.transfer_model()
    assert m is not None
    assert m.fixed_s == pytest.approx(0.002)
    assert m.per_byte_s == pytest.approx(1e-9)
    assert m.seconds(500_000) == pytest.approx(0.0025)


def test_transfers_all_of_one_size_give_the_mean_and_no_bandwidth() -> None:
    r = Rates(min_samples=2)
    r.transfer(4096, 0.001)
    r.transfer(4096, 0.003)
    assert r.transfer_model() == TransferModel(fixed_s=pytest.approx(0.002), per_byte_s=0.0)


def test_a_noisy_negative_slope_is_clamped() -> None:
    r = Rates(min_samples=2)
    r.transfer(1_000, 0.010)
    r.transfer(100_000, 0.001)
    m = r.transfer_model()
    assert m is not None
    assert m.per_byte_s == 0.0
    assert m.fixed_s > 0


def test_the_window_keeps_only_recent_transfers() -> None:
    r = Rates(min_samples=2, window=4)
    for _ in range(10):
        r.transfer(1_000, 1.0)  # old, slow
    for _ in range(4):
        r.transfer(1_000, 0.001)
    m = r.transfer_model()
    assert m is not None
    assert m.fixed_s == pytest.approx(0.001)


def test_the_transfer_line_is_fitted_again_after_every_transfer() -> None:
    # Fitted once and kept (admission and placement ask for every request), but never
    # stale: each transfer moves the line.
    r = Rates(min_samples=2)
    r.transfer(1000, 0.001)
    assert r.transfer_model() is None
    r.transfer(2000, 0.002)
    first = r.transfer_model()
    assert first is r.transfer_model()  # kept
    r.transfer(3000, 0.005)
    moved = r.transfer_model()
    assert moved is not None
    assert first is not None
    assert moved.per_byte_s > first.per_byte_s
