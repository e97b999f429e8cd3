"""Shared inputs of the operator tests: specs, the sample manifests, a rendering helper."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.operator.naming import Identity
from orchestrator.operator.render import render
from orchestrator.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
# The Kubernetes version every object is validated against (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32"

IDENTITY = Identity(name="llama", namespace="ml", uid="0d9c1a3e-uid", generation=4)

MINIMAL_SPEC: dict[str, Any] = {"image": "pdorch:test", "redis": {"dev": {}}}

# Every field of the CRD set (to something other than its default where it has one).
FULL_SPEC: dict[str, Any] = {
    "image": "registry.example.com/pdorch:1.2.3",
    "imagePullPolicy": "Always",
    "logLevel": "DEBUG",
    "terminationGracePeriodSeconds": 45,
    "model": {"name": "tiny", "cache": {"persistentVolumeClaim": "models"}},
    "orchestrator": {
        "replicas": 3,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    },
    "prefill": {
        "replicas": 2,
        "gpu": {"product": "NVIDIA-H100-80GB-HBM3", "count": 2},
        "resources": {"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
        "image": "registry.example.com/pdorch-prefill:1.2.3",
        "nodeSelector": {"topology.kubernetes.io/zone": "zone-a"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
        ],
        "torchThreads": 4,
        "engine": "reference",  # vllm needs model smollm2 (test_spec)
    },
    "decode": {
        "replicas": 5,
        "gpu": {"product": "NVIDIA-L4", "count": 1},
        "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "24Gi"}},
        "image": "registry.example.com/pdorch-decode:1.2.3",
        "nodeSelector": {"topology.kubernetes.io/zone": "zone-b"},
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "torchThreads": 2,
        "engine": "reference",
        "kvCapacityMiB": 16384,
    },
    "redis": {"urlSecret": {"name": "redis-credentials", "key": "uri"}},
    "transport": {
        "kind": "ucx",
        "ucx": {"transports": ["rc", "cuda_copy"], "devices": ["mlx5_0:1"]},
    },
    "failover": {"fallback": "fail", "heartbeatTTLSeconds": 1.5, "kvHoldSeconds": 12},
    "slo": {"ttftMs": 400, "tpotMs": 40},
    "auth": {"tokensSecret": {"name": "pdorch-tokens", "key": "tokens.json"}},
    "tls": {
        "mode": "cert-manager",
        "issuerRef": {"name": "pdorch-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
        "duration": "720h",
        "renewBefore": "240h",
        "ca": {"configMap": "pdorch-ca-bundle", "key": "bundle.pem"},
    },
}

# tls is one of three modes: the fields FULL_SPEC's cert-manager mode leaves out.
TLS_SECRETS: dict[str, Any] = {
    "mode": "secrets",
    "secrets": {"orchestrator": "orch-keys", "prefill": "prefill-keys", "decode": "decode-keys"},
    "ca": {"secret": "pdorch-ca", "key": "ca.crt"},
}
TLS_CERT_MANAGER: dict[str, Any] = {"mode": "cert-manager", "issuerRef": {"name": "pdorch-ca"}}


def spec_with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `base` with the dotted `path` set to `value` (deleted if value is ...)."""
    out = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        node.pop(last, None)
    else:
        node[last] = value
    return out


def rendered(raw_spec: dict[str, Any], identity: Identity = IDENTITY) -> dict[tuple[str, str], Any]:
    """render() as a map (kind, name) → object."""
    return {(o["kind"], o["metadata"]["name"]): o for o in render(identity, parse_spec(raw_spec))}


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def sample_specs() -> list[Any]:
    """Every DisaggregatedService shipped under manifests/, as pytest params."""
    out = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        if "chaos" in path.relative_to(MANIFESTS).parts:
            continue
        for doc in load_yaml_documents(path):
            if doc.get("kind") == "DisaggregatedService":
                out.append(pytest.param(doc, id=str(path.relative_to(MANIFESTS))))
    return out
