"""`pdorch bench placement`: the fleet it measures, what it reports, its flags."""

from __future__ import annotations

import argparse
import time

import pytest

from orchestrator.bench.placement import fleet, format_result, run_bench
from orchestrator.control.ledger import Ledger
from orchestrator.control.settings import ControlSettings
from orchestrator.core.scheduler import Mode
from tests.unit.test_cli import parse


def test_the_fleet_is_half_prefill_half_decode_and_every_pair_moves_kv() -> None:
    workers = fleet(10)
    assert [w.role for w in workers].count("prefill") == 5
    assert len({w.worker_id for w in workers}) == len({w.address for w in workers}) == 10
    booking = Ledger(ControlSettings()).place(
        workers, need=216, prefill_tokens=200, excluded=set(), now=time.monotonic()
    )
    assert booking.placement.mode is Mode.DISAGGREGATED  # what the bench times is a P/D pair


def test_the_cost_is_reported_per_size_scanned_and_sampled() -> None:
    result = run_bench([4, 400], requests=100)
    assert [r["workers"] for r in result["rows"]] == [4, 400]
    small, large = (r["us_per_request"] for r in result["rows"])
    assert 0 < small < large  # a pass over every worker: 100x the fleet costs more
    assert result["us_per_worker"] > 0
    # Pools of 200 are sampled (64 of each): a fraction of the scan's pass.
    assert result["sample"] == ControlSettings().placement_sample == 64
    assert 0 < result["rows"][1]["us_per_request_sampled"] < large
    assert "400 workers" in format_result(result)


def test_its_flags() -> None:
    args = parse("bench", "placement", "--workers", "10,20", "--requests", "5")
    assert (args.workers, args.requests) == ([10, 20], 5)
    for bad in ("1", "x,2", ""):
        with pytest.raises(SystemExit):
            parse("bench", "placement", "--workers", bad)
    assert isinstance(parse("bench", "placement"), argparse.Namespace)
