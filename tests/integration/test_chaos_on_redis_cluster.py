"""A whole local fleet on a 3-primary Redis Cluster (issue 21): the chaos scenario
decode-kill (2 orchestrators, 2 prefill + 2 decode workers, the busiest decode worker
SIGKILLed mid-stream) run with ``--redis redis+cluster://…``, checked by the chaos checker.
It is also the suite's run of `pdorch chaos run` itself: its JSON report, the history file and
the timeline picture it draws. Then the scenario redis-cluster-primary-kill, whose runner
starts its own Redis Cluster (3 primaries, 1 replica each) and SIGKILLs a primary mid-run:
what its failover cost, in the checker's terms."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.store.connect import sync_client
from orchestrator.store.ha_servers import LocalRedisCluster
from tests.integration.conftest import LATE_BOUND_S

pytestmark = [pytest.mark.slow, pytest.mark.failover, pytest.mark.timeout(300)]


def test_a_chaos_scenario_runs_on_a_redis_cluster(tmp_path: Path) -> None:
    """`pdorch chaos run decode-kill --redis redis+cluster://…`: the checker finds nothing
    lost, duplicated or skipped; a scenario that faults Redis refuses an external one."""
    with LocalRedisCluster(tmp_path / "redis") as redis_cluster:
        argv = [sys.executable, "-m", "orchestrator.cli", "chaos", "run", "decode-kill",
                "--redis", redis_cluster.url, "--json", "--out", str(tmp_path / "out"),
                "--late-bound", str(LATE_BOUND_S)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        print("chaos decode-kill on a Redis Cluster:", json.dumps(report))
        assert set(report) >= {"runs", "requests", "lost", "duplicates", "gaps", "mismatched",
                               "recovery_p50_s", "recovery_p99_s", "errors"}  # fmt: skip
        assert (report["runs"], report["requests"], report["faults"]) == (1, 8, 1), report
        png = Path(report["timeline"][0])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        history = json.loads(next((tmp_path / "out").glob("run-000-*.json")).read_text())
        assert [(f["kind"], f["target"]) for f in history["faults"]] == [
            ("kill", "decode:busiest")
        ], history["faults"]
        assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
        assert (report["mismatched"], report["failed"]) == (0, 0), report
        assert report["recoveries"] > 0  # the kill hit streams
        sizes = []  # the fleet's state really was spread over the cluster's primaries
        for node in redis_cluster.nodes:
            with contextlib.closing(sync_client(f"redis://127.0.0.1:{node.port}/0")) as client:
                sizes.append(client.dbsize())
        assert sum(1 for n in sizes if n > 0) >= 2, sizes
        refused = subprocess.run(
            [*argv[:5], "redis-restart", "--redis", redis_cluster.url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode == 2
        assert "faults Redis" in refused.stderr


def test_a_redis_cluster_primary_killed_mid_run_loses_nothing_the_checker_sees(
    tmp_path: Path,
) -> None:
    """`pdorch chaos run redis-cluster-primary-kill`: once 6 streams are active, the primary
    holding the most live request records is SIGKILLed; its replica is promoted, the killed
    node comes back as a replica. pdorch does not WAIT for replication, so writes the primary
    acknowledged and had not copied die with it; the drivers repair the journals' tails and
    re-create lost records: the checker finds every request ended once, its output the
    reference's, nothing lost, duplicated or skipped, no request failed."""
    argv = [sys.executable, "-m", "orchestrator.cli", "chaos", "run",
            "redis-cluster-primary-kill", "--json", "--out", str(tmp_path / "out"),
            "--late-bound", str(LATE_BOUND_S)]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print("chaos redis-cluster-primary-kill:", json.dumps(report))
    history = json.loads(next((tmp_path / "out").glob("run-000-*.json")).read_text())
    [fault] = history["faults"]
    print("its fault:", json.dumps(fault))
    assert (fault["kind"], fault["target"], fault["error"]) == ("kill", "redis:primary", "")
    resolved = re.fullmatch(r"primary :\d+ \((\d+) of (\d+) live records; replica :(\d+)\)",
                            fault["resolved"])  # fmt: skip
    assert resolved is not None, fault["resolved"]
    held, live = int(resolved[1]), int(resolved[2])
    assert live >= 6  # the trigger
    assert held >= 2  # the busiest of 3 primaries for 6+ records
    assert len(fault["affected"]) == held
    assert fault["outcome"].startswith(f"replica :{resolved[3]} promoted"), fault["outcome"]
    assert fault["at"] < fault["promoted_at"] < fault["healed_at"]
    assert (report["runs"], report["requests"], report["faults"]) == (1, 8, 1), report
    assert (report["fault_errors"], report["late_faults"]) == (0, 0), report
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert (report["mismatched"], report["failed"], report["indeterminate"]) == (0, 0, 0), report
    # Every stream whose record was on the killed primary went on after the kill.
    assert (report["recoveries"], report["unrecovered"]) == (held, 0), report
    assert report["violations"] == [], report
