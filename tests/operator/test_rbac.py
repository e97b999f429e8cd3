"""The operator's RBAC: namespaced, no wildcards, exactly what the operator needs."""

from __future__ import annotations

from typing import Any

from orchestrator.operator.render import render
from orchestrator.operator.spec import parse_spec
from tests.operator.conftest import (
    IDENTITY,
    MANIFESTS,
    MINIMAL_SPEC,
    TLS_CERT_MANAGER,
    load_yaml_documents,
    spec_with,
)

CHILD_VERBS = {"get", "create", "patch", "delete"}


def _operator_objects() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted((MANIFESTS / "operator").glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in load_yaml_documents(path)
    ]


def _grants() -> dict[tuple[str, str], set[str]]:
    (role,) = [o for o in _operator_objects() if o["kind"] == "Role"]
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def allowed(group: str, resource: str, verb: str) -> bool:
    return verb in _grants().get((group, resource), set())


def test_nothing_cluster_scoped_and_no_wildcards() -> None:
    kinds = {o["kind"] for o in _operator_objects()}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "Deployment"}
    for (group, resource), verbs in _grants().items():
        assert "*" not in group
        assert "*" not in resource
        assert "*" not in verbs


def test_the_role_binds_to_the_operator_service_account() -> None:
    objs = {o["kind"]: o for o in _operator_objects()}
    binding = objs["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": objs["Role"]["metadata"]["name"],
    }
    assert binding["subjects"][0]["name"] == objs["ServiceAccount"]["metadata"]["name"]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == objs["ServiceAccount"]["metadata"]["name"]


def test_exactly_the_permissions_the_operator_uses() -> None:
    needed: dict[tuple[str, str], set[str]] = {
        ("pdorch.io", "disaggregatedservices"): {"get", "list", "watch", "patch"},
        ("pdorch.io", "disaggregatedservices/status"): {"get", "patch"},
        ("pdorch.io", "disaggregatedservices/finalizers"): {"update"},
        ("", "events"): {"create"},
    }
    plurals = {
        "ServiceAccount": "serviceaccounts",
        "ConfigMap": "configmaps",
        "Service": "services",
        "Deployment": "deployments",
        "StatefulSet": "statefulsets",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
        "Certificate": "certificates",
    }
    specs = [MINIMAL_SPEC, spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER)]
    for raw in specs:
        for obj in render(IDENTITY, parse_spec(raw)):
            group = obj["apiVersion"].rpartition("/")[0]
            needed[group, plurals[obj["kind"]]] = CHILD_VERBS
    assert ("cert-manager.io", "certificates") in needed
    assert _grants() == needed


def test_the_operator_cannot_read_secrets() -> None:
    """Pods get Secrets (the Redis URL, TLS keys) from the kubelet; the operator never
    holds one."""
    assert not [key for key in _grants() if key[1] == "secrets"]


def _aggregated() -> dict[str, dict[str, Any]]:
    docs = load_yaml_documents(MANIFESTS / "crd" / "aggregated-clusterroles.yaml")
    return {doc["metadata"]["name"]: doc for doc in docs}


def _aggregates_to(role: dict[str, Any]) -> set[str]:
    prefix = "rbac.authorization.k8s.io/aggregate-to-"
    labels = role["metadata"]["labels"]
    return {
        k.removeprefix(prefix) for k, v in labels.items() if k.startswith(prefix) and v == "true"
    }


def test_namespace_users_get_the_custom_resource_through_aggregated_roles() -> None:
    """`edit` (and `admin`) users of a namespace manage DisaggregatedServices there, `view`
    users read them: ClusterRoles that the built-in roles aggregate by label."""
    roles = _aggregated()
    assert set(roles) == {"pdorch-disaggregatedservices-edit", "pdorch-disaggregatedservices-view"}
    edit, view = (
        roles["pdorch-disaggregatedservices-edit"],
        roles["pdorch-disaggregatedservices-view"],
    )
    assert _aggregates_to(edit) == {"edit", "admin"}
    assert _aggregates_to(view) == {"view", "edit", "admin"}
    assert edit["rules"] == [
        {
            "apiGroups": ["pdorch.io"],
            "resources": ["disaggregatedservices"],  # never the status: the operator's
            "verbs": [
                "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"
            ],
        }
    ]  # fmt: skip
    (rule,) = view["rules"]
    assert rule["apiGroups"] == ["pdorch.io"]
    assert set(rule["resources"]) == {"disaggregatedservices", "disaggregatedservices/status"}
    assert set(rule["verbs"]) == {"get", "list", "watch"}


def test_the_aggregated_roles_are_installed_with_the_crd() -> None:
    (kustomization,) = load_yaml_documents(MANIFESTS / "crd" / "kustomization.yaml")
    assert "aggregated-clusterroles.yaml" in kustomization["resources"]
