"""tls: Certificates per component identity, each pod holding only its own key, the runtime's
directory layout, probes that work over TLS, and disabled meaning what was rendered before."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from orchestrator.cli import build_parser
from orchestrator.core.auth import parse_tokens
from orchestrator.operator import naming
from orchestrator.operator.errors import SpecError
from orchestrator.operator.render import render
from orchestrator.operator.spec import CaSource, IssuerRef, Tls, parse_spec
from tests.operator.conftest import (
    FULL_SPEC,
    IDENTITY,
    MANIFESTS,
    MINIMAL_SPEC,
    TLS_CERT_MANAGER,
    TLS_SECRETS,
    load_yaml_documents,
    rendered,
    spec_with,
)

COMPONENTS = ("orchestrator", "prefill", "decode")
TLS_DIR = "/etc/pdorch/tls"


def _pod(objs: dict[tuple[str, str], Any], component: str) -> dict[str, Any]:
    pod: dict[str, Any] = objs["Deployment", f"llama-{component}"]["spec"]["template"]["spec"]
    return pod


def _tls_volume(pod: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod.get("volumes", []) if v["name"] == "tls"]
    return volume


def _secrets_in(pod: dict[str, Any]) -> dict[str, set[str]]:
    """Every Secret the pod can read → the keys it reads (None: all of them)."""
    out: dict[str, set[str]] = {}
    for volume in pod.get("volumes", []):
        sources = volume.get("projected", {}).get("sources", [])
        if "secret" in volume:  # a plain Secret volume
            sources = [{"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}}]
        for source in sources:
            if "secret" in source:
                items = source["secret"].get("items")
                keys = {i["key"] for i in items} if items else {"<all>"}
                out.setdefault(source["secret"]["name"], set()).update(keys)
    for container in pod["containers"]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                out.setdefault(ref["name"], set()).add(ref["key"])
        for source in container.get("envFrom", []):
            assert "secretRef" not in source, "a whole Secret in the environment"
    return out


# ------------------------------------------------------------------------------ spec


def test_tls_defaults_to_disabled() -> None:
    assert parse_spec(MINIMAL_SPEC).tls == Tls(mode="disabled")
    assert not parse_spec(MINIMAL_SPEC).tls.enabled


def test_cert_manager_and_secrets_modes_parse() -> None:
    assert parse_spec(FULL_SPEC).tls == Tls(
        mode="cert-manager",
        issuer=IssuerRef("pdorch-ca", "ClusterIssuer", "cert-manager.io"),
        duration="720h",
        renew_before="240h",
        ca=CaSource(key="bundle.pem", config_map="pdorch-ca-bundle"),
    )
    minimal = parse_spec(spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER)).tls
    assert minimal.issuer == IssuerRef("pdorch-ca", "Issuer", "cert-manager.io")
    assert parse_spec(spec_with(MINIMAL_SPEC, "tls", TLS_SECRETS)).tls == Tls(
        mode="secrets",
        secrets={"orchestrator": "orch-keys", "prefill": "prefill-keys", "decode": "decode-keys"},
        ca=CaSource(key="ca.crt", secret="pdorch-ca"),
    )


@pytest.mark.parametrize(
    ("tls", "field"),
    [
        ({"mode": "mtls"}, "spec.tls.mode"),
        ({"mode": "cert-manager"}, "spec.tls.issuerRef"),
        ({"mode": "cert-manager", "issuerRef": {}}, "spec.tls.issuerRef.name"),
        (
            {**TLS_CERT_MANAGER, "issuerRef": {"name": "ca", "kind": "Vault"}},
            "spec.tls.issuerRef.kind",
        ),
        ({**TLS_CERT_MANAGER, "issuerRef": {"name": "Bad_Name"}}, "spec.tls.issuerRef.name"),
        ({**TLS_CERT_MANAGER, "secrets": {"decode": "d"}}, "spec.tls.secrets"),
        ({**TLS_CERT_MANAGER, "duration": "90d"}, "spec.tls.duration"),
        ({**TLS_CERT_MANAGER, "renewBefore": 3600}, "spec.tls.renewBefore"),
        ({"mode": "secrets", "issuerRef": {"name": "ca"}}, "spec.tls.issuerRef"),
        ({"mode": "secrets", "duration": "1h"}, "spec.tls.duration"),
        ({"mode": "secrets", "secrets": {"gateway": "g"}}, "spec.tls.secrets.gateway"),
        ({"mode": "secrets", "secrets": {"decode": ""}}, "spec.tls.secrets.decode"),
        ({"mode": "secrets", "secrets": {"decode": "has space"}}, "spec.tls.secrets.decode"),
        ({"mode": "secrets", "ca": {}}, "spec.tls.ca"),
        ({"mode": "secrets", "ca": {"secret": "a", "configMap": "b"}}, "spec.tls.ca"),
        ({"mode": "secrets", "ca": {"secret": "a", "file": "b"}}, "spec.tls.ca.file"),
        ({"ca": {"secret": "a"}}, "spec.tls.ca"),  # disabled
        ({"secrets": {"decode": "d"}}, "spec.tls.secrets"),  # disabled
        ({"mode": "secrets", "clientCA": "x"}, "spec.tls.clientCA"),
    ],
)
def test_invalid_tls_is_named(tls: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(MINIMAL_SPEC, "tls", tls))
    assert info.value.field == field


# ---------------------------------------------------------------------------- render


@pytest.mark.parametrize("base", [MINIMAL_SPEC, spec_with(FULL_SPEC, "tls", ...)])
def test_disabled_renders_what_was_rendered_before_tls(base: dict[str, Any]) -> None:
    """``mode: disabled`` and no tls section render the same objects, with nothing of TLS."""
    implicit = render(IDENTITY, parse_spec(base))
    explicit = render(IDENTITY, parse_spec(spec_with(base, "tls", {"mode": "disabled"})))
    assert json.dumps(implicit, sort_keys=True) == json.dumps(explicit, sort_keys=True)
    text = json.dumps(implicit)
    assert "Certificate" not in text
    assert TLS_DIR not in text
    assert "PDORCH_TLS_DIR" not in text
    for component in COMPONENTS:
        container = _pod(rendered(base), component)["containers"][0]
        assert "grpc" in container["readinessProbe"]


def test_cert_manager_renders_one_certificate_per_identity() -> None:
    objs = rendered(FULL_SPEC)
    certs = {name: obj for (kind, name), obj in objs.items() if kind == "Certificate"}
    assert set(certs) == {f"llama-{c}" for c in COMPONENTS}
    services = {"orchestrator": "llama", "prefill": "llama-prefill", "decode": "llama-decode"}
    for component in COMPONENTS:
        cert = certs[f"llama-{component}"]
        assert cert["apiVersion"] == "cert-manager.io/v1"
        assert cert["metadata"]["labels"][naming.LABEL_COMPONENT] == component
        spec = cert["spec"]
        assert spec["commonName"] == f"pdorch-{component}"  # the identity the runtime checks
        assert spec["secretName"] == f"llama-{component}-tls"
        service = services[component]
        # First what pdorch's own clients check (a worker, dialled by pod IP, must be a
        # worker: orchestrator.core.peers), then the Service's names.
        server_names = (
            ["pdorch-orchestrator"]
            if component == "orchestrator"
            else [
                f"pdorch-{component}",
                "pdorch-worker",
            ]
        )
        assert spec["dnsNames"] == [
            *server_names,
            service,
            f"{service}.ml",
            f"{service}.ml.svc",
            f"{service}.ml.svc.cluster.local",
        ]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {
            "name": "pdorch-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
        assert (spec["duration"], spec["renewBefore"]) == ("720h", "240h")
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert spec["secretTemplate"]["labels"][naming.LABEL_INSTANCE] == "llama"
        # Owner references: test_render's every-child test covers Certificates too.
    # Certificates come before the Deployments whose pods mount their Secrets.
    order = [(o["kind"], o["metadata"]["name"]) for o in render(IDENTITY, parse_spec(FULL_SPEC))]
    assert max(i for i, (k, _) in enumerate(order) if k == "Certificate") < min(
        i for i, (k, _) in enumerate(order) if k == "Deployment"
    )


def test_issuer_defaults_and_no_duration_unless_asked() -> None:
    objs = rendered(spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER))
    spec = objs["Certificate", "llama-decode"]["spec"]
    assert spec["issuerRef"] == {"name": "pdorch-ca", "kind": "Issuer", "group": "cert-manager.io"}
    assert "duration" not in spec
    assert "renewBefore" not in spec


@pytest.mark.parametrize(
    ("tls", "secret"),
    [
        (TLS_CERT_MANAGER, "llama-{c}-tls"),
        ({"mode": "secrets"}, "llama-{c}-tls"),  # the names cert-manager mode would write
        (TLS_SECRETS, "{short}-keys"),
    ],
    ids=["cert-manager", "secrets-default-names", "secrets-named"],
)
def test_each_pod_mounts_only_its_own_key_in_the_runtime_layout(
    tls: dict[str, Any], secret: str
) -> None:
    objs = rendered(spec_with(MINIMAL_SPEC, "tls", tls))

    def secret_of(component: str) -> str:
        return secret.format(c=component, short=component.replace("orchestrator", "orch"))

    for component in COMPONENTS:
        pod = _pod(objs, component)
        own = secret_of(component)
        volume = _tls_volume(pod)
        assert volume["projected"]["defaultMode"] == 0o440
        own_source, *ca_sources = volume["projected"]["sources"]
        assert own_source["secret"]["name"] == own
        items = {i["key"]: i["path"] for i in own_source["secret"]["items"]}
        # The runtime's layout: <identity>.pem/.key, the identity being the common name.
        expected = {"tls.crt": f"pdorch-{component}.pem", "tls.key": f"pdorch-{component}.key"}
        if tls.get("ca"):
            (ca,) = ca_sources
            assert ca == {
                "secret": {"name": "pdorch-ca", "items": [{"key": "ca.crt", "path": "ca.pem"}]}
            }
        else:
            assert ca_sources == []
            expected["ca.crt"] = "ca.pem"
        assert items == expected
        # Only its own key: no other component's Secret, nor any key beyond these.
        readable = _secrets_in(pod)
        others = {secret_of(c) for c in COMPONENTS if c != component}
        assert not others & set(readable)
        assert readable[own] == set(expected)
        (container,) = pod["containers"]
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container["volumeMounts"]
        assert {"name": "PDORCH_TLS_DIR", "value": TLS_DIR} in container["env"]
        assert not any(m.get("subPath") for m in container["volumeMounts"])  # renewals land


def test_ca_from_a_config_map() -> None:
    pod = _pod(rendered(FULL_SPEC), "prefill")
    own, ca = _tls_volume(pod)["projected"]["sources"]
    assert [i["key"] for i in own["secret"]["items"]] == ["tls.crt", "tls.key"]
    assert ca == {
        "configMap": {
            "name": "pdorch-ca-bundle",
            "items": [{"key": "bundle.pem", "path": "ca.pem"}],
        }
    }


def test_secrets_mode_renders_no_certificate() -> None:
    objs = rendered(spec_with(MINIMAL_SPEC, "tls", TLS_SECRETS))
    assert not [k for k in objs if k[0] == "Certificate"]


@pytest.mark.parametrize("tls", [TLS_CERT_MANAGER, TLS_SECRETS], ids=["cert-manager", "secrets"])
def test_probes_are_tcp_with_tls(tls: dict[str, Any]) -> None:
    """The kubelet's gRPC probe cannot speak TLS: it would never see a pod ready."""
    objs = rendered(spec_with(MINIMAL_SPEC, "tls", tls))
    for component, port in (("orchestrator", 50051), ("prefill", 50061), ("decode", 50061)):
        container = _pod(objs, component)["containers"][0]
        probes = [p for p in ("readinessProbe", "livenessProbe", "startupProbe") if p in container]
        assert len(probes) == (2 if component == "orchestrator" else 3)
        for probe in probes:
            assert "grpc" not in container[probe]
            assert container[probe]["tcpSocket"] == {"port": port}


def test_network_policies_stay_with_tls() -> None:
    plain = rendered(MINIMAL_SPEC)
    secure = rendered(spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER))
    policies = {k for k in plain if k[0] == "NetworkPolicy"}
    assert len(policies) == 3
    for key in policies:
        assert secure[key] == plain[key]


@pytest.mark.parametrize(
    "raw",
    [MINIMAL_SPEC, FULL_SPEC, spec_with(FULL_SPEC, "tls", TLS_SECRETS)],
    ids=["minimal", "full", "secrets"],
)
def test_no_secret_reaches_a_process_argument(raw: dict[str, Any]) -> None:
    """Secrets reach processes as files or environment variables, never arguments: no
    argument expands ($(VAR), which Kubernetes substitutes) a variable filled from a
    Secret, and nothing but a key reference names a Secret's value."""
    for (kind, _), obj in rendered(raw).items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            from_secrets = {
                e["name"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            expanded = {m for a in container.get("args", []) for m in re.findall(r"\$\((\w+)\)", a)}
            assert not from_secrets & expanded, container["name"]
            assert "secretRef" not in json.dumps(container.get("envFrom", []))


# ------------------------------------------------------------------------ auth tokens


def test_orchestrators_read_their_tokens_file_from_the_secret() -> None:
    """auth.tokensSecret: a file the orchestrators re-read, named by the environment; the
    workers never see it."""
    objs = rendered(FULL_SPEC)
    pod = _pod(objs, "orchestrator")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert volume["secret"] == {
        "secretName": "pdorch-tokens",
        "items": [{"key": "tokens.json", "path": "tokens.yaml"}],
        "defaultMode": 0o440,
    }
    (container,) = pod["containers"]
    mount = {"name": "auth", "mountPath": "/etc/pdorch/auth", "readOnly": True}
    assert mount in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDORCH_TOKENS_FILE"] == "/etc/pdorch/auth/tokens.yaml"
    assert "--tokens-file" not in container["args"]
    # The real CLI, given the container's environment, reads that file.
    literal_env = {k: v for k, v in env.items() if v is not None}
    argv = [a.replace("$(POD_NAME)", "pod-0") for a in container["args"]]
    assert build_parser(literal_env).parse_args(argv).tokens_file == env["PDORCH_TOKENS_FILE"]
    for component in ("prefill", "decode"):
        assert "pdorch-tokens" not in _secrets_in(_pod(objs, component))
    default_key = parse_spec(spec_with(MINIMAL_SPEC, "auth", {"tokensSecret": {"name": "t"}}))
    assert default_key.auth.tokens_secret is not None
    assert default_key.auth.tokens_secret.key == "tokens.yaml"


def test_without_auth_nothing_is_mounted() -> None:
    pod = _pod(rendered(MINIMAL_SPEC), "orchestrator")
    # the read-only root's /tmp, the log level's file (no Secret)
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "config"]
    assert "PDORCH_TOKENS_FILE" not in json.dumps(pod)


@pytest.mark.parametrize(
    ("auth", "field"),
    [
        ({"tokens": "x"}, "spec.auth.tokens"),
        ({"tokensSecret": {}}, "spec.auth.tokensSecret.name"),
        ({"tokensSecret": {"name": "t", "path": "x"}}, "spec.auth.tokensSecret.path"),
    ],
)
def test_invalid_auth_is_named(auth: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(MINIMAL_SPEC, "auth", auth))
    assert info.value.field == field


def test_the_sample_tokens_secret_is_a_tokens_file_the_orchestrator_reads() -> None:
    (secret,) = load_yaml_documents(MANIFESTS / "samples" / "tokens-secret.yaml")
    (sample,) = [
        doc
        for doc in load_yaml_documents(MANIFESTS / "samples" / "h100-prefill-l4-decode.yaml")
        if doc["kind"] == "DisaggregatedService"
    ]
    ref = parse_spec(sample["spec"]).auth.tokens_secret
    assert ref is not None
    assert ref.name == secret["metadata"]["name"]
    caller = parse_tokens(secret["stringData"][ref.key]).lookup("change-me")
    assert caller is not None
    assert caller.tenant == "team-a"
