"""health: pools' readiness → mode, conditions and counts."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.operator.health import (
    Workload,
    assess,
    certificate_ready,
    invalid_spec,
    workload_from,
)

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
    assert times == {"Ready": T0, "PrefillPoolReady": T0, "DecodePoolReady": T1, "Degraded": T1}


def test_conditions_of_other_types_are_kept() -> None:
    other = {"type": "Progressing", "status": "True", "reason": "X", "lastTransitionTime": T0}
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
