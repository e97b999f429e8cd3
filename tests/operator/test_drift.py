"""drift: what counts as a changed child, and what a patch may carry."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.operator.drift import contains, drifted, owned_by, patch_for, patchable
from tests.operator.conftest import MINIMAL_SPEC, rendered, spec_with


def _as_the_api_server_returns_it(obj: dict[str, Any]) -> dict[str, Any]:
    """What a GET gives back: our object plus defaults, server metadata and a status."""
    live = copy.deepcopy(obj)
    live["metadata"] |= {"uid": "child-uid", "resourceVersion": "123", "generation": 2}
    live["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "1"}
    spec = live["spec"]
    spec |= {"revisionHistoryLimit": 10, "progressDeadlineSeconds": 600}
    pod = spec["template"]["spec"]
    pod |= {"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "schedulerName": "default"}
    container = pod["containers"][0]
    container |= {"terminationMessagePath": "/dev/termination-log"}
    container["readinessProbe"] |= {"timeoutSeconds": 1, "successThreshold": 1}
    container["env"][0]["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    live["status"] = {"replicas": 1, "readyReplicas": 1}
    return live


@pytest.fixture
def deployment() -> dict[str, Any]:
    obj: dict[str, Any] = rendered(MINIMAL_SPEC)["Deployment", "llama-decode"]
    return obj


def test_server_defaults_and_status_are_not_drift(deployment: dict[str, Any]) -> None:
    assert not drifted(deployment, _as_the_api_server_returns_it(deployment))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["spec"].update(replicas=9),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(image="evil:latest"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].append("--extra"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"].pop(),
        lambda d: d["metadata"]["labels"].pop("app.kubernetes.io/managed-by"),
        lambda d: d["metadata"].pop("ownerReferences"),
    ],
    ids=["replicas", "image", "extra-arg", "env-removed", "label-removed", "owner-removed"],
)
def test_an_edit_of_anything_we_render_is_drift(deployment: dict[str, Any], edit: Any) -> None:
    live = _as_the_api_server_returns_it(deployment)
    edit(live)
    assert drifted(deployment, live)


def test_a_patch_carries_owned_metadata_and_spec_but_never_identity_or_immutables() -> None:
    sts = rendered(MINIMAL_SPEC)["StatefulSet", "llama-redis"]
    body = patchable(sts)
    assert set(body) == {"metadata", "spec"}
    assert set(body["metadata"]) == {"labels", "ownerReferences"}
    for immutable in ("selector", "serviceName", "volumeClaimTemplates"):
        assert immutable not in body["spec"]
    assert body["spec"]["template"] == sts["spec"]["template"]
    assert "volumeClaimTemplates" in sts["spec"]  # the rendered object is left untouched


def test_a_node_selector_key_we_stopped_rendering_is_drift_and_patched_away() -> None:
    desired = rendered(spec_with(MINIMAL_SPEC, "decode.gpu", {"product": "NVIDIA-L4"}))
    deployment = desired["Deployment", "llama-decode"]
    live = _as_the_api_server_returns_it(deployment)
    live["spec"]["template"]["spec"]["nodeSelector"]["zone"] = "a"  # from an older spec
    assert drifted(deployment, live)
    patch = patch_for(deployment, live)
    assert patch["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "zone": None,  # merge patch: remove
    }


def test_a_whole_node_selector_we_stopped_rendering_is_patched_away(
    deployment: dict[str, Any],
) -> None:
    live = _as_the_api_server_returns_it(deployment)
    live["spec"]["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "Tesla-T4"}
    assert drifted(deployment, live)
    pod_patch = patch_for(deployment, live)["spec"]["template"]["spec"]
    assert pod_patch["nodeSelector"] == {"nvidia.com/gpu.product": None}


def test_a_config_key_we_stopped_rendering_is_removed() -> None:
    config = rendered(MINIMAL_SPEC)["ConfigMap", "llama-config"]
    live = copy.deepcopy(config)
    live["data"]["UCX_TLS"] = "rc"
    assert drifted(config, live)
    assert patch_for(config, live)["data"] == {**config["data"], "UCX_TLS": None}
    assert not drifted(config, copy.deepcopy(config))


def test_a_change_only_in_an_immutable_field_is_not_drift() -> None:
    sts = rendered(MINIMAL_SPEC)["StatefulSet", "llama-redis"]
    live = copy.deepcopy(sts)
    live["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "9Gi"
    assert not drifted(sts, live)


@pytest.mark.parametrize(
    ("live", "desired", "expected"),
    [
        ({"a": 1, "b": 2}, {"a": 1}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ({"a": {"b": 1, "c": 2}}, {"a": {"b": 1}}, True),
        ({"a": [1, 2]}, {"a": [1, 2]}, True),
        ({"a": [1, 2, 3]}, {"a": [1, 2]}, False),
        ({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]}, True),
        ({"a": [{"x": 2}]}, {"a": [{"x": 1}]}, False),
        ({"a": "1"}, {"a": 1}, False),
        ({"a": None}, {"a": {}}, False),
    ],
)
def test_contains(live: Any, desired: Any, expected: bool) -> None:
    assert contains(live, desired) is expected


def test_only_objects_this_resource_controls_are_ours() -> None:
    ours = {"metadata": {"ownerReferences": [{"uid": "u1", "controller": True}]}}
    assert owned_by(ours, "u1")
    assert not owned_by(ours, "u2")
    assert not owned_by({"metadata": {"ownerReferences": [{"uid": "u1"}]}}, "u1")
    assert not owned_by({"metadata": {}}, "u1")
