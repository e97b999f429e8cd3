"""Per-request and per-tenant cost (`orchestrator.core.cost`), computed by hand."""

from __future__ import annotations

import pytest

from orchestrator.core.cost import (
    PoolUsage,
    Reuse,
    aggregate_by_tenant,
    cost_fields,
    request_cost,
    reuse_saving,
    total_reuse,
)
from orchestrator.core.hardware import DEFAULT_GPUS
from orchestrator.errors import ConfigError

H100, L4 = DEFAULT_GPUS["H100"], DEFAULT_GPUS["L4"]  # $2.50 and $0.70 per GPU-hour


def test_gpu_seconds_times_price_plus_transfer() -> None:
    cost = request_cost(
        [PoolUsage("prefill", H100, 0.36), PoolUsage("decode", L4, 18.0)],
        transfer_bytes=2_000_000_000,
        usd_per_gb=0.01,
    )
    # prefill: 0.36 s * $2.50 / 3600 = $0.00025; decode: 18 s * $0.70 / 3600 = $0.0035
    assert cost.pool_usd("prefill") == pytest.approx(0.00025)
    assert cost.pool_usd("decode") == pytest.approx(0.0035)
    # transfer: 2 GB * $0.01 = $0.02
    assert cost.transfer_usd == pytest.approx(0.02)
    assert cost.total_usd == pytest.approx(0.00025 + 0.0035 + 0.02)


def test_transfer_is_free_by_default_and_pools_named_twice_add_up() -> None:
    cost = request_cost(
        [PoolUsage("decode", L4, 3.6), PoolUsage("decode", L4, 3.6)], transfer_bytes=10**9
    )
    # 7.2 s * $0.70 / 3600 = $0.0014
    assert [pool for pool, _ in cost.gpu_usd] == ["decode"]
    assert cost.pool_usd("decode") == pytest.approx(0.0014)
    assert cost.transfer_usd == 0.0
    assert cost.transfer_bytes == 10**9


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match=r"decode\.gpu_seconds: must be >= 0"):
        request_cost([PoolUsage("decode", L4, -1.0)])
    with pytest.raises(ConfigError, match="transfer_usd_per_gb"):
        request_cost([], usd_per_gb=-0.1)
    with pytest.raises(ConfigError, match="transfer_bytes"):
        request_cost([], transfer_bytes=-1)


def test_aggregate_by_tenant() -> None:
    a = request_cost([PoolUsage("decode", H100, 1.44)], 1000, 1.0)  # $0.001 GPU + $0.000001
    b = request_cost([PoolUsage("decode", H100, 2.88)])  # $0.002
    totals = aggregate_by_tenant([("acme", a), ("zeta", b), ("acme", b)])
    assert list(totals) == ["acme", "zeta"]
    acme = totals["acme"]
    assert acme.requests == 2
    assert acme.gpu_usd == pytest.approx(0.003)
    assert acme.transfer_usd == pytest.approx(0.000001)
    assert acme.transfer_bytes == 1000
    # (0.003 + 0.000001) / 2 requests * 1000 = $1.5005 per 1,000 requests
    assert acme.usd_per_1k_requests == pytest.approx(1.5005)
    assert totals["zeta"].total_usd == pytest.approx(0.002)


def test_reused_tokens_priced_at_the_prefill_rate_and_kept_out_of_the_bill() -> None:
    # 3600 tokens at 1000 tokens/s is 3.6 s of H100: 3.6 * $2.50 / 3600 = $0.0025
    reuse = reuse_saving(H100, 3600, 1000.0)
    assert reuse == Reuse(3600, pytest.approx(3.6), pytest.approx(0.0025))
    cost = request_cost([PoolUsage("prefill", H100, 0.36)], reuse=reuse)
    assert cost.total_usd == pytest.approx(0.00025)  # only what was computed is billed
    fields = cost_fields([PoolUsage("prefill", H100, 0.36)], 0, 0.0, "acme", reuse)
    assert fields["prefill_reused_tokens"] == 3600
    assert fields["reuse_saved_gpu_s"] == pytest.approx(3.6)
    assert fields["reuse_saved_usd"] == pytest.approx(0.0025)
    assert fields["usd"] == pytest.approx(0.00025)


def test_reuse_without_a_measured_rate_counts_tokens_and_saves_nothing() -> None:
    assert reuse_saving(L4, 160, None) == Reuse(160, 0.0, 0.0)
    assert reuse_saving(L4, 160, 0.0) == Reuse(160, 0.0, 0.0)
    assert reuse_saving(L4, 160, float("inf")) == Reuse(160, 0.0, 0.0)
    assert cost_fields([], 0, 0.0, "t")["prefill_reused_tokens"] == 0
    with pytest.raises(ConfigError, match="reused_tokens"):
        reuse_saving(L4, -1, 100.0)


def test_reuse_of_several_prefills_adds_up_per_request_and_per_tenant() -> None:
    # a failover's re-prefill on an L4 ($0.70/h) reuses 720 tokens at 200 tokens/s: 3.6 s
    both = total_reuse([reuse_saving(H100, 3600, 1000.0), reuse_saving(L4, 720, 200.0)])
    assert both == Reuse(4320, pytest.approx(7.2), pytest.approx(0.0025 + 0.0007))
    a = request_cost([PoolUsage("prefill", H100, 1.0)], reuse=both)
    b = request_cost([PoolUsage("prefill", H100, 1.0)])
    totals = aggregate_by_tenant([("acme", a), ("acme", b), ("zeta", b)])
    assert totals["acme"].reused_tokens == 4320
    assert totals["acme"].reuse_saved_usd == pytest.approx(0.0032)
    assert totals["zeta"].reused_tokens == 0
    assert totals["zeta"].reuse_saved_usd == 0.0
