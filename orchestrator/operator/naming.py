"""Deterministic names and labels of a service's children (pure).

Every child's name is the resource's name plus a fixed suffix, so the operator finds its
children by name (a GET, no list or watch permission needed) and a re-render never creates
a second copy. Selector labels are the minimal, never-changing set (Deployment selectors
are immutable); the other labels are informational.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.operator.errors import SpecError

GROUP = "pdorch.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedService"
PLURAL = "disaggregatedservices"

COMPONENTS = ("orchestrator", "prefill", "decode", "redis")

# What caps the resource's name: the StatefulSet controller labels the dev Redis's pods
# controller-revision-hash=<name>-redis-<hash of up to 10 characters>, a label value of at
# most 63 characters (kubernetes/kubernetes#64023: over it, the pods are refused), so
# 63 - len("-redis") - 1 - 10 = 46. Children's names (the longest suffix is "-orchestrator",
# 13 characters) stay DNS-1035 labels of at most 63 with room to spare.
REVISION_HASH_LENGTH = 10
MAX_NAME_LENGTH = 63 - len("-redis") - 1 - REVISION_HASH_LENGTH
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Every suffix `names` (and `certificate`) appends to the resource's name. A resource named
# with one of them would share names with another resource's children (`a`'s headless
# Service `a-prefill` is the Service of a resource named `a-prefill`), each operator pass
# patching the other's object back: such names are refused, here and by the CRD's rule
# (which a test holds to this list).
CHILD_SUFFIXES = ("-config", "-orchestrator", "-prefill", "-decode", "-redis", "-workers")

LABEL_NAME = "app.kubernetes.io/name"
APP_NAME = "pdorch"  # the value of LABEL_NAME on every child and pod
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "pdorch-operator"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"


@dataclass(frozen=True)
class Identity:
    """The owning resource, as the children's owner references and names need it."""

    name: str
    namespace: str
    uid: str
    generation: int | None = None

    def __post_init__(self) -> None:
        if len(self.name) > MAX_NAME_LENGTH or not _DNS_1035.match(self.name):
            raise SpecError(
                "metadata.name",
                f"must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters",
            )
        for suffix in CHILD_SUFFIXES:
            if self.name.endswith(suffix):
                raise SpecError(
                    "metadata.name",
                    f"must not end in {suffix}: children of a resource named "
                    f"{self.name.removesuffix(suffix)!r} have that name",
                )


@dataclass(frozen=True)
class Ref:
    """Which object: enough to find it by name through the API."""

    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Ref:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Names:
    service: str  # the orchestrators' Service: clients connect to <name>.<namespace>:50051
    service_account: str
    config: str
    orchestrator: str
    prefill: str
    decode: str
    redis: str
    netpol_orchestrator: str
    netpol_workers: str
    netpol_redis: str


def names(identity: Identity) -> Names:
    n = identity.name
    return Names(
        service=n,
        service_account=n,
        config=f"{n}-config",
        orchestrator=f"{n}-orchestrator",
        prefill=f"{n}-prefill",
        decode=f"{n}-decode",
        redis=f"{n}-redis",
        netpol_orchestrator=f"{n}-orchestrator",
        netpol_workers=f"{n}-workers",
        netpol_redis=f"{n}-redis",
    )


def certificate(identity: Identity, component: str) -> str:
    """A component's cert-manager Certificate. Not ``…-tls``: cert-manager copies this name
    into label values (at most 63 characters), which the longest suffix already reaches."""
    return f"{identity.name}-{component}"


def tls_secret(identity: Identity, component: str) -> str:
    """The Secret holding a component's key and certificate (cert-manager writes it; in
    ``tls.mode: secrets`` the user does, unless ``tls.secrets`` names another)."""
    return f"{identity.name}-{component}-tls"


def service_pods(identity: Identity) -> dict[str, str]:
    """The labels every pod of the service carries, whatever its component. Both: another
    application's pods may carry the same instance label (a Helm release of the same name),
    and must be neither isolated nor admitted by our NetworkPolicies."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: identity.name}


def selector(identity: Identity, component: str) -> dict[str, str]:
    """The labels a component's pods are selected by (never changes for a resource)."""
    return {**service_pods(identity), LABEL_COMPONENT: component}


def labels(identity: Identity, component: str | None = None) -> dict[str, str]:
    out = {LABEL_NAME: APP_NAME, LABEL_INSTANCE: identity.name, LABEL_MANAGED_BY: MANAGED_BY}
    if component is not None:
        out[LABEL_COMPONENT] = component
    return out


def owner_reference(identity: Identity) -> dict[str, object]:
    """Marks a child as controlled by the resource: Kubernetes' garbage collector deletes it
    with the resource even when the operator is not running."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": identity.name,
        "uid": identity.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(identity: Identity, name: str, component: str | None = None) -> dict[str, object]:
    return {
        "name": name,
        "namespace": identity.namespace,
        "labels": labels(identity, component),
        "ownerReferences": [owner_reference(identity)],
    }
