"""health: pools' readiness → mode, conditions and counts."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.operator.health import (
    MODES,
    Workload,
    assess,
    certificate_ready,
    invalid_spec,
    workload_from,
)
from tests.operator.conftest import MANIFESTS, load_yaml_documents

UP, DOWN = Workload(desired=2, ready=2), Workload(desired=2, ready=0)
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _status(
    *,
    orchestrator: Workload = UP,
    prefill: Workload = UP,
    decode: Workload = UP,
    redis: Workload | None = UP,
    fallback: str = "local",
    previous: list[dict[str, Any]] | None = None,
    now: str = T0,
    foreign: tuple[str, ...] = (),
    failed: dict[str, str] | None = None,
    certificates: dict[str, bool] | None = None,
) -> dict[str, Any]:
    return assess(
        orchestrator=orchestrator,
        prefill=prefill,
        decode=decode,
        redis=redis,
        fallback=fallback,
        generation=7,
        previous=previous or [],
        now=now,
        foreign=foreign,
        failed=failed,
        certificates=certificates,
    )


def _conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    ("kwargs", "mode", "ready", "degraded"),
    [
        ({}, "disaggregated", "True", ("False", "AllComponentsReady")),
        ({"prefill": DOWN}, "aggregated-fallback", "True", ("True", "PrefillPoolUnavailable")),
        ({"decode": DOWN}, "aggregated-fallback", "True", ("True", "DecodePoolUnavailable")),
        (
            {"decode": DOWN, "fallback": "fail"},
            "unavailable",
            "False",
            ("True", "DecodePoolUnavailable"),
        ),
        ({"prefill": DOWN, "decode": DOWN}, "unavailable", "False", ("True", "NoWorkers")),
        ({"orchestrator": DOWN}, "disaggregated", "False", ("True", "OrchestratorUnavailable")),
        ({"redis": DOWN}, "disaggregated", "False", ("True", "RedisUnavailable")),
        ({"redis": None}, "disaggregated", "True", ("False", "AllComponentsReady")),
        (
            {"decode": Workload(desired=3, exists=False)},
            "aggregated-fallback",
            "True",
            ("True", "DecodePoolUnavailable"),
        ),
        (
            {"foreign": ("ConfigMap/llama-config",)},
            "disaggregated",
            "True",
            ("True", "ForeignObjects"),
        ),
    ],
    ids=[
        "all-up",
        "prefill-down",
        "decode-down",
        "decode-down-fail-policy",
        "both-pools-down",
        "orchestrators-down",
        "dev-redis-down",
        "external-redis",
        "decode-not-created",
        "foreign-object",
    ],
)
def test_mode_and_conditions(
    kwargs: dict[str, Any], mode: str, ready: str, degraded: tuple[str, str]
) -> None:
    status = _status(**kwargs)
    assert status["mode"] == mode
    conditions = _conditions(status)
    assert conditions["Ready"][0] == ready
    assert conditions["Degraded"] == degraded
    assert status["observedGeneration"] == 7
    assert all(c["observedGeneration"] == 7 for c in status["conditions"])


def test_pool_conditions_and_counts() -> None:
    status = _status(prefill=Workload(desired=3, ready=1), decode=DOWN)
    assert status["prefill"] == {"replicas": 3, "readyReplicas": 1}
    assert status["decode"] == {"replicas": 2, "readyReplicas": 0}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["PrefillPoolReady"]["status"] == "True"
    assert conditions["PrefillPoolReady"]["reason"] == "SomePodsReady"
    assert conditions["PrefillPoolReady"]["message"] == "1/3 pods ready"
    assert conditions["DecodePoolReady"]["status"] == "False"
    assert conditions["DecodePoolReady"]["reason"] == "NoReadyPods"


def test_transition_time_changes_only_with_the_status() -> None:
    first = _status(now=T0)
    same = _status(previous=first["conditions"], now=T1)
    assert {c["lastTransitionTime"] for c in same["conditions"]} == {T0}
    degraded = _status(decode=DOWN, previous=same["conditions"], now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}
    assert times == {
        "Ready": T0,
        "PrefillPoolReady": T0,
        "DecodePoolReady": T1,
        "Degraded": T1,
        "Progressing": T0,
        "Reconciled": T0,
    }


def test_conditions_of_other_types_are_kept() -> None:
    other = {"type": "Available", "status": "True", "reason": "X", "lastTransitionTime": T0}
    status = _status(previous=[other])
    assert other in status["conditions"]


def test_workload_from_the_api() -> None:
    assert workload_from(None, 2) == Workload(desired=2, ready=0, exists=False)
    assert workload_from({"status": {}}, 2) == Workload(desired=2, ready=0)
    assert workload_from({"status": {"readyReplicas": 2}}, 3) == Workload(desired=3, ready=2)


def test_invalid_spec_status() -> None:
    status = invalid_spec("spec.redis: set exactly one of urlSecret and dev", 3, [], T0)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Degraded"]["reason"] == "InvalidSpec"
    assert "spec.redis" in conditions["Degraded"]["message"]
    assert status["observedGeneration"] == 3


def test_certificates_not_ready_degrade_and_show_which() -> None:
    status = _status(certificates={"llama-orchestrator": True, "llama-decode": False})
    conditions = _conditions(status)
    assert conditions["CertificatesReady"] == ("False", "NotIssued")
    assert conditions["Degraded"] == ("True", "CertificatesNotReady")
    (cert,) = [c for c in status["conditions"] if c["type"] == "CertificatesReady"]
    assert cert["message"] == "not ready: llama-decode"
    issued = _status(
        certificates={"llama-orchestrator": True, "llama-decode": True},
        previous=status["conditions"],
        now=T1,
    )
    assert _conditions(issued)["CertificatesReady"] == ("True", "Issued")
    assert _conditions(issued)["Degraded"] == ("False", "AllComponentsReady")
    # TLS switched off: the condition goes rather than lingering.
    plain = _status(previous=issued["conditions"], now=T1)
    assert "CertificatesReady" not in _conditions(plain)


def test_certificate_ready_reads_cert_managers_ready_condition() -> None:
    assert not certificate_ready(None)
    assert not certificate_ready({"status": {}})
    assert not certificate_ready(
        {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Pending"}]}}
    )
    assert certificate_ready(
        {
            "status": {
                "conditions": [
                    {"type": "Issuing", "status": "True"},
                    {"type": "Ready", "status": "True"},
                ]
            }
        }
    )


def _deployment(generation: int, **status: Any) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "status": status}


def test_workload_from_reads_the_rollout() -> None:
    # The API omits zero counts once the controller has written a status.
    fresh = workload_from(_deployment(2, observedGeneration=2, readyReplicas=1), 2)
    assert (fresh.updated, fresh.current, fresh.rolling) == (0, 0, True)
    behind = workload_from(_deployment(3, observedGeneration=2, updatedReplicas=2), 2)
    assert (behind.observed, behind.rolling) == (False, True)
    done = workload_from(
        _deployment(2, observedGeneration=2, replicas=2, updatedReplicas=2, readyReplicas=2), 2
    )
    assert (done.rolling, done.stalled) == (False, None)
    old_pods_left = workload_from(
        _deployment(2, observedGeneration=2, replicas=3, updatedReplicas=2, readyReplicas=2), 2
    )
    assert old_pods_left.rolling
    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    stalled = workload_from(
        _deployment(2, observedGeneration=2, updatedReplicas=1, conditions=[stuck]), 2
    )
    assert (stalled.stalled, stalled.rolling) == ("ProgressDeadlineExceeded", False)
    # A stuck condition from before the latest spec says nothing about its rollout.
    stale = workload_from(_deployment(3, observedGeneration=2, conditions=[stuck]), 2)
    assert (stale.stalled, stale.rolling) == (None, True)


ROLLING = Workload(desired=2, ready=2, updated=1, current=3)
STUCK = Workload(desired=2, ready=1, updated=1, current=2, stalled="ProgressDeadlineExceeded")


def test_a_stuck_rollout_is_neither_ready_nor_all_components_ready() -> None:
    """New pods that never become ready (an image typo): the old pods serve, but the spec
    is not what runs."""
    status = _status(prefill=STUCK)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["mode"] == "disaggregated"
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False",
        "RolloutStuck",
    )
    assert "serving disaggregated" in conditions["Ready"]["message"]
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "RolloutStuck",
    )
    assert (conditions["Progressing"]["status"], conditions["Progressing"]["reason"]) == (
        "False",
        "ProgressDeadlineExceeded",
    )
    assert "prefill" in conditions["Progressing"]["message"]


def test_a_rollout_under_way_is_progressing_not_all_components_ready() -> None:
    conditions = _conditions(_status(decode=ROLLING))
    assert conditions["Progressing"] == ("True", "RollingUpdate")
    assert conditions["Degraded"] == ("False", "RollingUpdate")
    assert conditions["Ready"] == ("True", "Disaggregated")  # it serves meanwhile
    assert _conditions(_status())["Progressing"] == ("False", "RolloutComplete")


def test_refused_objects_are_not_reconciled_and_not_ready() -> None:
    failed = {"Deployment/llama-decode": "422 Invalid: spec.template: bad"}
    status = _status(failed=failed)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Reconciled"]["status"], conditions["Reconciled"]["reason"]) == (
        "False",
        "ApplyFailed",
    )
    assert "422 Invalid: spec.template: bad" in conditions["Reconciled"]["message"]
    assert _conditions(status)["Ready"] == ("False", "ApplyFailed")
    assert _conditions(status)["Degraded"] == ("True", "ApplyFailed")
    assert _conditions(_status())["Reconciled"] == ("True", "Applied")


ZERO = Workload(desired=0)  # a pool the spec scales to 0 replicas


@pytest.mark.parametrize(
    ("kwargs", "mode", "ready", "degraded"),
    [
        ({"prefill": ZERO}, "aggregated", ("True", "Aggregated"), ("False", "ScaledToZero")),
        ({"decode": ZERO}, "aggregated", ("True", "Aggregated"), ("False", "ScaledToZero")),
        (
            {"prefill": ZERO, "fallback": "fail"},
            "unavailable",
            ("False", "ScaledToZero"),
            ("False", "ScaledToZero"),
        ),
        (
            {"prefill": ZERO, "decode": ZERO},
            "unavailable",
            ("False", "ScaledToZero"),
            ("False", "ScaledToZero"),
        ),
        # A pool at 0 hides no fault of the other one.
        (
            {"prefill": ZERO, "decode": DOWN},
            "unavailable",
            ("False", "DecodePoolUnavailable"),
            ("True", "DecodePoolUnavailable"),
        ),
        (
            {"prefill": ZERO, "decode": ROLLING},
            "aggregated",
            ("True", "Aggregated"),
            ("False", "RollingUpdate"),
        ),
    ],
    ids=[
        "prefill-0",
        "decode-0",
        "prefill-0-fail-policy",
        "both-0",
        "prefill-0-decode-down",
        "prefill-0-decode-rolling",
    ],
)
def test_a_pool_scaled_to_zero_by_the_spec_is_not_degraded(
    kwargs: dict[str, Any], mode: str, ready: tuple[str, str], degraded: tuple[str, str]
) -> None:
    status = _status(**kwargs)
    conditions = _conditions(status)
    assert status["mode"] == mode
    assert conditions["Ready"] == ready
    assert conditions["Degraded"] == degraded


def test_a_pool_scaled_to_zero_says_so() -> None:
    status = _status(prefill=ZERO)
    messages = {c["type"]: c["message"] for c in status["conditions"]}
    assert _conditions(status)["PrefillPoolReady"] == ("False", "ScaledToZero")
    assert messages["PrefillPoolReady"] == "scaled to 0 by the spec"
    assert messages["Degraded"] == "prefill scaled to 0 by the spec; mode aggregated"
    assert messages["Ready"] == "serving aggregated (prefill scaled to 0 by the spec)"
    assert status["prefill"] == {"replicas": 0, "readyReplicas": 0}
    failing = _status(prefill=ZERO, fallback="fail")
    (ready,) = [c for c in failing["conditions"] if c["type"] == "Ready"]
    assert ready["message"] == (
        "not serving: prefill scaled to 0 by the spec and failover.fallback is fail"
    )
    # Scaling back up: its pods not ready yet is a fault again, as before.
    assert _conditions(_status(prefill=DOWN))["Degraded"] == ("True", "PrefillPoolUnavailable")


def test_every_mode_is_in_the_crds_status_enum() -> None:
    (crd,) = load_yaml_documents(MANIFESTS / "crd" / "disaggregatedservices.pdorch.io.yaml")
    (version,) = crd["spec"]["versions"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["mode"]["enum"] == list(MODES)
