"""parse_spec: defaults, every field mapped, and errors that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.operator.errors import SpecError
from orchestrator.operator.naming import CHILD_SUFFIXES, Identity
from orchestrator.operator.spec import (
    DevRedis,
    Failover,
    Gpu,
    OrchestratorPool,
    Pool,
    Redis,
    Resources,
    SecretKey,
    ServiceSpec,
    Slo,
    Transport,
    parse_spec,
)
from tests.operator.conftest import FULL_SPEC, MINIMAL_SPEC, spec_with


def test_minimal_spec_gets_every_default() -> None:
    assert parse_spec(MINIMAL_SPEC) == ServiceSpec(
        image="pdorch:test",
        redis=Redis(dev=DevRedis(image="redis:7.4", storage="1Gi", append_fsync="everysec")),
        model="smollm2",
        model_cache_claim=None,
        image_pull_policy="IfNotPresent",
        log_level="INFO",
        termination_grace_period_s=30,
        orchestrator=OrchestratorPool(replicas=2),
        prefill=Pool(replicas=1),
        decode=Pool(replicas=1, kv_capacity_mib=2048),
        transport=Transport(kind="ucx"),
        failover=Failover(fallback="local", heartbeat_ttl_s=3.0, kv_hold_s=30.0),
        slo=Slo(),
    )


def test_full_spec_maps_every_field() -> None:
    spec = parse_spec(FULL_SPEC)
    assert spec.image == "registry.example.com/pdorch:1.2.3"
    assert (spec.image_pull_policy, spec.log_level) == ("Always", "DEBUG")
    assert spec.termination_grace_period_s == 45
    assert (spec.model, spec.model_cache_claim) == ("tiny", "models")
    assert spec.orchestrator == OrchestratorPool(
        replicas=3,
        resources=Resources(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "2Gi"}),
    )
    assert spec.prefill == Pool(
        replicas=2,
        gpu=Gpu("NVIDIA-H100-80GB-HBM3", 2),
        # Integer quantities become strings, as the API server stores them.
        resources=Resources(requests={"cpu": "8", "memory": "64Gi"}, limits={"memory": "64Gi"}),
        image="registry.example.com/pdorch-prefill:1.2.3",
        node_selector={"topology.kubernetes.io/zone": "zone-a"},
        tolerations=(
            {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
        ),
        torch_threads=4,
    )
    assert spec.decode == Pool(
        replicas=5,
        gpu=Gpu("NVIDIA-L4", 1),
        resources=Resources(requests={"cpu": "4"}, limits={"memory": "24Gi"}),
        image="registry.example.com/pdorch-decode:1.2.3",
        node_selector={"topology.kubernetes.io/zone": "zone-b"},
        tolerations=({"key": "spot", "operator": "Exists"},),
        torch_threads=2,
        kv_capacity_mib=16384,
    )
    assert spec.redis == Redis(url_secret=SecretKey("redis-credentials", "uri"))
    assert spec.transport == Transport("ucx", ("rc", "cuda_copy"), ("mlx5_0:1",))
    assert spec.failover == Failover("fail", 1.5, 12.0)
    assert spec.slo == Slo(400, 40)


def test_secret_key_defaults_to_url() -> None:
    spec = parse_spec(spec_with(MINIMAL_SPEC, "redis", {"urlSecret": {"name": "r"}}))
    assert spec.redis == Redis(url_secret=SecretKey("r", "url"))


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("image", ..., "spec.image"),
        ("image", "", "spec.image"),
        ("replica", 3, "spec.replica"),  # unknown field (a typo)
        ("prefill.replica", 3, "spec.prefill.replica"),
        ("prefill.kvCapacityMiB", 1, "spec.prefill.kvCapacityMiB"),  # decode only
        ("prefill.replicas", -1, "spec.prefill.replicas"),
        ("prefill.replicas", True, "spec.prefill.replicas"),
        ("prefill.replicas", "2", "spec.prefill.replicas"),
        ("orchestrator.replicas", 0, "spec.orchestrator.replicas"),
        ("decode.gpu", {"count": 1}, "spec.decode.gpu.product"),
        ("decode.gpu", {"product": "NVIDIA-L4", "count": 0}, "spec.decode.gpu.count"),
        ("decode.resources.limits", {"memory": ""}, "spec.decode.resources.limits.memory"),
        ("decode.resources.limits", {"memory": True}, "spec.decode.resources.limits.memory"),
        ("decode.resources.claims", [], "spec.decode.resources.claims"),
        ("decode.tolerations", {"key": "x"}, "spec.decode.tolerations"),
        ("decode.nodeSelector", {"zone": 1}, "spec.decode.nodeSelector.zone"),
        ("model.name", "llama-70b", "spec.model.name"),
        ("model", "tiny", "spec.model"),
        ("redis", ..., "spec.redis"),
        ("redis", {}, "spec.redis"),
        ("redis", {"dev": {}, "urlSecret": {"name": "r"}}, "spec.redis"),
        ("redis", {"urlSecret": {}}, "spec.redis.urlSecret.name"),
        ("redis.dev", {"appendFsync": "no"}, "spec.redis.dev.appendFsync"),
        ("transport", {"kind": "rdma"}, "spec.transport.kind"),
        ("transport", {"kind": "tcp", "ucx": {"devices": ["mlx5_0:1"]}}, "spec.transport.ucx"),
        ("transport", {"ucx": {"devices": "mlx5_0:1"}}, "spec.transport.ucx.devices"),
        ("failover.fallback", "retry", "spec.failover.fallback"),
        ("failover.heartbeatTTLSeconds", 0.1, "spec.failover.heartbeatTTLSeconds"),
        ("failover.kvHoldSeconds", "30s", "spec.failover.kvHoldSeconds"),
        ("terminationGracePeriodSeconds", 2, "spec.terminationGracePeriodSeconds"),
        ("slo.ttftMs", 0, "spec.slo.ttftMs"),
        ("logLevel", "TRACE", "spec.logLevel"),
        ("decode.engine", "sglang", "spec.decode.engine"),
        ("decode.engine", "vllm", "spec.decode.engine"),  # prefill still runs the reference
    ],
)
def test_invalid_field_is_named(path: str, value: Any, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(MINIMAL_SPEC, path, value))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_both_pools_may_run_vllm_on_the_models_it_serves() -> None:
    raw = spec_with(spec_with(MINIMAL_SPEC, "prefill.engine", "vllm"), "decode.engine", "vllm")
    spec = parse_spec(raw)
    assert (spec.prefill.engine, spec.decode.engine) == ("vllm", "vllm")
    assert parse_spec(MINIMAL_SPEC).decode.engine == "reference"
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(raw, "model", {"name": "tiny"}))
    assert info.value.field == "spec.model.name"


def test_spec_must_be_an_object() -> None:
    with pytest.raises(SpecError, match="must be an object"):
        parse_spec(["image"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a" * 47, "Llama", "9lives", "llama-", "ll.ama", ""])
def test_resource_name_must_fit_every_child_name(name: str) -> None:
    with pytest.raises(SpecError, match=r"metadata\.name"):
        Identity(name=name, namespace="ml", uid="u")


def test_longest_allowed_name_is_accepted() -> None:
    assert Identity(name="a" * 46, namespace="ml", uid="u").name == "a" * 46


@pytest.mark.parametrize("suffix", CHILD_SUFFIXES)
def test_a_name_ending_in_a_childs_suffix_is_refused(suffix: str) -> None:
    """`a` names its children `a-prefill`, `a-redis`, …: a resource of such a name would
    share objects with another's (the headless Service `a-prefill` is also the Service of
    the resource `a-prefill`), each pass patching the other's back."""
    with pytest.raises(SpecError, match=rf"metadata\.name: must not end in {suffix}: .*'a'"):
        Identity(name=f"a{suffix}", namespace="ml", uid="u")
    # Only as a suffix: inside a name it collides with nothing.
    assert Identity(name=f"a{suffix}-x", namespace="ml", uid="u")


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"requests": {"cpu": "lots"}}, "spec.redis.dev.resources.requests.cpu"),
        ({"claims": []}, "spec.redis.dev.resources.claims"),
    ],
)
def test_invalid_dev_redis_resources_are_named(resources: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_with(MINIMAL_SPEC, "redis.dev.resources", resources))
    assert info.value.field == field
