"""A whole local fleet on a 3-primary Redis Cluster (issue 21): the chaos scenario
decode-kill (2 orchestrators, 2 prefill + 2 decode workers, the busiest decode worker
SIGKILLed mid-stream) run with ``--redis redis+cluster://…``, checked by the chaos checker.
It is also the suite's run of `pdorch chaos run` itself: its JSON report, the history file and
the timeline picture it draws."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.store.connect import sync_client
from orchestrator.store.ha_servers import LocalRedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.failover, pytest.mark.timeout(300)]


def test_a_chaos_scenario_runs_on_a_redis_cluster(tmp_path: Path) -> None:
    """`pdorch chaos run decode-kill --redis redis+cluster://…`: the checker finds nothing
    lost, duplicated or skipped; a scenario that faults Redis refuses an external one."""
    with LocalRedisCluster(tmp_path / "redis") as redis_cluster:
        argv = [sys.executable, "-m", "orchestrator.cli", "chaos", "run", "decode-kill",
                "--redis", redis_cluster.url, "--json", "--out", str(tmp_path / "out")]  # fmt: skip
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
