"""`pdorch migrate status` and report text, found by QA."""

from __future__ import annotations

from orchestrator.migrate import report
from orchestrator.migrate.policy import Sample
from orchestrator.migrate.service import format_status


def test_status_says_a_latency_limit_is_off_without_a_unit() -> None:
    snap = {
        "name": "chat",
        "mode": "canary",
        "percent": 5.0,
        "limits": {
            "max_error_rate": 0.05,
            "max_ttft_p99_ms": 0.0,
            "max_tpot_p99_ms": 80.0,
            "window": 100,
            "min_samples": 20,
        },
    }
    line = format_status(snap).splitlines()[2]
    assert line == "  limits: error rate 0.05, TTFT p99 off, TPOT p99 80 ms, window 100 (min 20)"


def test_the_report_does_not_show_a_small_cost_as_zero() -> None:
    """Three tiny-model requests on CPU workers ($0.10/h): about 4e-7 USD each."""
    samples = [
        Sample(
            ts=1000.0 + i,
            request_id=f"r{i}",
            path="pdorch",
            role="answer",
            stream=False,
            status=200,
            failed=False,
            total_ms=40.0,
            cost_usd=4.3e-7,
        )
        for i in range(3)
    ]
    summary = report.summarize("chat", {"mode": "canary", "percent": 100.0}, samples, [])
    text = report.markdown(summary, [])
    assert "| cost per request | — | $4.3e-07 |" in text
