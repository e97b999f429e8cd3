"""The chaos checker and scenario files: pure, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.checker import Summary, check_run, percentile
from orchestrator.chaos.history import FaultRecord, History, Op, RequestSpec
from orchestrator.chaos.leaks import Gauges, LeakReport, check_leaks

REF = {0: (10, 11, 12, 13, 14, 15), 1: (20, 21, 22, 23)}


def history(ops: list[Op], faults: list[FaultRecord] | None = None) -> History:
    h = History(run=0, seed=1)
    h.requests["r0"] = RequestSpec("r0", 0, 6)
    h.requests["r1"] = RequestSpec("r1", 1, 4)
    h.ops.extend(sorted(ops, key=lambda o: o.t))
    h.faults.extend(faults or [])
    return h


def clean_r1() -> list[Op]:
    return [
        Op(0.0, "invoke", "r1", 1),
        Op(0.1, "chunk", "r1", 1, index=0, tokens=(20, 21, 22, 23)),
        Op(0.2, "ok", "r1", 1, code="length"),
    ]


def test_a_resumed_stream_that_tiles_the_output_is_clean() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11)),
        Op(0.5, "info", "r0", 1, code="UNAVAILABLE"),
        Op(0.6, "invoke", "r0", 2, index=2),
        Op(0.9, "chunk", "r0", 2, index=2, tokens=(12, 13, 14, 15)),
        Op(1.0, "ok", "r0", 2, code="length"),
        *clean_r1(),
    ]
    fault = FaultRecord(0.4, "kill", "decode:busiest", "decode-0", ("r0",))
    v = check_run(history(ops, [fault]), REF, {"r0": "done", "r1": "done"})
    assert v.clean
    assert [(r.duplicates, r.gaps, r.lost, r.mismatched) for r in v.requests] == [
        (0, 0, False, False),
        (0, 0, False, False),
    ]
    assert v.recoveries == [("kill decode-0", "r0", pytest.approx(0.5))]
    assert v.errors == {"UNAVAILABLE": 1}


def test_tokens_produced_before_the_fault_are_not_its_recovery() -> None:
    """The killed worker had journalled 3 tokens; chunks with indices below 3 that reach the
    client after the kill were on their way already. Recovery is the first newer token."""
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11)),
        Op(0.41, "chunk", "r0", 1, index=2, tokens=(12,)),  # in flight at the kill
        Op(0.9, "chunk", "r0", 1, index=3, tokens=(13, 14, 15)),  # from the new worker
        Op(1.0, "ok", "r0", 1, code="length"),
        *clean_r1(),
    ]
    fault = FaultRecord(0.4, "kill", "decode:busiest", "decode-0", ("r0",), journalled={"r0": 3})
    v = check_run(history(ops, [fault]), REF, {"r0": "done", "r1": "done"})
    assert v.recoveries == [("kill decode-0", "r0", pytest.approx(0.5))]
    unmarked = FaultRecord(0.4, "kill", "decode:busiest", "decode-0", ("r0",))
    v = check_run(history(ops, [unmarked]), REF, {"r0": "done", "r1": "done"})
    assert v.recoveries == [("kill decode-0", "r0", pytest.approx(0.01))]  # no mark: as before


def test_duplicates_gaps_and_truncation_are_counted() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11, 12)),
        Op(0.2, "chunk", "r0", 1, index=1, tokens=(11, 12, 13)),  # 2 duplicates
        Op(0.3, "chunk", "r0", 1, index=5, tokens=(15,)),  # gap of 1 (index 4)
        Op(0.4, "ok", "r0", 1, code="length"),
        Op(0.0, "invoke", "r1", 1),
        Op(0.1, "chunk", "r1", 1, index=0, tokens=(20, 21)),
        Op(0.2, "ok", "r1", 1, code="length"),  # "length" after 2 of 4: truncated
    ]
    v = check_run(history(ops), REF, {"r0": "done", "r1": "done"})
    r0, r1 = v.requests
    assert (r0.duplicates, r0.gaps) == (2, 1)
    assert r0.mismatched  # index 4 is missing
    assert (r1.duplicates, r1.gaps) == (0, 2)
    assert not v.clean


def test_acknowledged_request_without_terminal_state_is_lost() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10,)),
        Op(0.2, "info", "r0", 1, code="UNAVAILABLE"),
        *clean_r1(),
    ]
    fault = FaultRecord(0.15, "kill", "orchestrator", "orchestrator-0", ("r0",))
    v = check_run(history(ops, [fault]), REF, {"r0": "decoding", "r1": "done"})
    assert v.requests[0].lost
    assert v.requests[0].outcome == "indeterminate"
    assert v.unrecovered == [("kill orchestrator-0", "r0")]
    # never acknowledged (no token, no record): not lost, just not admitted
    unacked = [Op(0.0, "invoke", "r0", 1), Op(0.1, "fail", "r0", 1, code="UNAVAILABLE")]
    v2 = check_run(history(unacked + clean_r1()), REF, {"r0": "", "r1": "done"})
    assert not v2.requests[0].lost
    assert v2.errors == {"UNAVAILABLE": 1}


def test_mismatch_reports_the_first_divergence() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11, 12, 99, 14, 15)),
        Op(0.2, "ok", "r0", 1, code="length"),
        *clean_r1(),
    ]
    v = check_run(history(ops), REF, {"r0": "done", "r1": "done"})
    assert v.requests[0].mismatched
    assert v.requests[0].first_divergence == 3
    assert v.clean  # a mismatch is not a lost/duplicate/gap


def test_summary_json_has_the_documented_fields() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11, 12, 13, 14, 15)),
        Op(0.3, "ok", "r0", 1, code="length"),
        *clean_r1(),
    ]
    fault = FaultRecord(0.05, "kill", "decode:busiest", "decode-1", ("r0", "r1"))
    s = Summary("x", [check_run(history(ops, [fault]), REF, {"r0": "done", "r1": "done"})])
    out = s.to_json()
    for key in ("runs", "requests", "lost", "duplicates", "gaps", "mismatched",
                "recovery_p50_s", "recovery_p99_s", "errors"):  # fmt: skip
        assert key in out
    assert (out["runs"], out["requests"], out["lost"]) == (1, 2, 0)
    assert out["recovery_p50_s"] == pytest.approx(0.05)  # r1's chunk at 0.1
    assert out["recovery_p99_s"] == pytest.approx(0.05)
    assert s.violations(sc.INVARIANTS) == []
    assert "recovery" in s.human()


def test_percentile_is_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


# ----------------------------------------------------------------------------- scenarios


def test_every_shipped_scenario_parses_and_has_a_plan() -> None:
    names = sc.shipped()
    required = {"decode-kill", "prefill-kill-transfer", "kv-link-faults", "pool-out-and-back",
                "orchestrator-kill", "redis-restart"}  # fmt: skip
    assert required <= set(names)
    for name in names:
        s = sc.load(name)
        assert s.name == name
        faults = sc.plan(s, 0)
        assert faults
        assert all(0 <= f.at < s.duration_s for f in faults)


def test_a_workload_says_how_its_clients_call() -> None:
    assert sc.load("orchestrator-kill").workload.client == "generate"
    assert sc.load("orchestrator-kill-many").workload.client == "generate-many"
    with pytest.raises(sc.ScenarioError, match="client"):
        sc._workload({"client": "websocket"}, "workload")


def test_plans_are_reproducible_from_the_seed() -> None:
    s = sc.load("random-mix")
    assert sc.plan(s, 5) == sc.plan(s, 5)
    plans = {tuple((f.at, f.kind, f.target) for f in sc.plan(s, seed)) for seed in range(10)}
    assert len(plans) > 1
    for p in sc.plan(s, 3):
        assert p.kind in {"kill", "stop", "restart"}
        assert 0.5 <= p.at <= 4.0


def test_kv_fault_spec_keeps_each_kv_fault_its_own_parameters() -> None:
    s = sc.load("kv-link-faults")
    assert s.links() == {"kv"}
    delay, corrupt = ("delay", {"delay_ms": 300.0}), ("corrupt", {"probability": 0.5})
    bandwidth, drop = ("bandwidth", {"bytes_per_s": 1e6}), ("drop", {})
    spec = sc.kv_fault_spec([delay, corrupt, bandwidth, drop], gate=None)
    assert spec == "lag=0.3,layer=1,corrupt=4099,p=0.5,bw=1e+06,drop=1,seed=7,armed=1"
    # one fault healed: the others keep their parameters; none left: nothing armed
    assert sc.kv_fault_spec([corrupt], gate=None) == "layer=1,corrupt=4099,p=0.5,seed=7,armed=1"
    assert sc.kv_fault_spec([], gate=None) == "seed=7,armed=0"
    assert sc.kv_fault_spec([], gate=2) == f"hold_layer=2,hold={sc.GATE_HOLD_S:g},seed=7,armed=1"


CORRUPT_2 = {"probability": 2}
DELAY = {"delay_ms": 100}
BASE = {"faults": [{"at": 1, "kind": "kill", "target": "decode:busiest"}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected a mapping"),
        ({}, "needs faults"),
        ({**BASE, "bogus": 1}, "unknown field"),
        ({**BASE, "cluster": {"decode": -1}}, "cluster.decode"),
        ({**BASE, "cluster": {"transport": "carrier-pigeon"}}, "cluster.transport"),
        ({**BASE, "workload": {"output_tokens": [10, 5]}}, "above high"),
        ({**BASE, "workload": {"requests": "many"}}, "workload.requests"),
        ({"faults": [{"at": 1, "kind": "explode", "target": "redis"}]}, "faults[0].kind"),
        ({"faults": [{"at": 1, "kind": "kill", "target": "decode-7"}]}, "unknown target"),
        ({"faults": [{"at": 1, "kind": "kill", "target": "decode:decode-9"}]}, "unknown target"),
        ({"faults": [{"at": 1, "kind": "delay", "target": "decode:busiest"}]}, "does not apply"),
        ({"faults": [{"at": 1, "kind": "kill", "target": "link:kv"}]}, "does not apply"),
        ({"faults": [{"at": 1, "kind": "stop", "target": "redis"}]}, "not stopped"),
        ({"faults": [{"at": 1, "kind": "continue", "target": "redis"}]}, "not stopped"),
        ({"faults": [{"at": 1, "kind": "continue", "target": "link:kv"}]}, "does not apply"),
        ({"faults": [{"at": 1, "kind": "delay", "target": "link:kv"}]}, "needs delay_ms"),
        ({"faults": [{"kind": "kill", "target": "redis"}]}, "exactly one of at and between"),
        ({"faults": [{"at": 99, "kind": "kill", "target": "redis"}], "duration_s": 10}, "after"),
        ({**BASE, "invariants": ["no_lost", "be_fast"]}, "unknown"),
        ({**BASE, "cluster": {"engine": "sglang"}}, "cluster.engine"),
        ({**BASE, "cluster": {"engine": "vllm", "model": "tiny"}}, "smollm2 only"),
        (
            {
                "cluster": {"engine": "vllm", "model": "smollm2", "transport": "ucx"},
                "faults": [{"at": 1, "kind": "delay", "target": "link:kv", "params": DELAY}],
            },
            "need transport tcp",
        ),
        ({**BASE, "leak_wait_s": -1}, "leak_wait_s"),
        (
            {"faults": [{"at": 1, "kind": "corrupt", "target": "link:kv", "params": CORRUPT_2}]},
            "probability",
        ),
    ],
)
def test_bad_scenarios_name_the_field(data: object, message: str) -> None:
    with pytest.raises(sc.ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
        sc.parse(data, "s.yaml")


def test_load_reports_unknown_names_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(sc.ScenarioError, match="decode-kill"):  # lists what exists
        sc.load("no-such-scenario")
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults: [unclosed")
    with pytest.raises(sc.ScenarioError, match=r"bad\.yaml"):
        sc.load(str(bad))


def test_a_stream_the_server_cancelled_is_a_failure_not_a_completion() -> None:
    ops = [
        Op(0.0, "invoke", "r0", 1),
        Op(0.1, "chunk", "r0", 1, index=0, tokens=(10, 11)),
        Op(0.2, "ok", "r0", 1, code="cancelled"),
        *clean_r1(),
    ]
    v = check_run(history(ops), REF, {"r0": "cancelled", "r1": "done"})
    assert v.requests[0].outcome == "fail"
    assert not v.requests[0].mismatched  # not compared: it never completed
    assert Summary("x", [v]).to_json()["failed"] == 1


def test_stop_then_continue_as_separate_faults() -> None:
    s = sc.parse(
        {
            "faults": [
                {"at": 1, "kind": "stop", "target": "pool:prefill"},
                {"at": 3, "kind": "continue", "target": "pool:prefill"},
            ]
        }
    )
    assert [(f.at, f.kind) for f in sc.plan(s, 0)] == [(1.0, "stop"), (3.0, "continue")]


# ----------------------------------------------------------------------------- leaks

IDLE_VLLM = Gauges(active=0, kv_used_bytes=0, kv_blocks=180, kv_free_blocks=180)
IDLE_REF = Gauges()


def _clean_run(leaks: LeakReport | None) -> Summary:
    ops = [Op(0.0, "invoke", "r0", 1), Op(0.1, "chunk", "r0", 1, index=0,
           tokens=REF[0]), Op(0.2, "ok", "r0", 1, code="length"), *clean_r1()]  # fmt: skip
    v = check_run(history(ops), REF, {"r0": "done", "r1": "done"}, leaks=leaks)
    return Summary("x", [v])


def test_blocks_not_back_in_vllms_pool_are_leaked_and_fail_the_verdict() -> None:
    baseline = {"decode-0": IDLE_VLLM, "decode-1": IDLE_VLLM, "prefill-0": IDLE_VLLM}
    final = {
        "decode-0": IDLE_VLLM,
        "decode-1": Gauges(0, 0, 180, 177),  # 3 blocks never returned, nothing else shows it
        "prefill-0": IDLE_VLLM,
    }
    report = check_leaks(baseline, final)
    assert report.leaked_blocks == {"decode-1": 3}
    assert not report.clean
    summary = _clean_run(report)
    assert not summary.runs[0].clean
    assert summary.to_json()["leaked_blocks"] == 3
    assert summary.to_json()["pool_blocks_checked"] == 540
    assert summary.violations(sc.INVARIANTS) == ["leaked_blocks=3"]
    assert summary.violations(sc.INVARIANTS - {"no_leaks"}) == []  # reported, not enforced
    assert "leaked blocks 3" in summary.human()
    assert "decode-1" in summary.human()


def test_a_pool_back_to_its_baseline_is_clean() -> None:
    warm = Gauges(0, 0, 180, 176)  # a baseline below the pool's size stays the reference
    report = check_leaks({"decode-0": warm}, {"decode-0": warm})
    assert report.clean
    summary = _clean_run(report)
    assert summary.violations(sc.INVARIANTS) == []
    assert summary.to_json()["leak_checks"] == 1


def test_a_restarted_worker_is_compared_with_its_new_pool() -> None:
    """Killed and restarted during the run: not in the baseline (or another pool size); its
    new pool must be all free."""
    assert check_leaks({}, {"decode-0": IDLE_VLLM}).clean
    assert check_leaks({}, {"decode-0": Gauges(0, 0, 180, 170)}).leaked_blocks == {"decode-0": 10}
    smaller = {"decode-0": Gauges(0, 0, 90, 90)}
    assert check_leaks({"decode-0": IDLE_VLLM}, smaller).clean


def test_kv_in_use_or_active_sequences_after_the_quiet_period_fail_the_verdict() -> None:
    """The reference engine has no block pool: its exact KV gauge and active count decide."""
    final = {"decode-0": Gauges(active=1, kv_used_bytes=4096), "decode-1": IDLE_REF}
    report = check_leaks({"decode-0": IDLE_REF, "decode-1": IDLE_REF}, final)
    assert report.kv_in_use == {"decode-0": 4096}
    assert report.active == {"decode-0": 1}
    assert report.leaked_blocks == {}
    assert sorted(_clean_run(report).violations(sc.INVARIANTS)) == [
        "active_after_quiet=1",
        "kv_in_use_bytes=4096",
    ]


def test_a_run_without_a_leak_check_reports_none() -> None:
    out = _clean_run(None).to_json()
    assert (out["leak_checks"], out["leaked_blocks"], out["leak_settle_max_s"]) == (0, 0, None)
