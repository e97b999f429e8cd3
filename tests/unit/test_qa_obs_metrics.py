"""The orchestrator's metrics keep their label values bounded whatever clients send."""

from __future__ import annotations

import pytest

from orchestrator.control.metrics import MAX_TENANTS, OTHER_TENANTS, ControlMetrics


def _cost_series(metrics: ControlMetrics) -> dict[str, float]:
    return {
        sample.labels["tenant"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "pdorch_cost_usd"
        for sample in family.samples
        if sample.name == "pdorch_cost_usd_total"
    }


def test_many_tenants_make_a_bounded_number_of_series() -> None:
    metrics = ControlMetrics()
    for i in range(10 * MAX_TENANTS):
        cost = {"tenant": f"flood-{i}", "usd": 0.5, "decode_gpu_s": 0.0}
        metrics.finished("done", "length", {}, cost)
    series = _cost_series(metrics)
    assert len(series) == MAX_TENANTS + 1
    assert series[OTHER_TENANTS] == pytest.approx(0.5 * 9 * MAX_TENANTS)
    assert sum(series.values()) == pytest.approx(0.5 * 10 * MAX_TENANTS)  # nothing lost
    # A tenant seen before the limit keeps its own series.
    metrics.finished("done", "length", {}, {"tenant": "flood-0", "usd": 1.0})
    assert _cost_series(metrics)["flood-0"] == pytest.approx(1.5)


def test_default_tenant_is_labelled_default() -> None:
    metrics = ControlMetrics()
    metrics.finished("done", "stop", {}, {"usd": 0.25})
    assert _cost_series(metrics) == {"default": 0.25}
