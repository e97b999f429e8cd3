"""`pdorch bench control-plane`'s scale options: core assignment, the projection, the flags
and the switch that hides hiredis. Pure, but for the last test (one short Python process)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from orchestrator.bench.control_plane import ControlPlaneBench
from orchestrator.bench.no_hiredis import child_hiredis, without_hiredis
from orchestrator.bench.scale import Usage, assign_cores, project
from orchestrator.cli import bench
from orchestrator.errors import ConfigError
from tests.unit.test_cli import parse


def test_more_cores_than_pinned_processes_gives_each_its_own() -> None:
    a = assign_cores(["orchestrator-0", "orchestrator-1", "redis-0"], [3, 0, 1, 2])
    assert dict(a.pinned) == {"orchestrator-0": 0, "orchestrator-1": 1, "redis-0": 2}
    assert a.rest == (3,)
    assert a.dedicated


def test_too_few_cores_are_dealt_round_robin_and_shared_with_the_rest() -> None:
    a = assign_cores(["orchestrator-0", "orchestrator-1", "redis-0", "redis-1"], [0, 1])
    assert dict(a.pinned) == {
        "orchestrator-0": 0, "orchestrator-1": 1, "redis-0": 0, "redis-1": 1,
    }  # fmt: skip
    assert a.rest == (0, 1)
    assert not a.dedicated
    # As many cores as pinned processes: nothing left for the fleet, so nothing dedicated.
    assert not assign_cores(["orchestrator-0", "redis"], [0, 1]).dedicated
    assert "orchestrator-0→0" in a.describe()


def test_core_assignment_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="no core"):
        assign_cores(["a"], [])
    with pytest.raises(ConfigError, match="distinct"):
        assign_cores(["a", "a"], [0, 1, 2])


USAGE = Usage(
    cpu_s={"orchestrator-0": 3.0, "orchestrator-1": 1.0, "redis-0": 0.5, "redis-1": 0.5,
           "decode_fleet": 9.0, "clients": 2.0},
    tier={"orchestrator-0": "orchestrators", "orchestrator-1": "orchestrators",
          "redis-0": "redis", "redis-1": "redis"},
    requests=100,
    tokens=20_000,
)  # fmt: skip


def test_per_process_figures_are_cpu_per_request_and_per_token() -> None:
    per = USAGE.per_process()
    assert per["orchestrator-0"] == {"cpu_ms_per_request": 30.0, "cpu_us_per_token": 150.0}
    assert per["clients"] == {"cpu_ms_per_request": 20.0, "cpu_us_per_token": 100.0}


def test_projection_per_core_and_per_tier() -> None:
    orch = project(USAGE, "orchestrators", gpu_tokens_per_s=1000.0)
    assert orch is not None
    assert orch.processes == 2
    assert orch.us_per_token == pytest.approx(200.0)  # 4 CPU-s over 20,000 tokens
    assert orch.tokens_per_s_per_core == pytest.approx(5000.0)
    assert orch.decode_gpus_per_core == pytest.approx(5.0)
    # Unbalanced: the busiest replica (3 of 4 CPU-s) saturates first.
    assert orch.busiest_share == pytest.approx(0.75)
    assert orch.tier_tokens_per_s == pytest.approx(20_000 / 3.0)
    redis = project(USAGE, "redis", gpu_tokens_per_s=1000.0)
    assert redis is not None
    # Balanced shards: the tier sustains one core's worth per shard.
    assert redis.tier_tokens_per_s == pytest.approx(2 * redis.tokens_per_s_per_core)
    assert redis.tier_decode_gpus == pytest.approx(40.0)  # 2 shards x 20,000 tokens/s
    assert redis.to_dict()["tokens_per_s_per_core"] == 20_000  # 50 µs per token


def test_nothing_to_project_from_is_none_not_infinity() -> None:
    assert project(Usage({"redis": 0.0}, {"redis": "redis"}, 1, 10), "redis", 1.0) is None
    assert project(Usage({"redis": 1.0}, {"redis": "redis"}, 1, 0), "redis", 1.0) is None
    assert project(USAGE, "no-such-tier", 1.0) is None
    with pytest.raises(ConfigError, match="gpu_tokens_per_s"):
        project(USAGE, "redis", 0.0)


def test_the_projected_gpu_is_the_performance_model_one() -> None:
    rate = ControlPlaneBench().gpu_tokens_per_s
    assert math.isfinite(rate)
    assert rate > 0
    # A bigger batch produces more tokens per second (memory-bound decode).
    assert ControlPlaneBench(gpu_batch=1).gpu_tokens_per_s < rate


def test_scale_flags_fill_the_bench_spec() -> None:
    args = parse(
        "bench", "control-plane", "--redis-shards", "3", "--orchestrators", "2",
        "--pin", "on", "--hiredis", "off", "--gpu-batch", "64",
    )  # fmt: skip
    b = bench.control_plane_bench(args)
    assert (b.redis_shards, b.orchestrators, b.pin, b.hiredis, b.gpu_batch) == (
        3, 2, True, False, 64,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        parse("bench", "control-plane", "--redis-shards", "-1")
    with pytest.raises(ConfigError, match="redis_shards"):
        ControlPlaneBench(redis_shards=-1).check()
    with pytest.raises(ConfigError, match="gpu_batch"):
        ControlPlaneBench(gpu_batch=0).check()


def test_hiredis_is_used_unless_the_bench_hides_it(tmp_path: Path) -> None:
    import redis.utils  # noqa: PLC0415

    assert redis.utils.HIREDIS_AVAILABLE, "hiredis is a dependency (redis[hiredis])"
    assert child_hiredis({})
    env = without_hiredis(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "no-hiredis")
    assert not child_hiredis(env)
    assert sys.modules.get("hiredis") is not None  # this process is untouched
