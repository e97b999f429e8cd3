"""A short seeded run of every shipped chaos scenario, on its own local cluster.

Each run kills, stops, restarts or degrades real processes and links; the checker must find
no lost request, no duplicate or missing token index, and outputs equal to the fault-free
reference run. The first scenario goes through the `pdorch chaos` command line itself.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner

pytestmark = [pytest.mark.failover, pytest.mark.slow]

SCENARIOS = sorted(set(sc.shipped()) - {"decode-kill"})


def test_cli_decode_kill_reports_json_and_draws_a_timeline(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "orchestrator.cli", "chaos", "run", "decode-kill",
            "--seed", "1", "--json", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) >= {"runs", "requests", "lost", "duplicates", "gaps", "mismatched",
                           "recovery_p50_s", "recovery_p99_s", "errors"}  # fmt: skip
    assert (report["runs"], report["requests"]) == (1, 8)
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0)
    assert report["mismatched"] == 0
    assert report["failovers"] >= 1  # the kill did hit streams, which moved
    assert report["recovery_p99_s"] is not None
    assert report["recovery_p99_s"] < 10
    png = Path(report["timeline"][0])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads(next(tmp_path.glob("run-000-*.json")).read_text())
    assert history["faults"][0]["resolved"].startswith("decode-")


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_short_seeded_run(name: str, tmp_path: Path) -> None:
    scenario = sc.load(name)
    runner = ChaosRunner(scenario, seed=0, runs=1, out_dir=tmp_path, pictures=False)
    result = asyncio.run(runner.run())
    report = result.to_json()
    print(name, json.dumps(report))
    assert report["requests"] == scenario.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert report["mismatched"] == 0, report
    assert result.violations == []
    assert report["faults"] == len(sc.plan(scenario, 0))
