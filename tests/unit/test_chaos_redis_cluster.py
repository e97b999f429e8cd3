"""Chaos on a Redis Cluster the runner starts: the scenario's ``redis_cluster`` and the
``redis:primary`` target (parsing, validation), and the pick of the primary to kill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.redis_primary import busiest_primary, primary_of, record_slots
from orchestrator.chaos.runner import ChaosRunner, cluster_for, shareable
from orchestrator.store.keys import Keys

KILL_PRIMARY = {"at": 1, "kind": "kill", "target": "redis:primary"}
ON_A_CLUSTER = {"redis_cluster": {"primaries": 3, "replicas": 1}}


def _parse(fault: dict[str, Any], cluster: dict[str, Any]) -> sc.Scenario:
    return sc.parse({"faults": [fault], "cluster": cluster}, "s.yaml")


def test_a_redis_cluster_and_its_primary_target_are_parsed() -> None:
    s = _parse({**KILL_PRIMARY, "heal_after": 4}, ON_A_CLUSTER)
    assert s.cluster.redis_cluster == sc.RedisClusterSpec(3, 1, 2000)
    assert (s.faults[0].kind, s.faults[0].target, s.faults[0].heal_after) == (
        "kill", "redis:primary", 4.0,
    )  # fmt: skip
    s = _parse(KILL_PRIMARY, {"redis_cluster": {"primaries": 5, "node_timeout_ms": 1500}})
    assert s.cluster.redis_cluster == sc.RedisClusterSpec(5, 1, 1500)
    assert sc.parse({"faults": [KILL_PRIMARY | {"target": "redis"}]}).cluster.redis_cluster is None


@pytest.mark.parametrize(
    ("fault", "cluster", "message"),
    [
        (KILL_PRIMARY, {}, "unknown target 'redis:primary'"),
        (KILL_PRIMARY | {"target": "redis"}, ON_A_CLUSTER, "unknown target 'redis'"),
        (KILL_PRIMARY, {"redis_cluster": {"replicas": 0}}, "unknown target 'redis:primary'"),
        (KILL_PRIMARY | {"kind": "stop"}, ON_A_CLUSTER, "killed or restarted, not stopped"),
        (KILL_PRIMARY, {"redis_cluster": {"primaries": 2}}, "primaries: 2 is out of range"),
        (KILL_PRIMARY, {"redis_cluster": {"node_timeout_ms": 100}}, "node_timeout_ms"),
        (KILL_PRIMARY, {"redis_cluster": {"shards": 3}}, r"unknown field\(s\) \['shards'\]"),
        (KILL_PRIMARY, {"redis_cluster": 3}, "expected a mapping"),
    ],
)
def test_bad_redis_cluster_scenarios_are_refused(
    fault: dict[str, Any], cluster: dict[str, Any], message: str
) -> None:
    with pytest.raises(sc.ScenarioError, match=message):
        _parse(fault, cluster)


def test_the_shipped_primary_kill_scenario_kills_a_primary_once_streams_flow() -> None:
    s = sc.load("redis-cluster-primary-kill")
    assert s.cluster.redis_cluster is not None
    assert s.cluster.redis_cluster.replicas >= 1
    [fault] = s.faults
    assert (fault.kind, fault.target) == ("kill", sc.REDIS_PRIMARY)
    assert fault.when is not None
    assert fault.when.streams > 0
    assert fault.heal_after is not None


def test_a_scenario_with_its_own_redis_cluster_takes_no_other_redis(tmp_path: Path) -> None:
    s = sc.load("redis-cluster-primary-kill")
    with pytest.raises(sc.ScenarioError, match="faults Redis: not with --redis"):
        ChaosRunner(s, out_dir=tmp_path, redis="redis://127.0.0.1:1/0")
    quiet = sc.parse({"faults": [{"at": 1, "kind": "kill", "target": "decode:busiest"}],
                      "cluster": ON_A_CLUSTER})  # fmt: skip
    with pytest.raises(sc.ScenarioError, match="starts its own Redis Cluster"):
        ChaosRunner(quiet, out_dir=tmp_path, redis="redis://127.0.0.1:1/0")
    # Nor does it run on a cluster started for another scenario (its Redis is not its own).
    plain = sc.load("decode-kill")
    assert shareable(plain, cluster_for(plain.cluster))
    assert not shareable(quiet, cluster_for(plain.cluster))


RANGES = [(0, 5460, 7001), (5461, 10922, 7002), (10923, 16383, 7003)]


def test_the_busiest_primary_holds_the_most_live_records() -> None:
    slots = {"a": 10, "b": 6000, "c": 6001, "d": 16000}
    assert busiest_primary(RANGES, slots) == (7002, ("b", "c"))
    assert busiest_primary(RANGES, {"a": 10, "d": 16000}) == (7001, ("a",))  # tie: lowest
    assert busiest_primary(RANGES, {}) == (7001, ())
    assert primary_of(5461, RANGES) == 7002
    assert primary_of(20000, RANGES) is None
    with pytest.raises(ValueError, match="serves nothing"):
        busiest_primary([], slots)


def test_a_records_slot_is_the_slot_of_all_its_requests_keys() -> None:
    keys = Keys()
    slots = record_slots(["r-1", "chaos-x-0"], keys)
    for rid, slot in slots.items():
        assert slot == key_slot(keys.request(rid).encode())
        assert slot == key_slot(keys.journal(rid).encode())
    assert slots["r-1"] != slots["chaos-x-0"]
