"""Every manifest and every rendered object validates against the real Kubernetes OpenAPI
schemas (kubernetes-validate, Kubernetes pinned in conftest); DisaggregatedServices validate
against our CRD's schema and parse; the kustomize overlays build and validate too."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate_utils

from orchestrator.cli import build_parser
from orchestrator.operator.errors import SpecError
from orchestrator.operator.naming import CHILD_SUFFIXES, MAX_NAME_LENGTH, Identity
from orchestrator.operator.render import render
from orchestrator.operator.spec import parse_spec
from tests.operator.certmanager import validate_certificate
from tests.operator.conftest import (
    FULL_SPEC,
    IDENTITY,
    KUBERNETES_VERSION,
    MANIFESTS,
    MINIMAL_SPEC,
    TLS_CERT_MANAGER,
    TLS_SECRETS,
    load_yaml_documents,
    sample_specs,
    spec_with,
)

FULL_DEV_REDIS = {
    "dev": {
        "image": "redis:7.2",
        "storage": "3Gi",
        "appendFsync": "always",
        "resources": {"requests": {"cpu": "200m"}, "limits": {"memory": "1Gi"}},
    }
}
CRD_PATH = MANIFESTS / "crd" / "disaggregatedservices.pdorch.io.yaml"
OVERLAYS = sorted(p.parent for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))


def _crd_schema() -> dict[str, Any]:
    (crd,) = load_yaml_documents(CRD_PATH)
    (version,) = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def validate_builtin(obj: dict[str, Any]) -> None:
    """Strict: unknown fields are errors too."""
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def validate_rendered(obj: dict[str, Any]) -> None:
    """A child the operator renders: a built-in kind, or cert-manager's Certificate."""
    if obj["apiVersion"] == "cert-manager.io/v1":
        validate_certificate(obj)
    else:
        validate_builtin(obj)


def validate_custom(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(_crd_schema()).validate(obj)
    meta = obj["metadata"]
    identity = Identity(meta["name"], meta.get("namespace", "default"), "uid")
    for child in render(identity, parse_spec(obj["spec"])):
        validate_rendered(child)


def validate_any(obj: dict[str, Any]) -> None:
    if obj["kind"] == "DisaggregatedService":
        validate_custom(obj)
    else:
        validate_builtin(obj)


def _manifest_files() -> list[Any]:
    out = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        rel = path.relative_to(MANIFESTS)
        if rel.parts[0] == "chaos" or path.name == "kustomization.yaml":
            continue  # chaos/: another issue's; kustomizations: built below
        out.append(pytest.param(path, id=str(rel)))
    return out


def test_the_pinned_kubernetes_version_has_schemas() -> None:
    assert KUBERNETES_VERSION in {
        v.rsplit(".", 1)[0] for v in kubernetes_validate_utils.all_versions()
    }


@pytest.mark.parametrize("path", _manifest_files())
def test_manifest_validates(path: Path) -> None:
    docs = load_yaml_documents(path)
    assert docs, f"{path} has no objects"
    for doc in docs:
        validate_any(doc)


@pytest.mark.parametrize(
    "raw",
    [
        MINIMAL_SPEC,
        FULL_SPEC,
        spec_with(MINIMAL_SPEC, "transport", {"kind": "tcp"}),
        spec_with(FULL_SPEC, "redis", {"dev": {"storage": 10737418240}}),
        spec_with(FULL_SPEC, "tls", TLS_SECRETS),
        spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER),
    ],
    ids=["minimal", "full", "tcp", "dev-redis-integer-storage", "tls-secrets", "cert-manager"],
)
def test_rendered_objects_validate(raw: dict[str, Any]) -> None:
    objects = render(IDENTITY, parse_spec(raw))
    for obj in objects:
        validate_rendered(obj)


def test_an_invalid_certificate_is_caught() -> None:
    """The hand-written Certificate schema bites: a misspelled field, a usage cert-manager
    does not know."""
    (cert, *_) = [o for o in render(IDENTITY, parse_spec(FULL_SPEC)) if o["kind"] == "Certificate"]
    for path, value in [("spec.dnsName", ["x"]), ("spec.usages", ["mtls"])]:
        with pytest.raises(jsonschema.ValidationError):
            validate_certificate(spec_with(cert, path, value))


def test_an_invalid_object_is_caught() -> None:
    """The check itself bites: a misspelled field fails strict validation."""
    deployment = copy.deepcopy(
        next(o for o in render(IDENTITY, parse_spec(MINIMAL_SPEC)) if o["kind"] == "Deployment")
    )
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(deployment)


@pytest.mark.parametrize("sample", sample_specs())
def test_samples_validate_against_the_crd_and_parse(sample: dict[str, Any]) -> None:
    validate_custom(sample)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.prefill.replicas", -1),
        ("spec.transport.kind", "rdma"),
        ("spec.failover.fallback", "retry"),
        ("spec.image", ...),
        ("spec.tls.mode", "mtls"),
        ("spec.tls.issuerRef.kind", "Vault"),
        ("spec.tls.issuerRef", {"kind": "Issuer"}),
        ("spec.tls.duration", "90d"),
    ],
)
def test_crd_schema_rejects_what_the_parser_rejects(path: str, value: Any) -> None:
    obj = spec_with({"spec": FULL_SPEC}, path, value)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_crd_schema()).validate(obj)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("prefill.replicas", 2**31),  # a Deployment's replicas is an int32
        ("orchestrator.replicas", 2**31),
        ("terminationGracePeriodSeconds", 10**9),  # would hold a node drain for decades
        ("orchestrator.resources", {"requests": {"cpu": "lots"}}),
        ("decode.resources", {"limits": {"memory": "-1Gi"}}),
        ("decode.resources", {"limits": {"memory": -1}}),
        ("redis", {"dev": {"storage": "1 GB"}}),
        ("decode.nodeSelector", {"zone": "not a label value"}),
        ("decode.nodeSelector", {"zone": "x" * 64}),
        ("decode.gpu", {"product": "NVIDIA H100 80GB"}),  # label values have no spaces
        ("redis", {"urlSecret": {"name": "Bad_Name"}}),
        ("redis", {"urlSecret": {"name": "redis", "key": "a/b"}}),
        ("model.cache", {"persistentVolumeClaim": "Bad Name"}),
        ("auth", {"tokensSecret": {"name": "tokens!"}}),
        ("tls", {**TLS_SECRETS, "secrets": {"decode": "Decode-Keys"}}),
        ("tls", {**TLS_SECRETS, "ca": {"configMap": "ca bundle"}}),
        ("tls", {"mode": "cert-manager", "issuerRef": {"name": "CA"}}),
    ],
)
def test_crd_and_parser_both_reject_what_kubernetes_rejects(path: str, value: Any) -> None:
    """A value the CRD let through and the API server refuses fails its object at every
    pass; the CRD refuses it at `kubectl apply`, and the parser (for input that skipped
    the CRD) says which field."""
    raw = spec_with(MINIMAL_SPEC, path, value)
    with pytest.raises(SpecError):
        parse_spec(raw)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_crd_schema()).validate({"spec": raw})


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("prefill.replicas", 2**31 - 1),
        ("terminationGracePeriodSeconds", 3600),
        ("orchestrator.resources", {"requests": {"cpu": "1.5", "memory": "1e9"}}),
        ("decode.resources", {"limits": {"memory": 0, "cpu": ".5"}}),
        ("decode.nodeSelector", {"example.com/zone": "eu-west-1a", "tier": "A_1.b"}),
        ("model.cache", {"persistentVolumeClaim": "models.v2"}),
        ("redis", {"urlSecret": {"name": "redis", "key": "REDIS_URL.txt"}}),
    ],
)
def test_crd_and_parser_both_accept_what_kubernetes_accepts(path: str, value: Any) -> None:
    raw = spec_with(MINIMAL_SPEC, path, value)
    parse_spec(raw)
    jsonschema.Draft7Validator(_crd_schema()).validate({"spec": raw})
    for child in render(IDENTITY, parse_spec(raw)):
        validate_rendered(child)


@pytest.mark.parametrize(
    "toleration",
    [
        {"key": "k", "operator": "Exists", "value": "v", "effect": "NoSchedule"},
        {"operator": "Equal", "value": "v"},  # an empty key needs Exists
        {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5},
    ],
)
def test_parser_rejects_tolerations_kubernetes_rejects(toleration: dict[str, Any]) -> None:
    """Checked by the parser only (a CEL rule per item of an unbounded list risks the API
    server's cost budget): the status says InvalidSpec, naming the toleration."""
    with pytest.raises(SpecError, match=r"tolerations\[0\]"):
        parse_spec(spec_with(MINIMAL_SPEC, "decode.tolerations", [toleration]))


def test_crd_caps_the_name_where_identity_does() -> None:
    """The CRD's rule on metadata.name and the operator's own check agree."""
    (crd,) = load_yaml_documents(CRD_PATH)
    (version,) = crd["spec"]["versions"]
    rules = [v["rule"] for v in version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]]
    assert f"self.metadata.name.size() <= {MAX_NAME_LENGTH}" in rules
    Identity("a" * MAX_NAME_LENGTH, "ml", "uid")
    with pytest.raises(SpecError):
        Identity("a" * (MAX_NAME_LENGTH + 1), "ml", "uid")


def test_crd_refuses_the_names_identity_refuses() -> None:
    """The CRD's rule on the name's suffix names exactly `CHILD_SUFFIXES` (CEL is not
    evaluated here; the rule is checked for its text, the parser for its behaviour)."""
    (crd,) = load_yaml_documents(CRD_PATH)
    (version,) = crd["spec"]["versions"]
    rules = [v["rule"] for v in version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]]
    expected = " && ".join(f"!self.metadata.name.endsWith('{s}')" for s in CHILD_SUFFIXES)
    assert expected in rules


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object with properties."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _property_paths(schema: dict[str, Any], prefix: str) -> list[str]:
    paths = []
    for name, sub in schema.get("properties", {}).items():
        paths.append(f"{prefix}.{name}")
        paths += _property_paths(sub, f"{prefix}.{name}")
    return paths


def _has(obj: Any, path: str) -> bool:
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return False
        obj = obj[key]
    return True


def test_crd_and_parser_know_the_same_fields() -> None:
    """FULL_SPEC (and its variants: redis is one of two, tls one of three modes) sets every
    field: the CRD lists no field they lack, and (closed) accepts them; parse_spec, which
    rejects unknown fields, accepts them."""
    variants = [
        FULL_SPEC,
        spec_with(FULL_SPEC, "redis", FULL_DEV_REDIS),
        spec_with(FULL_SPEC, "tls", TLS_SECRETS),
    ]
    spec_schema = _crd_schema()["properties"]["spec"]
    for path in _property_paths(spec_schema, "spec"):
        assert any(_has({"spec": v}, path) for v in variants), f"no test spec sets {path}"
    for variant in variants:
        jsonschema.Draft7Validator(_closed(spec_schema)).validate(variant)
        parse_spec(variant)


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out += _walk(schema[key], f"{path}[{key}]")
    return out


def test_crd_schema_is_structural() -> None:
    """What the API server demands of a CRD schema (and what keeps it from pruning our
    fields): a type everywhere, objects that say what they hold."""
    for path, node in _walk(_crd_schema(), "root"):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "type" in node, f"{path} has no type"
        if node["type"] == "object" and path != "root.metadata":
            assert "properties" in node or "additionalProperties" in node, path


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_kustomize_overlay_builds_and_validates(overlay: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    objects = [doc for doc in yaml.safe_load_all(built) if doc]
    kinds = {o["kind"] for o in objects}
    wanted = {"CustomResourceDefinition", "ClusterRole", "Deployment", "Role", "RoleBinding"}
    assert wanted | {"Namespace"} <= kinds  # ClusterRole: the users' aggregated roles
    for obj in objects:
        validate_any(obj)
        cluster_scoped = ("CustomResourceDefinition", "Namespace", "PriorityClass", "ClusterRole")
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"]["namespace"] == overlay_namespace(overlay)


def overlay_namespace(overlay: Path) -> str:
    return str(yaml.safe_load((overlay / "kustomization.yaml").read_text())["namespace"])


def test_operator_deployment_runs_the_real_operator_command() -> None:
    (deployment,) = load_yaml_documents(MANIFESTS / "operator" / "deployment.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "pdorch") for a in container["args"]]
    parsed = build_parser().parse_args(args)
    assert (parsed.command, parsed.namespace) == ("operator", ["pdorch"])
    assert parsed.liveness.endswith(container["livenessProbe"]["httpGet"]["path"])
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two kopf instances
    assert deployment["spec"]["replicas"] == 1
