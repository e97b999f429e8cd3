"""manifests/chaos: Chaos Mesh experiments equivalent to the shipped chaos scenarios.

No Chaos Mesh here (nor its CRD schemas in kubernetes-validate), so these check structure
against Chaos Mesh's documented fields, and — what matters most — that every selector picks
pods the operator actually renders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.chaos.scenario import shipped
from orchestrator.operator.naming import Identity
from orchestrator.operator.render import render
from orchestrator.operator.spec import parse_spec

CHAOS = Path(__file__).resolve().parents[2] / "manifests" / "chaos"
FILES = sorted(CHAOS.glob("*.yaml"))
POD_ACTIONS = {"pod-kill", "pod-failure", "container-kill"}
NET_ACTIONS = {"delay": "delay", "corrupt": "corrupt", "bandwidth": "bandwidth",
               "partition": None, "loss": "loss"}  # fmt: skip
MODES = {"one", "all", "fixed", "fixed-percent", "random-max-percent"}
DURATION = re.compile(r"^\d+(ms|s|m|h)$")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _experiments(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, spec) of the experiment, unwrapping a Schedule."""
    if doc["kind"] == "Schedule":
        spec = doc["spec"]
        assert spec["concurrencyPolicy"] in {"Forbid", "Allow"}
        assert spec["schedule"].startswith("@every ")
        kind = spec["type"]
        return kind, spec[kind[0].lower() + kind[1:]]
    return doc["kind"], doc["spec"]


def _pod_labels() -> list[dict[str, str]]:
    identity = Identity(name="smollm2-h100-l4", namespace="pdorch-dev", uid="u")
    spec = parse_spec({"image": "pdorch:test", "redis": {"dev": {}}})
    return [
        o["spec"]["template"]["metadata"]["labels"]
        for o in render(identity, spec)
        if o["kind"] in {"Deployment", "StatefulSet"}
    ]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("labelSelectors", {}).items()):
        return False
    for expr in selector.get("expressionSelectors", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


NO_EQUIVALENT = {"redis-cluster-primary-kill"}
"""Scenarios with no experiment here: the operator renders no Redis Cluster (a cluster is
the user's, named by ``spec.redis.url``), so no selector could name its primaries
(manifests/chaos/README.md says what to do instead)."""


def test_every_shipped_scenario_has_a_chaos_mesh_equivalent() -> None:
    assert {p.stem for p in FILES} == set(shipped()) - NO_EQUIVALENT
    readme = (CHAOS / "README.md").read_text()
    assert all(name in readme for name in NO_EQUIVALENT)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_experiment_is_well_formed_and_selects_rendered_pods(path: Path) -> None:
    pods = _pod_labels()
    docs = _docs(path)
    assert docs
    for doc in docs:
        assert doc["apiVersion"] == "chaos-mesh.org/v1alpha1"
        assert doc["metadata"]["name"].startswith("pdorch-")
        assert doc["metadata"]["namespace"] == "pdorch-dev"
        kind, spec = _experiments(doc)
        assert spec["mode"] in MODES
        if "duration" in spec:
            assert DURATION.match(spec["duration"])
        if kind == "PodChaos":
            assert spec["action"] in POD_ACTIONS
            if spec["action"] == "pod-failure":
                assert "duration" in spec  # otherwise the pods stay failed
        else:
            assert kind == "NetworkChaos"
            assert spec["action"] in NET_ACTIONS
            block = NET_ACTIONS[spec["action"]]
            if block is not None:
                assert isinstance(spec[block], dict)
            assert spec["direction"] in {"to", "from", "both"}
            assert DURATION.match(spec["duration"])  # network faults must end by themselves
        for selector in [spec["selector"], spec.get("target", {}).get("selector")]:
            if selector is None:
                continue
            assert selector["namespaces"] == ["pdorch-dev"]
            assert any(_selects(selector, labels) for labels in pods), (path.name, selector)
