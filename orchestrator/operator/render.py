"""render(identity, spec) → every child object of a DisaggregatedService (pure).

The same input gives the same objects, in the order they are applied: the NetworkPolicies
first (they select pods by label, so they can exist before the pods, and a pod of the
password-less dev Redis never runs unguarded, even when a later object is refused), then
identity and config, what pods need to exist (Services, Redis), the workloads and their
disruption budgets. Every object carries an owner reference to the resource and the labels
of `naming`; nothing here talks to the API (see `reconcile`).

Objects:

    NetworkPolicy       <name>-orchestrator     only the gRPC port, from anywhere
    NetworkPolicy       <name>-workers          from this service's pods only
    NetworkPolicy       <name>-redis            (dev Redis) from this service's pods only
    ServiceAccount      <name>                  pods run as it; no API token mounted
    ConfigMap           <name>-config           environment of every pdorch process
    Certificate         <name>-orchestrator|prefill|decode   (tls.mode cert-manager) one
                                                identity each, into <name>-<component>-tls
    Service             <name>-redis            (dev Redis) headless, for the StatefulSet
    StatefulSet         <name>-redis            (dev Redis) one replica, AOF on, a PVC
    Service             <name>                  the orchestrators: clients connect here
    Service             <name>-prefill|decode   headless: pods' DNS names (discovery itself
                                                goes through Redis heartbeats)
    Deployment          <name>-orchestrator|prefill|decode
    PodDisruptionBudget <name>-orchestrator|prefill|decode   one pod down at a time

Pods select by two labels, name and instance (`naming.service_pods`), never the instance
alone: another application's pods may share an instance label.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from orchestrator.core.environment import LOG_LEVEL_ENV
from orchestrator.operator import naming, tls, workloads
from orchestrator.operator.naming import Identity, Ref
from orchestrator.operator.spec import TLS_COMPONENTS, ServiceSpec

Obj = dict[str, Any]

POOLS = ("prefill", "decode")
_DISRUPTED = ("orchestrator", *POOLS)


def render(identity: Identity, spec: ServiceSpec) -> tuple[Obj, ...]:
    n = naming.names(identity)
    config = config_map(identity, spec)
    # A key the pods follow while they run is no reason to roll them.
    config_hash = _digest({k: v for k, v in config["data"].items() if k not in workloads.LIVE_KEYS})
    objects: list[Obj] = [
        *_network_policies(identity, spec),
        _object("v1", "ServiceAccount", naming.object_meta(identity, n.service_account))
        | {"automountServiceAccountToken": False},
        config,
        *tls.certificates(identity, spec),  # before the pods that mount their Secrets
    ]
    if spec.redis.dev is not None:
        objects.append(
            _service(identity, n.redis, "redis", [("redis", workloads.REDIS_PORT)], headless=True)
        )
        objects.append(workloads.redis_statefulset(identity, spec))
    objects.append(
        _service(identity, n.service, "orchestrator", [("grpc", workloads.ORCHESTRATOR_PORT)])
    )
    for role, name in (("prefill", n.prefill), ("decode", n.decode)):
        ports = [("grpc", workloads.WORKER_PORT), ("kv", workloads.KV_PORT)]
        objects.append(_service(identity, name, role, ports, headless=True))
    objects.append(workloads.orchestrator_deployment(identity, spec, config_hash))
    for role in POOLS:
        objects.append(workloads.worker_deployment(identity, spec, role, config_hash))
    for component in _DISRUPTED:
        objects.append(_pdb(identity, f"{identity.name}-{component}", component))
    return tuple(objects)


def child_refs(identity: Identity) -> tuple[Ref, ...]:
    """Every object `render` can produce for this resource, whatever the spec: what to look
    for when pruning (e.g. the dev Redis after a switch to a Secret) and tearing down."""
    n = naming.names(identity)
    ns = identity.namespace
    refs = [
        *(
            Ref("networking.k8s.io/v1", "NetworkPolicy", ns, name)
            for name in (n.netpol_orchestrator, n.netpol_workers, n.netpol_redis)
        ),
        Ref("v1", "ServiceAccount", ns, n.service_account),
        Ref("v1", "ConfigMap", ns, n.config),
        *(
            Ref("cert-manager.io/v1", "Certificate", ns, naming.certificate(identity, c))
            for c in TLS_COMPONENTS
        ),
        Ref("v1", "Service", ns, n.redis),
        Ref("apps/v1", "StatefulSet", ns, n.redis),
        Ref("v1", "Service", ns, n.service),
        Ref("v1", "Service", ns, n.prefill),
        Ref("v1", "Service", ns, n.decode),
        Ref("apps/v1", "Deployment", ns, n.orchestrator),
        Ref("apps/v1", "Deployment", ns, n.prefill),
        Ref("apps/v1", "Deployment", ns, n.decode),
    ]
    refs += [
        Ref("policy/v1", "PodDisruptionBudget", ns, f"{identity.name}-{c}") for c in _DISRUPTED
    ]
    return tuple(refs)


def config_map(identity: Identity, spec: ServiceSpec) -> Obj:
    """The environment every pdorch process of the service reads at start."""
    n = naming.names(identity)
    data = {
        LOG_LEVEL_ENV: spec.log_level,
        "PDORCH_MODEL_CACHE": workloads.MODEL_CACHE_PATH,
    }
    if spec.redis.dev is not None:
        data["PDORCH_REDIS_URL"] = f"redis://{n.redis}:{workloads.REDIS_PORT}/0"
    if spec.transport.ucx_transports:
        data["UCX_TLS"] = ",".join(spec.transport.ucx_transports)
    if spec.transport.ucx_devices:
        data["UCX_NET_DEVICES"] = ",".join(spec.transport.ucx_devices)
    return _object("v1", "ConfigMap", naming.object_meta(identity, n.config)) | {"data": data}


# ------------------------------------------------------------------------------- parts


def _digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _object(api_version: str, kind: str, meta: dict[str, object]) -> Obj:
    return {"apiVersion": api_version, "kind": kind, "metadata": meta}


def _service(
    identity: Identity,
    name: str,
    component: str,
    ports: list[tuple[str, int]],
    *,
    headless: bool = False,
) -> Obj:
    spec: Obj = {
        "selector": naming.selector(identity, component),
        "ports": [
            {"name": pname, "port": port, "targetPort": port, "protocol": "TCP"}
            for pname, port in ports
        ],
    }
    if headless:
        spec["clusterIP"] = "None"
    else:
        spec["type"] = "ClusterIP"
    return _object("v1", "Service", naming.object_meta(identity, name, component)) | {"spec": spec}


def _pdb(identity: Identity, name: str, component: str) -> Obj:
    return _object(
        "policy/v1", "PodDisruptionBudget", naming.object_meta(identity, name, component)
    ) | {
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": naming.selector(identity, component)},
            # A pod that is not ready serves nothing: don't let it block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }
    }


def _network_policies(identity: Identity, spec: ServiceSpec) -> list[Obj]:
    n = naming.names(identity)
    same_service = {"podSelector": {"matchLabels": naming.service_pods(identity)}}

    def policy(name: str, pod_selector: Obj, ingress: list[Obj]) -> Obj:
        meta = naming.object_meta(identity, name)
        return _object("networking.k8s.io/v1", "NetworkPolicy", meta) | {
            "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress}
        }

    out = [
        # Clients reach the orchestrators on their gRPC port only, from anywhere.
        policy(
            n.netpol_orchestrator,
            {"matchLabels": naming.selector(identity, "orchestrator")},
            [{"ports": [{"protocol": "TCP", "port": workloads.ORCHESTRATOR_PORT}]}],
        ),
        # Workers take calls only from this service's pods (orchestrators call them, prefill
        # workers send KV to decode workers). No port list: UCX opens connections of its own
        # besides the KV control port.
        policy(
            n.netpol_workers,
            {
                "matchLabels": naming.service_pods(identity),
                "matchExpressions": [
                    {"key": naming.LABEL_COMPONENT, "operator": "In", "values": list(POOLS)}
                ],
            },
            [{"from": [same_service]}],
        ),
    ]
    if spec.redis.dev is not None:
        out.append(
            policy(
                n.netpol_redis,
                {"matchLabels": naming.selector(identity, "redis")},
                [
                    {
                        "from": [same_service],
                        "ports": [{"protocol": "TCP", "port": workloads.REDIS_PORT}],
                    }
                ],
            )
        )
    return out
