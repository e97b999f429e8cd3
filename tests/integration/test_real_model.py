"""The real model (SmolLM2-135M-Instruct) through `pdorch demo`: processes, UCX, Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_with_smollm2_matches_aggregated() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "demo",
            "--model",
            "smollm2",
            "--max-tokens",
            "16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1150,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["all_match"] is True
    assert len(report["requests"]) == 6
    for r in report["requests"]:
        assert r["prompt_tokens"] > 10
        assert r["output_tokens"] > 0
        assert r["kv_bytes"] == r["prompt_tokens"] * 30 * 2 * 3 * 64 * 4  # 46 KB per token
        assert r["ttft_ms"] > 0
