"""The shipped chaos scenario with vLLM workers (`vllm-failover`): a decode worker killed
mid-stream, then the prefill worker killed mid-transfer, on 1 prefill + 2 decode vLLM workers.

The chaos checker's verdict must be clean — no lost request, no duplicate or skipped token
index, outputs equal to the fault-free reference run — and so must its leak check: after the
quiet period every surviving worker's vLLM block pool has all its free blocks back (the
killed transfer's partial KV was discarded, the failed-over requests' blocks returned), no
KV in use, no sequence active. Both kills wait for their request phase (a stream decoding
on the decode worker; a prefill 2 s into its push on a slowed link) and must have hit
streams, or the run proved nothing.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner

pytestmark = [pytest.mark.vllm, pytest.mark.failover, pytest.mark.timeout(900)]


def test_vllm_failover_scenario_loses_nothing_and_leaks_no_block(tmp_path: Path) -> None:
    scenario = sc.load("vllm-failover")
    runner = ChaosRunner(scenario, seed=0, out_dir=tmp_path, pictures=False)
    result = asyncio.run(runner.run())
    report = result.to_json()
    print(json.dumps(report))
    assert report["requests"] == scenario.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert (report["mismatched"], report["failed"]) == (0, 0), report
    assert report["leak_checks"] == 1
    assert report["pool_blocks_checked"] > 0, "the leak check read no vLLM block pool"
    assert (report["leaked_blocks"], report["kv_in_use_bytes"]) == (0, 0), report
    assert report["active_after_quiet"] == 0, report
    assert result.violations == []
    assert report["fault_errors"] == 0, report
    history = json.loads(result.histories[0].read_text())
    kills = {f["target"]: f for f in history["faults"] if f["kind"] == "kill"}
    assert set(kills) == {"decode:busiest", "prefill:busiest"}
    for target, fault in kills.items():  # each fired by its phase, on a stream it hit
        assert fault["trigger"], fault
        assert fault["affected"], f"the {target} kill hit no stream: {fault}"
    assert report["failovers"] >= 2, report
