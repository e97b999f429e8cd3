"""A short seeded run of every shipped chaos scenario.

Each run kills, stops, restarts or degrades real processes and links; the checker must find
no lost request, no duplicate or missing token index, and outputs equal to the fault-free
reference run. Scenarios of the same cluster shape share one cluster (restored between
them); those needing fault proxies in front of processes start their own. One scenario goes
through the `pdorch chaos` command line itself, on a Redis Cluster
(`test_chaos_on_redis_cluster.py`): decode-kill, which is therefore not repeated here; so
does redis-cluster-primary-kill, whose runner starts its own Redis Cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner, cluster_for, shareable
from orchestrator.cluster import LocalCluster
from tests.integration.conftest import LATE_BOUND_S

# Worker restarts (imports under full CPU) make pool scenarios take 45-65 s on a quiet 2-core
# machine and more on a busy one: more room than the suite's default 120 s.
pytestmark = [pytest.mark.failover, pytest.mark.slow, pytest.mark.timeout(300)]

SCENARIOS = sorted(
    name
    # decode-kill and redis-cluster-primary-kill: run by test_chaos_on_redis_cluster.py
    for name in set(sc.shipped()) - {"decode-kill", "redis-cluster-primary-kill"}
    if sc.load(name).cluster.engine == "reference"  # vLLM's: tests/vllm/test_vllm_chaos.py
)


@pytest.fixture(scope="module")
def shared() -> Iterator[LocalCluster]:
    with cluster_for(sc.ClusterSpec()) as cluster:
        yield cluster


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_short_seeded_run(name: str, tmp_path: Path, shared: LocalCluster) -> None:
    scenario = dataclasses.replace(sc.load(name), late_bound_s=LATE_BOUND_S)
    cluster = shared if shareable(scenario, shared) else None
    runner = ChaosRunner(scenario, seed=0, out_dir=tmp_path, pictures=False, cluster=cluster)
    result = asyncio.run(runner.run())
    report = result.to_json()
    print(name, json.dumps(report))
    assert report["requests"] == scenario.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert report["mismatched"] == 0, report
    assert report["failed"] == 0, report
    notes = [note for run in result.summary.runs for note in run.fault_notes]
    assert result.violations == [], notes  # no_leaks included: every worker's KV back to 0
    assert report["leak_checks"] == 1
    assert report["faults"] == len(sc.plan(scenario, 0))
    aimed = [f for f in sc.plan(scenario, 0) if not f.target.endswith(":random")]
    if any(f.kind in {"kill", "restart"} for f in aimed):
        assert report["recoveries"] > 0  # the faults did hit streams
    # (A fault on a random target may find it idle: random-mix's prefill kills often do.)
