"""The control-plane benchmark's arithmetic: percentiles, overhead, the summary, merging."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from orchestrator.bench.control_plane import ControlPlaneBench, _client_argv, _split
from orchestrator.bench.load import (
    LoadResult,
    LoadSpec,
    Sample,
    distribution,
    percentile,
    prompt,
    run_load,
    slot_delay,
)
from orchestrator.errors import ConfigError


def test_nearest_rank_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1
    assert percentile([7.0], 99) == 7
    assert distribution([]) == {}
    assert distribution([1.0, 3.0]) == {"p50": 1, "p90": 3, "p99": 3, "max": 3, "mean": 2}


def _sample(start: float, client: float | None, worker: float | None, **kw: object) -> Sample:
    s = Sample(start=start, end=start + 1, client_ttft_ms=client, worker_ttft_ms=worker)
    s.completed = True
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_overhead_is_client_minus_worker_ttft() -> None:
    assert _sample(0, 30.0, 12.5).overhead_ms == 17.5
    assert _sample(0, 30.0, None).overhead_ms is None  # aggregated: no worker TTFT
    assert _sample(0, None, 12.5).overhead_ms is None  # no token arrived


def test_summary_counts_and_rates() -> None:
    samples = [_sample(float(i), 20.0 + i, 10.0) for i in range(8)]
    samples.append(_sample(3.0, 50.0, None))  # aggregated
    samples.append(_sample(4.0, 25.0, 10.0, contiguous=False))
    refused = _sample(5.0, None, None, completed=False, admitted=False, code="RESOURCE_EXHAUSTED")
    samples.append(refused)
    for k, x in enumerate(samples):
        x.messages = k
    r = LoadResult(samples)
    s = r.summary()
    assert s["messages"] == sum(range(11))  # every stream message, the refused call's too
    assert (s["requests"], s["admitted"], s["completed"]) == (11, 10, 10)
    assert s["not_completed_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["not_contiguous"] == 1
    assert s["aggregated"] == 1
    assert s["duration_s"] == 8.0  # first start 0, last end 8
    assert s["admitted_per_s"] == 1.2  # 10 / 8 s, one decimal
    overhead = s["overhead_ms"]
    assert isinstance(overhead, dict)
    assert overhead["p50"] == 14.0  # 10..17 and 15: the 5th of 9


def test_results_round_trip_and_merge() -> None:
    a = LoadResult([_sample(0, 20.0, 10.0)], cpu_s=1.5)
    b = LoadResult.from_json(LoadResult([_sample(1, 30.0, 10.0)], cpu_s=0.5).to_json())
    merged = LoadResult.merge([a, b])
    assert len(merged.samples) == 2
    assert merged.cpu_s == 2.0
    assert merged.samples[1] == b.samples[0]


def test_prompts_are_distinct_and_sized() -> None:
    assert prompt(1, 10) != prompt(2, 10)
    assert len(prompt(5, 100).split()) == 102


def test_split_and_settings_checks() -> None:
    assert _split(10, 3) == [4, 3, 3]
    assert _split(2, 4) == [1, 1, 0, 0]
    assert ControlPlaneBench(workers=200).pools == (100, 100)
    assert ControlPlaneBench(workers=20, prefill_workers=5).pools == (5, 15)
    with pytest.raises(ConfigError, match="prefill_workers"):
        ControlPlaneBench(workers=4, prefill_workers=4).check()
    with pytest.raises(ConfigError, match="sim"):
        ControlPlaneBench(decode_gpu="T4").check()  # Llama-3 is bf16; a T4 has none


def test_a_ramp_spreads_the_slots_and_processes_interleave() -> None:
    # Without a ramp every slot starts at once (a burst of `concurrency` every wave); with
    # one, slot k of c starts at (k + phase) / c of it, so two processes at phases 0 and
    # 1/2 alternate their arrivals.
    spec = LoadSpec(("x:1",), concurrency=4)
    assert [slot_delay(k, spec) for k in range(4)] == [0.0] * 4
    ramped = LoadSpec(("x:1",), concurrency=4, ramp_s=8.0)
    assert [slot_delay(k, ramped) for k in range(4)] == [0.0, 2.0, 4.0, 6.0]
    other = LoadSpec(("x:1",), concurrency=4, ramp_s=8.0, ramp_phase=0.5)
    assert [slot_delay(k, other) for k in range(4)] == [1.0, 3.0, 5.0, 7.0]


def test_the_control_plane_bench_gives_each_load_process_its_phase() -> None:
    b = ControlPlaneBench(workers=4, concurrency=10, requests=20, clients=2, ramp_s=3.0)
    argv = _client_argv(b, ("x:1",), "WARNING", "")
    phases = [a[a.index("--ramp-phase") + 1] for a in argv]
    assert phases == ["0.0", "0.5"]
    assert all(a[a.index("--ramp-s") + 1] == "3.0" for a in argv)
    with pytest.raises(ConfigError, match="ramp_s"):
        ControlPlaneBench(ramp_s=-1.0).check()


def test_connect_time_round_trips_and_merges_as_the_longest() -> None:
    a = LoadResult([_sample(0, 20.0, 10.0)], cpu_s=1.0, connect_ms=30.0)
    b = LoadResult.from_json(LoadResult([], connect_ms=120.0).to_json())
    assert b.connect_ms == 120.0
    merged = LoadResult.merge([a, b])
    assert merged.connect_ms == 120.0
    assert merged.summary()["connect_ms"] == 120.0


def test_a_target_that_does_not_answer_fails_the_requests_after_the_connect_wait() -> None:
    # The load waits for its channels before its clock starts — boundedly: a target that
    # never answers still ends the load, its requests refused (UNAVAILABLE), not a hang.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    spec = LoadSpec((f"127.0.0.1:{port}",), requests=2, concurrency=2, timeout_s=5.0,
                    connect_timeout_s=0.3)  # fmt: skip
    t0 = time.monotonic()
    result = asyncio.run(run_load(spec))
    assert time.monotonic() - t0 < 5.0
    assert [s.code for s in result.samples] == ["UNAVAILABLE", "UNAVAILABLE"]
    assert not any(s.admitted for s in result.samples)
    assert result.connect_ms >= 250
