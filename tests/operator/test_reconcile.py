"""reconcile against an in-memory API that refuses what the real one would: one refused
object does not stop the pass, the NetworkPolicies go first, and the status says why."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

import pytest

from orchestrator.operator.errors import KubeApiError, KubeUnreachableError
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.naming import Ref
from orchestrator.operator.reconcile import FAILED, reconcile
from tests.operator.conftest import IDENTITY, MINIMAL_SPEC

NOW = "2026-01-01T00:00:00Z"


class RefusingApi:
    """Stores objects; refuses to create `refused` with `status` (422: invalid, as the API
    server does with a value its validation rejects; 0: no answer at all)."""

    def __init__(self, refused: str = "Deployment/llama-decode", status: int = 422) -> None:
        self.objects: dict[Ref, dict[str, Any]] = {}
        self.created: list[str] = []
        self.refused = refused
        self.status = status

    async def get(self, ref: Ref) -> dict[str, Any] | None:
        return self.objects.get(ref)

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        if str(Ref.of(obj)) == self.refused:
            if self.status == 0:
                raise KubeUnreachableError("connection refused")
            raise KubeApiError(self.status, "Invalid", "spec.template.spec.nodeSelector: bad")
        self.objects[Ref.of(obj)] = dict(obj)
        self.created.append(str(Ref.of(obj)))
        return dict(obj)

    async def patch(self, ref: Ref, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.objects[ref]

    async def delete(self, ref: Ref) -> bool:
        return self.objects.pop(ref, None) is not None


def _reconcile(api: RefusingApi, raw: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    client = cast(KubeClient, api)
    return asyncio.run(reconcile(client, IDENTITY, raw, [], NOW))


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_refused_object_does_not_stop_the_pass_and_the_status_says_why() -> None:
    api = RefusingApi()
    status, outcome = _reconcile(api, MINIMAL_SPEC)
    # Everything else was applied, NetworkPolicies (guarding the dev Redis) first.
    assert api.created[:3] == [
        "NetworkPolicy/llama-orchestrator",
        "NetworkPolicy/llama-workers",
        "NetworkPolicy/llama-redis",
    ]
    assert "StatefulSet/llama-redis" in api.created
    assert "PodDisruptionBudget/llama-decode" in api.created  # after the refused Deployment
    assert "Deployment/llama-decode" not in api.created
    assert outcome.actions["Deployment/llama-decode"] == FAILED
    assert not outcome.retry_soon  # a 422 needs a fixed spec, not a retry
    conditions = _conditions(status)
    assert (conditions["Reconciled"]["status"], conditions["Reconciled"]["reason"]) == (
        "False",
        "ApplyFailed",
    )
    assert "Deployment/llama-decode" in conditions["Reconciled"]["message"]
    assert "nodeSelector" in conditions["Reconciled"]["message"]  # the API's own words
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False",
        "ApplyFailed",
    )
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ApplyFailed",
    )


def test_a_transient_refusal_asks_for_a_retry() -> None:
    status, outcome = _reconcile(RefusingApi(status=503), MINIMAL_SPEC)
    assert outcome.retry_soon
    assert _conditions(status)["Reconciled"]["reason"] == "ApplyFailed"


def test_a_clean_pass_is_reconciled() -> None:
    status, outcome = _reconcile(RefusingApi(refused=""), MINIMAL_SPEC)
    assert outcome.failures == {}
    reconciled = _conditions(status)["Reconciled"]
    assert (reconciled["status"], reconciled["reason"]) == ("True", "Applied")


def test_an_unreachable_api_ends_the_pass() -> None:
    with pytest.raises(KubeUnreachableError):
        _reconcile(RefusingApi(status=0), MINIMAL_SPEC)
