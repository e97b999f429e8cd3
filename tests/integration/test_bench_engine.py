"""`pdorch bench engine` on the reference engine with the tiny model: the result has a level
per concurrency with real figures, and every phase (cluster start, each level) is reported as
progress while it runs (issue 19: no silence during long work)."""

from __future__ import annotations

import pytest

from orchestrator.bench.engine_batching import EngineBench, format_result, run_bench

pytestmark = pytest.mark.slow


def test_bench_engine_measures_each_level_and_reports_progress() -> None:
    lines: list[str] = []
    bench = EngineBench(
        engine="reference", model="tiny", concurrency=(1, 2), rounds=1, max_tokens=4, warmup=0
    )
    result = run_bench(bench, progress=lines.append)
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert [lv["requests"] for lv in result["levels"]] == [1, 2]
    assert all(lv["tpot_ms"] > 0 for lv in result["levels"])
    assert result["tpot_ratio_of"] == [1, 2]
    assert lines[0].startswith("starting one reference worker with tiny")
    assert lines[1].startswith("cluster up in ")
    assert lines[2:] == [
        "1 stream(s): 1 requests of 4 tokens",
        lines[3],
        "2 stream(s): 2 requests of 4 tokens",
        lines[5],
    ]
    assert lines[3].startswith("1 stream(s): TPOT p50 ")
    assert lines[5].startswith("2 stream(s): TPOT p50 ")
    assert "TPOT" in format_result(result)
