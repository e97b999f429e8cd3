"""Pod-running children: the orchestrator and worker Deployments, the dev Redis StatefulSet
(pure).

Every container argument is a real `pdorch` flag (a test parses the rendered arguments with
the CLI's own parser). The mapping from the spec:

    failover.fallback            orchestrator --fallback
    terminationGracePeriodSeconds  pod's grace; orchestrator --drain-grace = grace - margin
    model.name                   worker --model
    transport.kind               worker --transport
    transport.ucx.transports     env UCX_TLS (UCX's own variable)
    transport.ucx.devices        env UCX_NET_DEVICES
    failover.heartbeatTTLSeconds worker --heartbeat-ttl
    failover.kvHoldSeconds       decode worker --kv-hold
    decode.kvCapacityMiB         decode worker --kv-capacity-mib
    <pool>.engine                worker --engine (reference | vllm)
    <pool>.torchThreads          worker --torch-threads
    <pool>.gpu                   node selector nvidia.com/gpu.product + nvidia.com/gpu limit
    redis.urlSecret              the Secret's key mounted read-only as a file, env
                                 PDORCH_REDIS_URL_FILE (the URL carries the password: never
                                 an environment variable nor an argument)
    redis.dev                    env PDORCH_REDIS_URL (the dev Service; no password)
    auth.tokensSecret            orchestrators: the Secret's key mounted read-only as a
                                 file, env PDORCH_TOKENS_FILE (never an argument)
    tls                          the component's own key mounted read-only, env
                                 PDORCH_TLS_DIR (see `tls`); TCP probes (below)
    logLevel                     the ConfigMap's PDORCH_LOG_LEVEL, and mounted as a file
                                 (env PDORCH_LOG_LEVEL_FILE) each process follows: a
                                 change rolls no pod

Every container's root filesystem is read-only. pdorch processes write only to an emptyDir
at /tmp (the image's HOME, so library caches such as Hugging Face's and pip's land there
too), the model cache, and the dev Redis to its PVC at /data.

Workers advertise ``--host $(POD_IP)`` (they publish host:port into Redis, so it must be
routable); the orchestrator binds every interface so that `kubectl port-forward` reaches it.
Probes are native gRPC probes (grpc.health.v1) on each process's gRPC port — without TLS:
the kubelet's gRPC probe cannot speak TLS (nor present a client certificate), so with TLS
they are TCP probes of that port (open once the process serves: a worker loads its model
first).
"""

from __future__ import annotations

from typing import Any

from orchestrator.core.environment import LOG_LEVEL_ENV, LOG_LEVEL_FILE_ENV, REDIS_URL_FILE_ENV
from orchestrator.operator import naming, tls
from orchestrator.operator.naming import Identity, Names
from orchestrator.operator.spec import Pool, Resources, ServiceSpec

Obj = dict[str, Any]

ORCHESTRATOR_PORT = 50051
WORKER_PORT = 50061
KV_PORT = 50062
REDIS_PORT = 6379
MODEL_CACHE_PATH = "/var/cache/pdorch/models"
TMP_PATH = "/tmp"  # noqa: S108 - an emptyDir of the pod's own, the image's HOME too
AUTH_DIR = "/etc/pdorch/auth"
TOKENS_FILE = "tokens.yaml"  # in AUTH_DIR; YAML or JSON, whatever the Secret's key holds
TOKENS_FILE_ENV = "PDORCH_TOKENS_FILE"  # the orchestrator's --tokens-file
REDIS_DIR = "/etc/pdorch/redis"
REDIS_URL_FILE = "url"  # in REDIS_DIR
CONFIG_DIR = "/etc/pdorch/config"
LOG_LEVEL_FILE = "log-level"  # in CONFIG_DIR: the ConfigMap's PDORCH_LOG_LEVEL
LIVE_KEYS = (LOG_LEVEL_ENV,)
"""ConfigMap keys the processes follow while they run (`_mount_log_level`): a change of
one reaches the pods without rolling them, so it is left out of the config hash."""
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The orchestrator's gRPC drain ends this long before the kubelet's SIGKILL, leaving time
# for the rest of its shutdown (stopping control tasks, closing Redis).
DRAIN_MARGIN_S = 5
# First start of a worker may convert the model (about a minute on a CPU) before serving.
WORKER_STARTUP_BUDGET_S = 600
PROBE_PERIOD_S = 5

_RUN_AS = 10001  # the image's unprivileged user (manifests/image/Dockerfile)
_REDIS_RUN_AS = 999  # the redis image's `redis` user


def orchestrator_deployment(identity: Identity, spec: ServiceSpec, config_hash: str) -> Obj:
    n = naming.names(identity)
    drain = max(1, spec.termination_grace_period_s - DRAIN_MARGIN_S)
    args = [
        *_global_args(),
        "orchestrator",
        "--host", "0.0.0.0",  # noqa: S104 - a pod's own network namespace; see the docstring
        "--port", str(ORCHESTRATOR_PORT),
        "--replica-id", "$(POD_NAME)",
        "--fallback", spec.failover.fallback,
        "--drain-grace", str(drain),
    ]  # fmt: skip
    if spec.slo.ttft_ms is not None:  # early rejection of what would miss it
        args += ["--ttft-slo-ms", str(spec.slo.ttft_ms)]
    container = _container(
        "orchestrator",
        spec.image,
        spec,
        args,
        config_name=n.config,
        ports=[_port("grpc", ORCHESTRATOR_PORT)],
        resources=spec.orchestrator.resources,
        probe_port=ORCHESTRATOR_PORT,
    )
    pod = _pod_spec(identity, n, spec, "orchestrator", [container])
    _mount_log_level(n.config, pod)
    _mount_redis_url(spec, pod)
    _mount_tokens(spec, pod)
    _mount_tls(identity, spec, "orchestrator", pod)
    return _deployment(
        identity,
        n.orchestrator,
        "orchestrator",
        spec.orchestrator.replicas,
        pod,
        config_hash,
        # Orchestrators are cheap: bring a new one up before an old one goes.
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
    )


def worker_deployment(identity: Identity, spec: ServiceSpec, role: str, config_hash: str) -> Obj:
    n = naming.names(identity)
    pool = spec.prefill if role == "prefill" else spec.decode
    args = [
        *_global_args(),
        "worker",
        "--role", role,
        "--model", spec.model,
        "--transport", spec.transport.kind,
        "--host", "$(POD_IP)",
        "--port", str(WORKER_PORT),
        "--kv-port", str(KV_PORT),
        "--worker-id", "$(POD_NAME)",
        "--heartbeat-ttl", _num(spec.failover.heartbeat_ttl_s),
    ]  # fmt: skip
    if role == "decode":
        args += ["--kv-capacity-mib", str(pool.kv_capacity_mib)]
        args += ["--kv-hold", _num(spec.failover.kv_hold_s)]
    if pool.torch_threads:
        args += ["--torch-threads", str(pool.torch_threads)]
    if pool.engine != "reference":
        args += ["--engine", pool.engine]
    container = _container(
        role,
        pool.image or spec.image,
        spec,
        args,
        config_name=n.config,
        ports=[_port("grpc", WORKER_PORT), _port("kv", KV_PORT)],
        resources=pool.resources,
        probe_port=WORKER_PORT,
        gpus=pool.gpu.count if pool.gpu else 0,
        startup_budget_s=WORKER_STARTUP_BUDGET_S,
    )
    container["volumeMounts"] = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
        *container["volumeMounts"],
    ]
    pod = _pod_spec(identity, n, spec, role, [container])
    pod["volumes"] = [
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": spec.model_cache_claim}}
        if spec.model_cache_claim
        else {"name": "model-cache", "emptyDir": {}},
        *pod["volumes"],
    ]
    _mount_log_level(n.config, pod)
    _mount_redis_url(spec, pod)
    _mount_tls(identity, spec, role, pod)
    _schedule_on_gpus(pod, pool)
    return _deployment(
        identity,
        n.prefill if role == "prefill" else n.decode,
        role,
        pool.replicas,
        pod,
        config_hash,
        strategy=_pool_strategy(pool.replicas),
    )


def _pool_strategy(replicas: int) -> Obj:
    """A pool's rollout. Of several pods, replace one at a time without a surge pod (GPU
    nodes rarely have a spare device). Of one, bring the new pod up first: taking the only
    pod down would leave the pool empty for a whole model load (minutes). Without a spare
    GPU the new pod stays Pending and the old one serves on: the status reports the rollout
    stuck once the Deployment's progress deadline passes."""
    if replicas <= 1:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    else:
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def redis_statefulset(identity: Identity, spec: ServiceSpec) -> Obj:
    dev = spec.redis.dev
    if dev is None:  # pragma: no cover - render only calls this for a dev Redis
        raise ValueError("redis_statefulset needs spec.redis.dev")
    n = naming.names(identity)
    args = [
        "redis-server",
        "--appendonly",
        "yes",
        "--appendfsync",
        dev.append_fsync,
        "--dir",
        "/data",
    ]
    container: Obj = {
        "name": "redis",
        "image": dev.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": args,
        "ports": [_port("redis", REDIS_PORT)],
        "readinessProbe": {
            "exec": {"command": ["redis-cli", "ping"]},
            "periodSeconds": PROBE_PERIOD_S,
        },
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": _container_security(),
        "resources": _resources(dev.resources, 0),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": naming.object_meta(identity, n.redis, "redis"),
        "spec": {
            "serviceName": n.redis,
            "replicas": 1,
            # The PVC goes with the StatefulSet (deleted with the resource): a dev Redis's
            # data is not worth a volume nobody owns (Kubernetes 1.27+; older clusters
            # ignore the field and keep the PVC).
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Delete",
                "whenScaled": "Retain",
            },
            "selector": {"matchLabels": naming.selector(identity, "redis")},
            "template": {
                "metadata": {"labels": _pod_labels(identity, "redis")},
                "spec": {
                    "serviceAccountName": n.service_account,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(_REDIS_RUN_AS),
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": dev.storage}},
                    },
                }
            ],
        },
    }


# ------------------------------------------------------------------------------- parts


def _mount(pod: Obj, volume: Obj, mount: Obj, env: Obj) -> None:
    """``volume`` into ``pod``, mounted in its one container, and ``env`` for it."""
    pod["volumes"] = [*pod.get("volumes", []), volume]
    (container,) = pod["containers"]
    container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
    container["env"] = [*container["env"], env]


def _file_mount(name: str, directory: str, file: str, env_name: str) -> tuple[Obj, Obj]:
    """A volume's read-only mount at ``directory`` (no subPath: the kubelet swaps in a
    changed version), and the variable naming its ``file`` there."""
    mount = {"name": name, "mountPath": directory, "readOnly": True}
    return mount, {"name": env_name, "value": f"{directory}/{file}"}


def _mount_log_level(config_name: str, pod: Obj) -> None:
    """The ConfigMap's log level as a file too, which the process follows
    (`orchestrator.cli.log_file`): a changed ``logLevel`` reaches running pods within a
    minute or so, without a restart."""
    items = [{"key": LOG_LEVEL_ENV, "path": LOG_LEVEL_FILE}]
    volume = {"name": "config", "configMap": {"name": config_name, "items": items}}
    _mount(pod, volume, *_file_mount("config", CONFIG_DIR, LOG_LEVEL_FILE, LOG_LEVEL_FILE_ENV))


def _secret_volume(name: str, secret_name: str, key: str, path: str) -> Obj:
    items = [{"key": key, "path": path}]
    # the pods' group reads it, no one else
    secret = {"secretName": secret_name, "items": items, "defaultMode": tls.FILE_MODE}
    return {"name": name, "secret": secret}


def _mount_redis_url(spec: ServiceSpec, pod: Obj) -> None:
    """The external Redis's URL (its password included), read-only, from its Secret: a
    file, not an environment variable (which the process's /proc/PID/environ, crash
    dumps and anything that logs the environment would show). Read once at start: a
    rotated URL reaches the processes as their pods restart."""
    ref = spec.redis.url_secret
    if ref is None:
        return
    volume = _secret_volume("redis-url", ref.name, ref.key, REDIS_URL_FILE)
    _mount(pod, volume, *_file_mount("redis-url", REDIS_DIR, REDIS_URL_FILE, REDIS_URL_FILE_ENV))


def _mount_tokens(spec: ServiceSpec, pod: Obj) -> None:
    """The tokens file, read-only, from its Secret (the orchestrator re-reads the file when
    the kubelet swaps in a new version of the Secret)."""
    ref = spec.auth.tokens_secret
    if ref is None:
        return
    volume = _secret_volume("auth", ref.name, ref.key, TOKENS_FILE)
    _mount(pod, volume, *_file_mount("auth", AUTH_DIR, TOKENS_FILE, TOKENS_FILE_ENV))


def _mount_tls(identity: Identity, spec: ServiceSpec, component: str, pod: Obj) -> None:
    """The component's own TLS Secret, read-only, and where the process finds it."""
    volume = tls.volume(identity, spec, component)
    if volume is not None:
        _mount(pod, volume, tls.mount(), tls.env())


def _global_args() -> list[str]:
    return ["--log-format", "json"]  # the log level: the ConfigMap's (`_mount_log_level`)


def _num(value: float) -> str:
    return f"{value:g}"


def _port(name: str, port: int) -> Obj:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _container(
    name: str,
    image: str,
    spec: ServiceSpec,
    args: list[str],
    *,
    config_name: str,
    ports: list[Obj],
    resources: Resources,
    probe_port: int,
    gpus: int = 0,
    startup_budget_s: int = 0,
) -> Obj:
    # kubelet's gRPC probes cannot do TLS: see the module's docstring.
    probe: Obj = (
        {"tcpSocket": {"port": probe_port}} if spec.tls.enabled else {"grpc": {"port": probe_port}}
    )
    env: list[Obj] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    container: Obj = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["pdorch"],
        "args": args,
        "env": env,
        "envFrom": [{"configMapRef": {"name": config_name}}],
        "ports": ports,
        "resources": _resources(resources, gpus),
        "readinessProbe": {**probe, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_PATH}],
    }
    if startup_budget_s:
        container["startupProbe"] = {
            **probe,
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": startup_budget_s // PROBE_PERIOD_S,
        }
    return container


def _resources(resources: Resources, gpus: int) -> Obj:
    out: Obj = {}
    if resources.requests:
        out["requests"] = dict(resources.requests)
    limits = dict(resources.limits)
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    if limits:
        out["limits"] = limits
    return out


def _schedule_on_gpus(pod: Obj, pool: Pool) -> None:
    selector = dict(pool.node_selector)
    tolerations = [dict(t) for t in pool.tolerations]
    if pool.gpu is not None:
        selector[GPU_PRODUCT_LABEL] = pool.gpu.product
        # GPU nodes are commonly tainted so that only GPU pods land there.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if selector:
        pod["nodeSelector"] = selector
    if tolerations:
        pod["tolerations"] = tolerations


def _pod_labels(identity: Identity, component: str) -> dict[str, str]:
    return {**naming.labels(identity, component), **naming.selector(identity, component)}


def _pod_spec(
    identity: Identity, n: Names, spec: ServiceSpec, component: str, containers: list[Obj]
) -> Obj:
    return {
        "serviceAccountName": n.service_account,
        "automountServiceAccountToken": False,  # no process of ours talks to the API
        # Service links would inject PDORCH_* variables (from Services named pdorch-…) that
        # collide with the CLI's own PDORCH_* settings.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_s,
        "securityContext": _pod_security(_RUN_AS),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": naming.selector(identity, component)},
            }
        ],
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {}}],  # the read-only root's one writable dir
    }


def _pod_security(user: int) -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _deployment(
    identity: Identity,
    name: str,
    component: str,
    replicas: int,
    pod: Obj,
    config_hash: str,
    *,
    strategy: Obj,
) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.object_meta(identity, name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": naming.selector(identity, component)},
            "strategy": strategy,
            "template": {
                "metadata": {
                    "labels": _pod_labels(identity, component),
                    # A changed ConfigMap rolls the pods (env is read only at start), but
                    # for the keys they follow (`LIVE_KEYS`: the hash leaves them out).
                    "annotations": {naming.ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": pod,
            },
        },
    }
