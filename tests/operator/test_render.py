"""render(): the objects, their names and owners, and containers that run real flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import build_parser
from orchestrator.cli.common import resolve_redis
from orchestrator.operator import naming
from orchestrator.operator.naming import Ref
from orchestrator.operator.render import child_refs, render
from orchestrator.operator.spec import parse_spec
from tests.operator.conftest import (
    FULL_SPEC,
    IDENTITY,
    MINIMAL_SPEC,
    TLS_CERT_MANAGER,
    rendered,
    spec_with,
)

COMMON = {
    ("ServiceAccount", "llama"),
    ("ConfigMap", "llama-config"),
    ("Service", "llama"),
    ("Service", "llama-prefill"),
    ("Service", "llama-decode"),
    ("Deployment", "llama-orchestrator"),
    ("Deployment", "llama-prefill"),
    ("Deployment", "llama-decode"),
    ("PodDisruptionBudget", "llama-orchestrator"),
    ("PodDisruptionBudget", "llama-prefill"),
    ("PodDisruptionBudget", "llama-decode"),
    ("NetworkPolicy", "llama-orchestrator"),
    ("NetworkPolicy", "llama-workers"),
}
DEV_REDIS = {
    ("Service", "llama-redis"),
    ("StatefulSet", "llama-redis"),
    ("NetworkPolicy", "llama-redis"),
}
CERTIFICATES = {
    ("Certificate", "llama-orchestrator"),
    ("Certificate", "llama-prefill"),
    ("Certificate", "llama-decode"),
}


def _container(objs: dict[tuple[str, str], Any], name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = objs["Deployment", name]["spec"]["template"]["spec"][
        "containers"
    ]
    (container,) = containers
    return container


def _probe_port(probe: dict[str, Any]) -> int:
    """The port a probe checks (gRPC without TLS, TCP with it)."""
    (action,) = [probe[k] for k in ("grpc", "tcpSocket", "httpGet", "exec") if k in probe]
    port: int = action["port"]
    return port


def _cli_args(container: dict[str, Any]) -> Any:
    """The container's arguments as the real `pdorch` CLI parses them (after Kubernetes'
    $(VAR) expansion): an argument that is not a real flag fails here."""
    env = {"$(POD_IP)": "10.1.2.3", "$(POD_NAME)": "pod-0"}
    assert container["command"] == ["pdorch"]
    return build_parser().parse_args([env.get(a, a) for a in container["args"]])


def test_children_with_a_dev_redis() -> None:
    assert set(rendered(MINIMAL_SPEC)) == COMMON | DEV_REDIS


def test_children_with_an_external_redis_and_cert_manager() -> None:
    assert set(rendered(FULL_SPEC)) == COMMON | CERTIFICATES


@pytest.mark.parametrize("raw", [MINIMAL_SPEC, FULL_SPEC], ids=["minimal", "full"])
def test_render_is_deterministic_and_pure(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw)
    first, second = render(IDENTITY, spec), render(IDENTITY, spec)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert parse_spec(raw) == spec  # the input is untouched


@pytest.mark.parametrize(
    "raw",
    [MINIMAL_SPEC, FULL_SPEC, spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER)],
    ids=["minimal", "full", "dev-redis-cert-manager"],
)
def test_every_child_is_owned_labelled_and_known_to_teardown(raw: dict[str, Any]) -> None:
    objs = render(IDENTITY, parse_spec(raw))
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pdorch.io/v1alpha1",
                "kind": "DisaggregatedService",
                "name": "llama",
                "uid": "0d9c1a3e-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][naming.LABEL_INSTANCE] == "llama"
        assert meta["labels"][naming.LABEL_MANAGED_BY] == "pdorch-operator"
    assert {Ref.of(o) for o in objs} <= set(child_refs(IDENTITY))
    assert len(set(child_refs(IDENTITY))) == len(COMMON | DEV_REDIS | CERTIFICATES)


def test_orchestrator_runs_real_flags_from_the_spec() -> None:
    objs = rendered(FULL_SPEC)
    container = _container(objs, "llama-orchestrator")
    args = _cli_args(container)
    assert args.command == "orchestrator"
    assert args.fallback == "fail"  # failover.fallback
    assert args.drain_grace == 40  # terminationGracePeriodSeconds 45 − the 5 s margin
    assert args.ttft_slo_ms == 400  # slo.ttftMs: early rejection
    assert args.replica_id == "pod-0"
    assert _probe_port(container["readinessProbe"]) == args.port
    assert _probe_port(container["livenessProbe"]) == args.port
    assert container["ports"][0]["containerPort"] == args.port
    pod = objs["Deployment", "llama-orchestrator"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 45
    assert objs["Deployment", "llama-orchestrator"]["spec"]["replicas"] == 3
    service = objs["Service", "llama"]["spec"]
    assert service["ports"][0]["targetPort"] == args.port


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_run_real_flags_from_the_spec(role: str) -> None:
    objs = rendered(FULL_SPEC)
    container = _container(objs, f"llama-{role}")
    args = _cli_args(container)
    assert (args.command, args.role) == ("worker", role)
    assert (args.model, args.transport) == ("tiny", "ucx")
    # Workers publish host:port in Redis: it must be the pod's IP, not 0.0.0.0.
    assert args.host == "10.1.2.3"
    assert args.worker_id == "pod-0"
    assert args.heartbeat_ttl == 1.5
    assert args.torch_threads == (4 if role == "prefill" else 2)
    if role == "decode":
        assert (args.kv_capacity_mib, args.kv_hold) == (16384, 12.0)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert _probe_port(container[probe]) == args.port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "kv": args.kv_port}
    assert container["volumeMounts"][0]["mountPath"] == "/var/cache/pdorch/models"
    volume = objs["Deployment", f"llama-{role}"]["spec"]["template"]["spec"]["volumes"][0]
    assert volume == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_pools_run_vllm_workers(role: str) -> None:
    raw = spec_with(spec_with(MINIMAL_SPEC, "prefill.engine", "vllm"), "decode.engine", "vllm")
    args = _cli_args(_container(rendered(raw), f"llama-{role}"))
    assert (args.command, args.role, args.engine) == ("worker", role, "vllm")


def test_worker_flags_left_at_their_defaults_are_not_passed() -> None:
    args = _cli_args(_container(rendered(MINIMAL_SPEC), "llama-prefill"))
    assert args.torch_threads == 0
    assert args.engine == "reference"
    assert "--engine" not in _container(rendered(MINIMAL_SPEC), "llama-prefill")["args"]
    assert "--kv-hold" not in _container(rendered(MINIMAL_SPEC), "llama-prefill")["args"]


def test_gpu_pools_select_their_gpu_product_and_request_devices() -> None:
    objs = rendered(FULL_SPEC)
    prefill = objs["Deployment", "llama-prefill"]["spec"]["template"]["spec"]
    assert prefill["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "topology.kubernetes.io/zone": "zone-a",
    }
    assert prefill["containers"][0]["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    assert prefill["containers"][0]["image"] == "registry.example.com/pdorch-prefill:1.2.3"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in prefill[
        "tolerations"
    ]
    assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in (
        prefill["tolerations"]
    )
    decode = objs["Deployment", "llama-decode"]["spec"]["template"]["spec"]
    assert decode["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-L4",
        "topology.kubernetes.io/zone": "zone-b",
    }
    assert decode["containers"][0]["resources"]["limits"] == {
        "memory": "24Gi",
        "nvidia.com/gpu": "1",
    }
    assert decode["containers"][0]["image"] == "registry.example.com/pdorch-decode:1.2.3"
    orchestrator = objs["Deployment", "llama-orchestrator"]["spec"]["template"]["spec"]
    assert orchestrator["containers"][0]["image"] == "registry.example.com/pdorch:1.2.3"


def test_cpu_pools_have_no_gpu_scheduling() -> None:
    pod = rendered(MINIMAL_SPEC)["Deployment", "llama-decode"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}


def test_external_redis_url_is_a_file_from_the_secret_in_every_process(tmp_path: Path) -> None:
    """The URL carries the password: mounted read-only from its Secret and named by
    PDORCH_REDIS_URL_FILE, never an environment variable (secretKeyRef) — and the real CLI,
    given the container's environment and arguments, takes its URL from that file."""
    objs = rendered(FULL_SPEC)
    url = "rediss://pdorch:pw@redis.example:6380/0"
    for name in ("llama-orchestrator", "llama-prefill", "llama-decode"):
        pod = objs["Deployment", name]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "redis-url"]
        assert volume["secret"] == {
            "secretName": "redis-credentials",
            "items": [{"key": "uri", "path": "url"}],
            "defaultMode": 0o440,
        }
        container = _container(objs, name)
        mount = {"name": "redis-url", "mountPath": "/etc/pdorch/redis", "readOnly": True}
        assert mount in container["volumeMounts"]
        assert "secretKeyRef" not in json.dumps(container)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PDORCH_REDIS_URL_FILE"] == "/etc/pdorch/redis/url"
        assert "PDORCH_REDIS_URL" not in env
        # The file as the kubelet would project it, here; the CLI as the pod runs it.
        (tmp_path / "url").write_text(url + "\n")
        literal_env = {k: v for k, v in env.items() if v is not None}
        literal_env["PDORCH_REDIS_URL_FILE"] = str(tmp_path / "url")
        argv = [a.replace("$(POD_NAME)", "p").replace("$(POD_IP)", "10.0.0.1") for a in
                container["args"]]  # fmt: skip
        args = build_parser(literal_env).parse_args(argv)
        resolve_redis(args, literal_env)
        assert args.redis == url
    assert "PDORCH_REDIS_URL" not in objs["ConfigMap", "llama-config"]["data"]


def test_dev_redis_is_a_persistent_aof_statefulset_behind_its_service() -> None:
    raw = spec_with(MINIMAL_SPEC, "redis.dev", {"storage": "5Gi", "appendFsync": "always"})
    objs = rendered(raw)
    url = objs["ConfigMap", "llama-config"]["data"]["PDORCH_REDIS_URL"]
    assert url == "redis://llama-redis:6379/0"
    sts = objs["StatefulSet", "llama-redis"]["spec"]
    assert sts["serviceName"] == "llama-redis"
    args = sts["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    claim = sts["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "5Gi"
    service = objs["Service", "llama-redis"]["spec"]
    assert service["selector"] == sts["selector"]["matchLabels"]
    assert service["ports"][0]["port"] == 6379


def test_transport_settings_reach_ucx_through_the_environment() -> None:
    objs = rendered(FULL_SPEC)
    data = objs["ConfigMap", "llama-config"]["data"]
    assert (data["UCX_TLS"], data["UCX_NET_DEVICES"]) == ("rc,cuda_copy", "mlx5_0:1")
    assert data["PDORCH_LOG_LEVEL"] == "DEBUG"
    for name in ("llama-orchestrator", "llama-prefill", "llama-decode"):
        assert _container(objs, name)["envFrom"] == [{"configMapRef": {"name": "llama-config"}}]
    tcp = rendered(spec_with(MINIMAL_SPEC, "transport", {"kind": "tcp"}))
    assert "UCX_TLS" not in tcp["ConfigMap", "llama-config"]["data"]


def _config_hash(objs: dict[tuple[str, str], Any], name: str) -> str:
    meta = objs["Deployment", name]["spec"]["template"]["metadata"]
    return str(meta["annotations"][naming.ANNOTATION_CONFIG_HASH])


def test_a_config_change_rolls_the_pods_and_a_replica_change_does_not() -> None:
    base = rendered(MINIMAL_SPEC)
    moved = rendered(spec_with(MINIMAL_SPEC, "transport.ucx", {"transports": ["tcp"]}))
    rescaled = rendered(spec_with(MINIMAL_SPEC, "prefill.replicas", 7))
    for name in ("llama-orchestrator", "llama-prefill", "llama-decode"):
        assert _config_hash(moved, name) != _config_hash(base, name)
        assert _config_hash(rescaled, name) == _config_hash(base, name)


def test_a_log_level_change_reaches_the_pods_as_a_file_and_rolls_none() -> None:
    """The ConfigMap's level changes; no pod template does (the processes follow the file:
    `orchestrator.cli.log_file`)."""
    base = rendered(MINIMAL_SPEC)
    relogged = rendered(spec_with(MINIMAL_SPEC, "logLevel", "DEBUG"))
    assert relogged["ConfigMap", "llama-config"]["data"]["PDORCH_LOG_LEVEL"] == "DEBUG"
    assert base["ConfigMap", "llama-config"]["data"]["PDORCH_LOG_LEVEL"] == "INFO"
    for name in ("llama-orchestrator", "llama-prefill", "llama-decode"):
        assert relogged["Deployment", name] == base["Deployment", name]
        pod = base["Deployment", name]["spec"]["template"]["spec"]
        items = [{"key": "PDORCH_LOG_LEVEL", "path": "log-level"}]
        assert {"name": "config", "configMap": {"name": "llama-config", "items": items}} in pod[
            "volumes"
        ]
        container = _container(base, name)
        mount = {"name": "config", "mountPath": "/etc/pdorch/config", "readOnly": True}
        assert mount in container["volumeMounts"]
        assert "subPath" not in str(container["volumeMounts"])  # a subPath is never updated
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PDORCH_LOG_LEVEL_FILE"] == "/etc/pdorch/config/log-level"


@pytest.mark.parametrize("component", ["orchestrator", "prefill", "decode"])
def test_services_and_budgets_select_exactly_the_component_pods(component: str) -> None:
    objs = rendered(MINIMAL_SPEC)
    deployment = objs["Deployment", f"llama-{component}"]["spec"]
    selector = deployment["selector"]["matchLabels"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert selector[naming.LABEL_COMPONENT] == component
    service = "llama" if component == "orchestrator" else f"llama-{component}"
    assert objs["Service", service]["spec"]["selector"] == selector
    pdb = objs["PodDisruptionBudget", f"llama-{component}"]["spec"]
    assert pdb["selector"]["matchLabels"] == selector
    assert pdb["maxUnavailable"] == 1


def test_network_policies_admit_clients_to_orchestrators_and_only_peers_to_workers() -> None:
    objs = rendered(MINIMAL_SPEC)
    orch = objs["NetworkPolicy", "llama-orchestrator"]["spec"]
    assert orch["podSelector"]["matchLabels"][naming.LABEL_COMPONENT] == "orchestrator"
    assert orch["ingress"] == [{"ports": [{"protocol": "TCP", "port": 50051}]}]
    workers = objs["NetworkPolicy", "llama-workers"]["spec"]
    assert workers["podSelector"]["matchExpressions"] == [
        {"key": naming.LABEL_COMPONENT, "operator": "In", "values": ["prefill", "decode"]}
    ]
    same_service = {naming.LABEL_NAME: "pdorch", naming.LABEL_INSTANCE: "llama"}
    assert workers["ingress"] == [{"from": [{"podSelector": {"matchLabels": same_service}}]}]
    redis = objs["NetworkPolicy", "llama-redis"]["spec"]
    assert redis["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6379}]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) matched against labels."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        ok = ok and labels.get(expr["key"]) in expr["values"]
    return ok


def test_network_policies_neither_isolate_nor_admit_another_apps_pods() -> None:
    """Another application in the namespace whose pods share our instance label (a Helm
    release also named llama): our policies don't select its pods, nor let them in."""
    objs = rendered(MINIMAL_SPEC)
    other = {
        naming.LABEL_NAME: "grafana",
        naming.LABEL_INSTANCE: "llama",
        naming.LABEL_COMPONENT: "prefill",
    }
    for name in ("llama-orchestrator", "llama-workers", "llama-redis"):
        policy = objs["NetworkPolicy", name]["spec"]
        assert not _selects(policy["podSelector"], other), name
        for rule in policy["ingress"]:
            for peer in rule.get("from", []):
                assert not _selects(peer["podSelector"], other), name
    # ... while every pod of ours is selected by its policy and admitted to its peers.
    for (kind, name), obj in objs.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        labels = obj["spec"]["template"]["metadata"]["labels"]
        component = labels[naming.LABEL_COMPONENT]
        policy = {"orchestrator": "llama-orchestrator", "redis": "llama-redis"}.get(
            component, "llama-workers"
        )
        assert _selects(objs["NetworkPolicy", policy]["spec"]["podSelector"], labels), name
        redis_from = objs["NetworkPolicy", "llama-redis"]["spec"]["ingress"][0]["from"][0]
        assert _selects(redis_from["podSelector"], labels), name


@pytest.mark.parametrize(
    "raw",
    [MINIMAL_SPEC, FULL_SPEC, spec_with(FULL_SPEC, "tls", TLS_CERT_MANAGER)],
    ids=["minimal", "full", "cert-manager"],
)
def test_every_child_is_named_with_a_reserved_suffix(raw: dict[str, Any]) -> None:
    """What makes names of resources unique to each: a child is the resource's name or
    that plus one of `CHILD_SUFFIXES` (which no resource's name may end in), so two
    resources of one namespace never render an object of the same kind and name."""
    for kind, name in rendered(raw):
        suffix = name.removeprefix(IDENTITY.name)
        assert name.startswith(IDENTITY.name), (kind, name)
        assert suffix == "" or suffix in naming.CHILD_SUFFIXES, (kind, name)
    a = set(rendered(MINIMAL_SPEC, naming.Identity("a", "ml", "uid-a")))
    b = set(rendered(MINIMAL_SPEC, naming.Identity("a-prefill-x", "ml", "uid-b")))
    assert not a & b


def test_network_policies_come_first() -> None:
    """Applied before any pod exists (nothing runs unguarded if a later object fails)."""
    kinds = [o["kind"] for o in render(IDENTITY, parse_spec(MINIMAL_SPEC))]
    assert kinds[:3] == ["NetworkPolicy"] * 3
    assert "NetworkPolicy" not in kinds[3:]


def test_pods_run_unprivileged_without_api_credentials() -> None:
    for (kind, _), obj in rendered(MINIMAL_SPEC).items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == "llama"
        assert pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_longest_name_fits_every_generated_label() -> None:
    """Labels the controllers derive from our names stay within 63 characters, for the
    longest name the CRD and the operator allow."""
    identity = naming.Identity("a" * naming.MAX_NAME_LENGTH, "ml", "uid")
    objs = rendered(MINIMAL_SPEC, identity)
    (sts,) = [name for kind, name in objs if kind == "StatefulSet"]
    # controller-revision-hash=<statefulset>-<hash of up to 10 characters>
    assert len(sts) + 1 + naming.REVISION_HASH_LENGTH <= 63
    for (_, name), obj in objs.items():
        assert len(name) <= 63, name
        assert all(len(v) <= 63 for v in obj["metadata"]["labels"].values()), name


def test_root_filesystems_are_read_only_with_a_writable_tmp() -> None:
    for (kind, name), obj in rendered(MINIMAL_SPEC).items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        if kind == "Deployment":  # pdorch: HOME and tempfiles are /tmp, an emptyDir
            (container,) = pod["containers"]
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
            assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]


def test_orchestrators_request_resources_by_default() -> None:
    def resources(raw: dict[str, Any]) -> Any:
        return _container(rendered(raw), "llama-orchestrator")["resources"]

    assert resources(MINIMAL_SPEC) == {"requests": {"cpu": "500m", "memory": "512Mi"}}
    # Limits alone: Kubernetes takes them as the requests, no default may exceed them.
    limited = spec_with(MINIMAL_SPEC, "orchestrator.resources", {"limits": {"memory": "256Mi"}})
    assert resources(limited) == {"requests": {"cpu": "500m"}, "limits": {"memory": "256Mi"}}
    given = spec_with(MINIMAL_SPEC, "orchestrator.resources", {"requests": {"cpu": "2"}})
    assert resources(given) == {"requests": {"cpu": "2"}}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_request_cpu_and_memory_by_default(role: str) -> None:
    """A namespace's ResourceQuota on requests refuses a pod without them."""

    def resources(raw: dict[str, Any]) -> Any:
        return _container(rendered(raw), f"llama-{role}")["resources"]

    assert resources(MINIMAL_SPEC) == {"requests": {"cpu": "1", "memory": "2Gi"}}
    gpu = spec_with(MINIMAL_SPEC, f"{role}.gpu", {"product": "NVIDIA-L4"})
    assert resources(gpu) == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"nvidia.com/gpu": "1"},  # GPUs are the gpu field's, never defaulted
    }
    limited = spec_with(MINIMAL_SPEC, f"{role}.resources", {"limits": {"cpu": "500m"}})
    assert resources(limited) == {"requests": {"memory": "2Gi"}, "limits": {"cpu": "500m"}}
    given = spec_with(MINIMAL_SPEC, f"{role}.resources", {"requests": {"memory": "8Gi"}})
    assert resources(given) == {"requests": {"memory": "8Gi"}}


def test_the_dev_redis_requests_resources_and_takes_the_specs() -> None:
    def resources(raw: dict[str, Any]) -> Any:
        sts = rendered(raw)["StatefulSet", "llama-redis"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        return container["resources"]

    assert resources(MINIMAL_SPEC) == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    limited = spec_with(MINIMAL_SPEC, "redis.dev.resources", {"limits": {"memory": "128Mi"}})
    assert resources(limited) == {"requests": {"cpu": "100m"}, "limits": {"memory": "128Mi"}}
    given = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    assert resources(spec_with(MINIMAL_SPEC, "redis.dev.resources", given)) == given


def test_every_container_requests_resources_by_default() -> None:
    for (kind, name), obj in rendered(MINIMAL_SPEC).items():
        if kind in ("Deployment", "StatefulSet"):
            for container in obj["spec"]["template"]["spec"]["containers"]:
                assert set(container["resources"]["requests"]) == {"cpu", "memory"}, name


def test_the_dev_redis_pvc_goes_with_the_resource() -> None:
    sts = rendered(MINIMAL_SPEC)["StatefulSet", "llama-redis"]["spec"]
    assert sts["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


@pytest.mark.parametrize(("replicas", "floor"), [(1, 1), (2, 1), (5, 4)])
def test_a_pool_rollout_keeps_pods_serving(replicas: int, floor: int) -> None:
    """A rollout never takes a pool below `floor` pods (one pod: none at all); more than
    one pod: no surge pod, which a GPU node would have no device for."""
    objs = rendered(spec_with(MINIMAL_SPEC, "prefill.replicas", replicas))
    strategy = objs["Deployment", "llama-prefill"]["spec"]["strategy"]
    rolling = strategy["rollingUpdate"]
    assert replicas - rolling["maxUnavailable"] >= floor
    assert rolling["maxSurge"] == (1 if replicas == 1 else 0)
