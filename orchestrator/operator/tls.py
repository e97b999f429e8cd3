"""TLS of a service's components: cert-manager Certificates and each pod's key mount (pure).

Each component (orchestrator, prefill, decode) is one identity: its certificate's common
name is ``pdorch-<component>``, the name the runtime checks (a worker takes calls only from
``pdorch-orchestrator``, a decode worker KV only from ``pdorch-prefill``). One certificate
serves both ends of a hop (usages server auth and client auth).

Every pod mounts only its own component's Secret, read-only, at `TLS_DIR` — a worker never
holds the orchestrator's key — mapped by the volume's ``items`` from the Secret's keys
(``tls.crt``, ``tls.key``, ``ca.crt``: what cert-manager writes, and the type
``kubernetes.io/tls`` plus a CA) to the layout the runtime reads from ``--tls-dir``
(here passed as `TLS_DIR_ENV`, so that no flag depends on the runtime's version):

    ca.pem                    the CA bundle (the Secret's ca.crt, or the key `tls.ca` names)
    pdorch-<component>.pem    the component's certificate chain (tls.crt)
    pdorch-<component>.key    its private key (tls.key)

No subPath: the kubelet swaps a Secret's files in place when cert-manager renews it.
"""

from __future__ import annotations

from typing import Any

from orchestrator.operator import naming
from orchestrator.operator.naming import Identity
from orchestrator.operator.spec import TLS_COMPONENTS, ServiceSpec

Obj = dict[str, Any]

TLS_DIR = "/etc/pdorch/tls"
TLS_DIR_ENV = "PDORCH_TLS_DIR"  # the runtime's --tls-dir
VOLUME = "tls"
CA_FILE = "ca.pem"
# The DNS names pdorch's own clients verify a server against, whatever address they dial
# (a worker reached by pod IP is still checked to be a worker): the runtime's
# `orchestrator.core.peers.server_names` — the role's identity, and for workers this one.
WORKER_SERVER_NAME = "pdorch-worker"
# Usages of a certificate that both serves (worker, orchestrator) and calls (orchestrator →
# worker, prefill → decode); the first two are what cert-manager requests by default.
USAGES = ("digital signature", "key encipherment", "server auth", "client auth")
# Readable by the pods' group (fsGroup), never by others; the files belong to root.
FILE_MODE = 0o440
# P-256 keys in PKCS#8 ("BEGIN PRIVATE KEY"), which every TLS stack we use loads; a new key
# at each renewal.
PRIVATE_KEY = {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8", "rotationPolicy": "Always"}


def common_name(component: str) -> str:
    """The identity the runtime checks on the other end of a hop; also the name of its
    files in the TLS directory."""
    return f"pdorch-{component}"


def server_names(component: str) -> list[str]:
    """The names the runtime's clients check this component's server certificate for."""
    names = [common_name(component)]
    if component != "orchestrator":
        names.append(WORKER_SERVER_NAME)
    return names


def secret_name(identity: Identity, spec: ServiceSpec, component: str) -> str:
    return spec.tls.secrets.get(component) or naming.tls_secret(identity, component)


def dns_names(identity: Identity, component: str) -> list[str]:
    """The server names pdorch's own clients check (`server_names`), then the component's
    Service under each name another client may use: clients reach the orchestrators
    through ``<name>``, the workers' headless Services name their pods."""
    n = naming.names(identity)
    service = {"orchestrator": n.service, "prefill": n.prefill, "decode": n.decode}[component]
    ns = identity.namespace
    return [
        *server_names(component),
        *(service, f"{service}.{ns}", f"{service}.{ns}.svc", f"{service}.{ns}.svc.cluster.local"),
    ]


def certificates(identity: Identity, spec: ServiceSpec) -> list[Obj]:
    """One Certificate per component identity (``tls.mode: cert-manager``), else none."""
    tls = spec.tls
    if tls.mode != "cert-manager" or tls.issuer is None:
        return []
    out = []
    for component in TLS_COMPONENTS:
        cert_spec: Obj = {
            "secretName": secret_name(identity, spec, component),
            # The labels make the Secret findable as this service's (cert-manager, not we,
            # owns it: it outlives the Certificate unless cert-manager runs with
            # --enable-certificate-owner-ref).
            "secretTemplate": {"labels": naming.selector(identity, component)},
            "commonName": common_name(component),
            "dnsNames": dns_names(identity, component),
            "usages": list(USAGES),
            "privateKey": dict(PRIVATE_KEY),
            "issuerRef": {
                "name": tls.issuer.name,
                "kind": tls.issuer.kind,
                "group": tls.issuer.group,
            },
        }
        if tls.duration is not None:
            cert_spec["duration"] = tls.duration
        if tls.renew_before is not None:
            cert_spec["renewBefore"] = tls.renew_before
        meta = naming.object_meta(identity, naming.certificate(identity, component), component)
        out.append(
            {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": meta}
            | {"spec": cert_spec}
        )
    return out


def volume(identity: Identity, spec: ServiceSpec, component: str) -> Obj | None:
    """The pod's TLS volume: its own component's key and certificate, and the CA."""
    if not spec.tls.enabled:
        return None
    ca = spec.tls.ca
    stem = common_name(component)
    items = [{"key": "tls.crt", "path": f"{stem}.pem"}, {"key": "tls.key", "path": f"{stem}.key"}]
    if ca is None:
        items.append({"key": "ca.crt", "path": CA_FILE})
    sources: list[Obj] = [
        {"secret": {"name": secret_name(identity, spec, component), "items": items}}
    ]
    if ca is not None:
        ca_items = [{"key": ca.key, "path": CA_FILE}]
        if ca.secret is not None:
            sources.append({"secret": {"name": ca.secret, "items": ca_items}})
        else:
            sources.append({"configMap": {"name": ca.config_map, "items": ca_items}})
    return {"name": VOLUME, "projected": {"defaultMode": FILE_MODE, "sources": sources}}


def mount() -> Obj:
    return {"name": VOLUME, "mountPath": TLS_DIR, "readOnly": True}


def env() -> Obj:
    return {"name": TLS_DIR_ENV, "value": TLS_DIR}
