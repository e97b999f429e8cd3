"""A `DisaggregatedService` spec, parsed and defaulted into frozen dataclasses (pure).

The CRD's OpenAPI schema (manifests/crd/) is what the API server enforces; this parser is
the operator's own check and the one place defaults live, so that `render` gets complete,
typed input. Every error names the field (``spec.prefill.replicas: …``). Unknown fields are
errors here (the API server prunes them, so only hand-written input — samples, tests — can
carry them).

Every field maps onto a real `pdorch` flag or environment variable (``slo.ttftMs`` is the
orchestrators' ``--ttft-slo-ms``; ``slo.tpotMs`` is recorded for the planner only); see
`workloads`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.operator.errors import SpecError
from transport.backend_names import BACKENDS, DEFAULT, needs_ucx

MODELS = ("tiny", "smollm2")  # `pdorch worker --model` choices
ENGINES = ("reference", "vllm")  # `pdorch worker --engine` choices
VLLM_MODELS = ("smollm2",)  # what `pdorch worker --engine vllm` serves
TRANSPORTS = BACKENDS  # `pdorch worker --transport` choices (the CRD's enum: a test)
UCX_KINDS = tuple(k for k in TRANSPORTS if needs_ucx(k))  # where spec.transport.ucx applies
FALLBACKS = ("local", "fail")  # `pdorch orchestrator --fallback` choices
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TLS_MODES = ("disabled", "cert-manager", "secrets")
TLS_COMPONENTS = ("orchestrator", "prefill", "decode")  # one identity (and key) each
ISSUER_KINDS = ("Issuer", "ClusterIssuer")
TOKENS_KEY = "tokens.yaml"  # auth.tokensSecret's default key
# What the API server checks of the values we pass on, written once here and once in the
# CRD's schema (a test holds them to the same cases): a value the CRD let through and the
# API refused would fail the object it goes into at every pass, far from its cause.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# Secret, ConfigMap, PVC and Issuer names (at most 253 characters).
_DNS_1123_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
# A key of a Secret or ConfigMap (at most 253 characters).
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# A label value (at most 63 characters): node selectors, nvidia.com/gpu.product. Non-empty.
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# A label key: an optional DNS subdomain prefix and "/", then a name of at most 63.
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# A resource quantity (500m, 2, 16Gi, 1e3), as the API server parses it; no sign: requests,
# limits and storage are never negative.
_QUANTITY = re.compile(
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
INT32_MAX = 2**31 - 1  # replicas are int32 in a Deployment
# A pod's grace period: long enough to drain long generations, short enough that a node
# drain or rollout is not held up for days by a typo.
MAX_GRACE_S = 3600
# A Go duration, as cert-manager's duration and renewBefore take it (e.g. 2160h, 1h30m).
_GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")


@dataclass(frozen=True)
class Resources:
    """A container's requests and limits, quantities as strings (as the API stores them)."""

    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Gpu:
    product: str  # the `nvidia.com/gpu.product` node label, e.g. NVIDIA-H100-80GB-HBM3
    count: int = 1  # `nvidia.com/gpu` devices per pod


# A worker's requests (beside its GPUs) when the spec gives none: a namespace with a
# ResourceQuota on requests refuses pods without them, and a scheduler that knows nothing of
# a pod places it anywhere. A worker holds torch, the model's weights on the host while it
# loads them, and its KV buffers; a core keeps the gRPC and KV I/O going beside the engine.
WORKER_REQUESTS: Mapping[str, str] = {"cpu": "1", "memory": "2Gi"}


@dataclass(frozen=True)
class Pool:
    """One worker pool (prefill or decode)."""

    replicas: int = 1
    gpu: Gpu | None = None
    resources: Resources = field(default_factory=lambda: Resources(requests=dict(WORKER_REQUESTS)))
    image: str | None = None  # overrides the service's image
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    torch_threads: int = 0  # `--torch-threads`; 0: torch's default
    kv_capacity_mib: int = 2048  # `--kv-capacity-mib` (decode workers)
    engine: str = "reference"  # `--engine`: reference (transformers) or vllm (the image's extra)


# The orchestrators' requests when the spec gives none: a scheduler that knows nothing of
# a pod places it anywhere, and evicts it first under memory pressure. An orchestrator is a
# Python process relaying tokens (grpc, Redis); a busy one uses about a core.
ORCHESTRATOR_REQUESTS: Mapping[str, str] = {"cpu": "500m", "memory": "512Mi"}


@dataclass(frozen=True)
class OrchestratorPool:
    replicas: int = 2
    resources: Resources = field(
        default_factory=lambda: Resources(requests=dict(ORCHESTRATOR_REQUESTS))
    )


@dataclass(frozen=True)
class SecretKey:
    name: str
    key: str


# The dev Redis's requests when the spec gives none (see WORKER_REQUESTS): a development
# Redis holds the requests in flight and their journals, megabytes.
DEV_REDIS_REQUESTS: Mapping[str, str] = {"cpu": "100m", "memory": "256Mi"}


@dataclass(frozen=True)
class DevRedis:
    """A one-replica Redis StatefulSet with AOF on, for development clusters."""

    image: str = "redis:7.4"
    storage: str = "1Gi"
    append_fsync: str = "everysec"  # `always` closes the ~1 s loss window at a throughput cost
    resources: Resources = field(
        default_factory=lambda: Resources(requests=dict(DEV_REDIS_REQUESTS))
    )


@dataclass(frozen=True)
class Redis:
    """Exactly one of the two is set."""

    url_secret: SecretKey | None = None
    dev: DevRedis | None = None


@dataclass(frozen=True)
class Transport:
    kind: str = DEFAULT
    ucx_transports: tuple[str, ...] = ()  # UCX_TLS, e.g. ("rc", "cuda_copy")
    ucx_devices: tuple[str, ...] = ()  # UCX_NET_DEVICES, e.g. ("mlx5_0:1",)


@dataclass(frozen=True)
class Failover:
    fallback: str = "local"
    heartbeat_ttl_s: float = 3.0
    kv_hold_s: float = 30.0


@dataclass(frozen=True)
class Slo:
    ttft_ms: int | None = None
    tpot_ms: int | None = None


@dataclass(frozen=True)
class IssuerRef:
    """The cert-manager issuer that signs the components' certificates."""

    name: str
    kind: str = "Issuer"
    group: str = "cert-manager.io"


@dataclass(frozen=True)
class CaSource:
    """Where the CA bundle comes from, when not from each component's Secret's ``ca.crt``:
    exactly one of a Secret and a ConfigMap (a CA certificate is no secret)."""

    key: str = "ca.crt"
    secret: str | None = None
    config_map: str | None = None


@dataclass(frozen=True)
class Tls:
    """mTLS between components and TLS on the client API.

    ``disabled``: nothing is mounted (what was rendered before TLS existed).
    ``cert-manager``: the operator renders one Certificate per component identity, signed
    by `issuer`, into the Secret ``<name>-<component>-tls``.
    ``secrets``: the user provides those Secrets (`secrets` overrides their names).
    Each Secret holds ``tls.crt``, ``tls.key`` and (unless `ca` says otherwise) ``ca.crt``.
    """

    mode: str = "disabled"
    issuer: IssuerRef | None = None  # cert-manager only
    duration: str | None = None  # cert-manager only; None: the issuer's default (90 days)
    renew_before: str | None = None  # cert-manager only; None: at 2/3 of the duration
    secrets: Mapping[str, str] = field(default_factory=dict)  # component → Secret (secrets)
    ca: CaSource | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass(frozen=True)
class Auth:
    """Client authentication: the orchestrators' tokens file (SHA-256 digests of bearer
    tokens → tenants) from a Secret. None: the client API is open (the orchestrators log
    NO AUTHENTICATION)."""

    tokens_secret: SecretKey | None = None


@dataclass(frozen=True)
class ServiceSpec:
    image: str
    redis: Redis
    model: str = "smollm2"
    model_cache_claim: str | None = None  # a PVC for converted models; else an emptyDir
    image_pull_policy: str = "IfNotPresent"
    log_level: str = "INFO"
    termination_grace_period_s: int = 30
    orchestrator: OrchestratorPool = field(default_factory=OrchestratorPool)
    prefill: Pool = field(default_factory=Pool)
    decode: Pool = field(default_factory=Pool)
    transport: Transport = field(default_factory=Transport)
    failover: Failover = field(default_factory=Failover)
    slo: Slo = field(default_factory=Slo)
    tls: Tls = field(default_factory=Tls)
    auth: Auth = field(default_factory=Auth)


# --------------------------------------------------------------------------- parsing


def parse_spec(raw: Mapping[str, Any]) -> ServiceSpec:
    """Parse ``.spec`` of a DisaggregatedService; raises `SpecError` naming the field."""
    r = _Reader(raw, "spec")
    r.only(
        "image", "imagePullPolicy", "model", "logLevel", "terminationGracePeriodSeconds",
        "orchestrator", "prefill", "decode", "redis", "transport", "failover", "slo", "tls",
        "auth",
    )  # fmt: skip
    model = r.child("model")
    model.only("name", "cache")
    cache = model.child("cache")
    cache.only("persistentVolumeClaim")
    grace = r.integer("terminationGracePeriodSeconds", 30, minimum=5, maximum=MAX_GRACE_S)
    spec = ServiceSpec(
        image=r.string("image", required=True),
        model=model.choice("name", MODELS, "smollm2"),
        model_cache_claim=cache.object_name("persistentVolumeClaim") or None,
        image_pull_policy=r.choice("imagePullPolicy", PULL_POLICIES, "IfNotPresent"),
        log_level=r.choice("logLevel", LOG_LEVELS, "INFO"),
        termination_grace_period_s=grace,
        orchestrator=_orchestrator(r.child("orchestrator")),
        prefill=_pool(r.child("prefill"), decode=False),
        decode=_pool(r.child("decode"), decode=True),
        redis=_redis(r.child("redis")),
        transport=_transport(r.child("transport")),
        failover=_failover(r.child("failover")),
        slo=_slo(r.child("slo")),
        tls=_tls(r.child("tls")),
        auth=_auth(r.child("auth")),
    )
    _check_engines(spec)
    return spec


def _check_engines(spec: ServiceSpec) -> None:
    """Both pools run one engine (a KV moves only between workers of the same engine and
    model), and vLLM only the models it is set up for."""
    if spec.prefill.engine != spec.decode.engine:
        raise SpecError(
            "spec.decode.engine",
            f"{spec.decode.engine!r} differs from spec.prefill.engine {spec.prefill.engine!r}: "
            "KV moves only between workers of one engine",
        )
    if spec.decode.engine == "vllm" and spec.model not in VLLM_MODELS:
        raise SpecError("spec.model.name", f"engine vllm serves {', '.join(VLLM_MODELS)}")


def _orchestrator(r: _Reader) -> OrchestratorPool:
    r.only("replicas", "resources")
    return OrchestratorPool(
        replicas=r.integer("replicas", 2, minimum=1, maximum=INT32_MAX),
        resources=_resources(r.child("resources"), ORCHESTRATOR_REQUESTS),
    )


def _pool(r: _Reader, *, decode: bool) -> Pool:
    keys = [
        "replicas", "gpu", "resources", "image", "nodeSelector", "tolerations", "torchThreads",
        "engine",
    ]  # fmt: skip
    r.only(*keys, *(["kvCapacityMiB"] if decode else []))
    gpu = r.child("gpu")
    gpu.only("product", "count")
    return Pool(
        replicas=r.integer("replicas", 1, minimum=0, maximum=INT32_MAX),
        gpu=Gpu(gpu.label_value("product", required=True), gpu.integer("count", 1, minimum=1))
        if gpu.present
        else None,
        resources=_resources(r.child("resources"), WORKER_REQUESTS),
        image=r.string("image") or None,
        node_selector=r.label_map("nodeSelector"),
        tolerations=_tolerations(r, "tolerations"),
        torch_threads=r.integer("torchThreads", 0, minimum=0),
        kv_capacity_mib=r.integer("kvCapacityMiB", 2048, minimum=1),
        engine=r.choice("engine", ENGINES, "reference"),
    )


def _resources(r: _Reader, default_requests: Mapping[str, str] | None = None) -> Resources:
    """Requests and limits as given. Without requests, `default_requests` for every
    resource the limits leave out (for those, Kubernetes takes the limit as the request)."""
    r.only("requests", "limits")
    limits = r.quantities("limits")
    if "requests" in r.raw or not default_requests:
        requests = r.quantities("requests")
    else:
        requests = {k: v for k, v in default_requests.items() if k not in limits}
    return Resources(requests=requests, limits=limits)


_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")


def _tolerations(r: _Reader, key: str) -> tuple[Mapping[str, Any], ...]:
    """Tolerations as given, after the API server's own checks of each."""
    out = r.objects(key)
    for i, toleration in enumerate(out):
        at = f"{r.path}.{key}[{i}]"
        _Reader(toleration, at).only(*_TOLERATION_KEYS)
        exists = toleration.get("operator") == "Exists"
        if exists and toleration.get("value"):
            raise SpecError(f"{at}.value", "must be empty with operator: Exists")
        if not toleration.get("key") and not exists:
            raise SpecError(f"{at}.operator", "must be Exists when the key is empty")
        if "tolerationSeconds" in toleration and toleration.get("effect") != "NoExecute":
            raise SpecError(f"{at}.tolerationSeconds", "only applies to effect: NoExecute")
    return out


def _redis(r: _Reader) -> Redis:
    r.only("urlSecret", "dev")
    secret, dev = r.child("urlSecret"), r.child("dev")
    if secret.present == dev.present:
        raise SpecError(r.path, "set exactly one of urlSecret and dev")
    if secret.present:
        secret.only("name", "key")
        ref = SecretKey(secret.object_name("name", required=True), secret.config_key("key", "url"))
        return Redis(url_secret=ref)
    dev.only("image", "storage", "appendFsync", "resources")
    return Redis(
        dev=DevRedis(
            image=dev.string("image", "redis:7.4"),
            storage=dev.quantity("storage", "1Gi"),
            append_fsync=dev.choice("appendFsync", ("everysec", "always"), "everysec"),
            resources=_resources(dev.child("resources"), DEV_REDIS_REQUESTS),
        )
    )


def _transport(r: _Reader) -> Transport:
    r.only("kind", "ucx")
    ucx = r.child("ucx")
    ucx.only("transports", "devices")
    kind = r.choice("kind", TRANSPORTS, DEFAULT)
    if ucx.present and not needs_ucx(kind):
        raise SpecError(ucx.path, f"only applies to kind: {' or '.join(UCX_KINDS)}")
    return Transport(
        kind=kind, ucx_transports=ucx.strings("transports"), ucx_devices=ucx.strings("devices")
    )


def _failover(r: _Reader) -> Failover:
    r.only("fallback", "heartbeatTTLSeconds", "kvHoldSeconds")
    return Failover(
        fallback=r.choice("fallback", FALLBACKS, "local"),
        heartbeat_ttl_s=r.number("heartbeatTTLSeconds", 3.0, minimum=0.3),
        kv_hold_s=r.number("kvHoldSeconds", 30.0, minimum=1.0),
    )


def _slo(r: _Reader) -> Slo:
    r.only("ttftMs", "tpotMs")
    ttft = r.integer("ttftMs", 0, minimum=1) if "ttftMs" in r.raw else None
    tpot = r.integer("tpotMs", 0, minimum=1) if "tpotMs" in r.raw else None
    return Slo(ttft_ms=ttft, tpot_ms=tpot)


def _auth(r: _Reader) -> Auth:
    r.only("tokensSecret")
    secret = r.child("tokensSecret")
    if not secret.present:
        return Auth()
    secret.only("name", "key")
    return Auth(
        tokens_secret=SecretKey(
            secret.object_name("name", required=True), secret.config_key("key", TOKENS_KEY)
        )
    )


def _tls(r: _Reader) -> Tls:
    r.only("mode", "issuerRef", "duration", "renewBefore", "secrets", "ca")
    mode = r.choice("mode", TLS_MODES, "disabled")
    only_for = {
        "issuerRef": "cert-manager",
        "duration": "cert-manager",
        "renewBefore": "cert-manager",
        "secrets": "secrets",
    }
    for key, wanted in only_for.items():
        if key in r.raw and mode != wanted:
            raise SpecError(f"{r.path}.{key}", f"only applies to mode: {wanted}")
    if "ca" in r.raw and mode == "disabled":
        raise SpecError(f"{r.path}.ca", "only applies to mode: cert-manager or secrets")
    issuer = None
    if mode == "cert-manager":
        ref = r.child("issuerRef")
        if not ref.present:
            raise SpecError(ref.path, "required with mode: cert-manager")
        ref.only("name", "kind", "group")
        issuer = IssuerRef(
            name=ref.object_name("name", required=True),
            kind=ref.choice("kind", ISSUER_KINDS, "Issuer"),
            group=ref.string("group", "cert-manager.io"),
        )
    secrets = r.child("secrets")
    secrets.only(*TLS_COMPONENTS)
    return Tls(
        mode=mode,
        issuer=issuer,
        duration=r.duration("duration"),
        renew_before=r.duration("renewBefore"),
        secrets={
            c: secrets.object_name(c, required=True) for c in TLS_COMPONENTS if c in secrets.raw
        },
        ca=_ca(r.child("ca")) if "ca" in r.raw else None,
    )


def _ca(r: _Reader) -> CaSource:
    r.only("secret", "configMap", "key")
    if ("secret" in r.raw) == ("configMap" in r.raw):
        raise SpecError(r.path, "set exactly one of secret and configMap")
    return CaSource(
        key=r.config_key("key", "ca.crt"),
        secret=r.object_name("secret") or None,
        config_map=r.object_name("configMap") or None,
    )


class _Reader:
    """Typed, path-aware access to one object of the spec."""

    def __init__(self, raw: object, path: str) -> None:
        self.present = raw is not None  # given, even as {} (which asks for every default)
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, "must be an object")
        self.raw: Mapping[str, Any] = raw
        self.path = path

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def only(self, *keys: str) -> None:
        unknown = sorted(set(self.raw) - set(keys))
        if unknown:
            raise SpecError(self._at(unknown[0]), "unknown field")

    def child(self, key: str) -> _Reader:
        return _Reader(self.raw.get(key), self._at(key))

    def string(self, key: str, default: str = "", *, required: bool = False) -> str:
        value = self.raw.get(key)
        if value is None:
            if required:
                raise SpecError(self._at(key), "required")
            return default
        if not isinstance(value, str) or not value:
            raise SpecError(self._at(key), "must be a non-empty string")
        return value

    def choice(self, key: str, choices: Sequence[str], default: str) -> str:
        value = self.string(key, default)
        if value not in choices:
            raise SpecError(self._at(key), f"must be one of {', '.join(choices)}")
        return value

    def integer(self, key: str, default: int, *, minimum: int, maximum: int = INT32_MAX) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self._at(key), "must be an integer")
        if value < minimum:
            raise SpecError(self._at(key), f"must be at least {minimum}")
        if value > maximum:
            raise SpecError(self._at(key), f"must be at most {maximum}")
        return value

    def number(self, key: str, default: float, *, minimum: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(self._at(key), "must be a number")
        if value < minimum:
            raise SpecError(self._at(key), f"must be at least {minimum}")
        return float(value)

    def object_name(self, key: str, *, required: bool = False) -> str:
        """The name of an object the pods refer to (a DNS-1123 subdomain)."""
        value = self.string(key, required=required)
        if value and (len(value) > 253 or not _DNS_1123_SUBDOMAIN.match(value)):
            raise SpecError(self._at(key), "must be a Kubernetes object name (DNS-1123 subdomain)")
        return value

    def config_key(self, key: str, default: str) -> str:
        """A key of a Secret or ConfigMap."""
        value = self.string(key, default)
        if len(value) > 253 or not _CONFIG_KEY.match(value):
            raise SpecError(self._at(key), "must be a Secret key (letters, digits, '-', '_', '.')")
        return value

    def label_value(self, key: str, *, required: bool = False) -> str:
        value = self.string(key, required=required)
        if value and (len(value) > 63 or not _LABEL_VALUE.match(value)):
            raise SpecError(
                self._at(key),
                "must be a label value: at most 63 letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit",
            )
        return value

    def label_map(self, key: str) -> dict[str, str]:
        """Labels (a node selector): label keys → label values."""
        r = self.child(key)
        for name in r.raw:
            prefix, _, local = str(name).rpartition("/")
            if (
                len(local) > 63
                or not _LABEL_NAME.match(local)
                or (prefix and (len(prefix) > 253 or not _DNS_1123_SUBDOMAIN.match(prefix)))
            ):
                raise SpecError(r._at(str(name)), "must be a label key (e.g. example.com/zone)")
        return {name: r.label_value(name, required=True) for name in sorted(r.raw)}

    def duration(self, key: str) -> str | None:
        value = self.string(key) or None
        if value is not None and not _GO_DURATION.match(value):
            raise SpecError(self._at(key), "must be a duration such as 2160h or 1h30m")
        return value

    def quantity(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
            isinstance(value, str) and _QUANTITY.match(value)
        )
        if not ok:
            raise SpecError(self._at(key), "must be a quantity (e.g. 500m, 2, 16Gi)")
        return str(value)

    def quantities(self, key: str) -> dict[str, str]:
        r = self.child(key)
        return {name: r.quantity(name, "") for name in sorted(r.raw)}

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise SpecError(self._at(key), "must be a list of non-empty strings")
        return tuple(value)

    def objects(self, key: str) -> tuple[Mapping[str, Any], ...]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise SpecError(self._at(key), "must be a list of objects")
        return tuple(value)
