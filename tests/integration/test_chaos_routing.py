"""Issue 20 item 5: the chaos runner's guarantees hold with KV-aware routing and suffix-only
KV transfer at work. Simulated prefix-cache workers (``engine: sim``), prompts sharing a
48-word opening, the busiest decode worker SIGKILLed mid-stream and restarted, a prefill
worker killed: no request lost, duplicated, gapped or changed, no KV left held — and
transfers did go out as suffixes (the records say so)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner, cluster_for
from orchestrator.store.keys import Keys
from tests.integration.conftest import LATE_BOUND_S

pytestmark = [pytest.mark.failover, pytest.mark.slow, pytest.mark.timeout(240)]

SCENARIO = """
name: routing-decode-kill
description: routing + suffix-only KV on simulated prefix caches; decode and prefill killed
cluster: {prefill: 2, decode: 2, orchestrators: 2, transport: tcp, engine: sim}
workload: {requests: 12, concurrency: 6, prompt_words: [4, 24], shared_prefix_words: 48,
           output_tokens: [40, 80]}
faults:
  - {between: [0.8, 1.6], kind: kill, target: "decode:busiest", heal_after: 2.0}
  - {at: 2.0, kind: kill, target: "prefill:random", heal_after: 1.0}
duration_s: 8
quiet_s: 5
"""


def _placements(port: int) -> list[str]:
    client = redis.Redis(port=port, decode_responses=True)
    try:
        keys = Keys()
        out = []
        for key in client.scan_iter(count=1000):
            if keys.request_id(key) is not None and client.type(key) == "hash":
                out.append(client.hget(key, "placement") or "")
        return out
    finally:
        client.close()


def test_chaos_is_clean_with_routing_and_suffix_transfers(tmp_path: Path) -> None:
    path = tmp_path / "routing-decode-kill.yaml"
    path.write_text(SCENARIO)
    scenario = replace(sc.load(str(path)), late_bound_s=LATE_BOUND_S)
    with cluster_for(scenario.cluster) as cluster:
        runner = ChaosRunner(scenario, seed=0, out_dir=tmp_path, pictures=False, cluster=cluster)
        result = asyncio.run(runner.run())
        placements = _placements(cluster.redis_port)
    report = result.to_json()
    print(json.dumps(report))
    assert report["requests"] == scenario.workload.requests
    assert (report["lost"], report["duplicates"], report["gaps"]) == (0, 0, 0), report
    assert report["mismatched"] == 0, report
    assert report["failed"] == 0, report
    assert result.violations == []  # no_leaks included
    assert report["recoveries"] > 0  # the decode kill hit streams
    assert any("KV suffix only" in p for p in placements), placements
