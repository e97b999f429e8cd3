"""The operator end to end: `pdorch operator` (a real process) against kmock's Kubernetes API
emulator over HTTP on loopback.

The tests act as `kubectl` (apply, edit, delete) and as the cluster's missing controllers:
they set a Deployment's ``status.readyReplicas`` the way the Deployment controller does when
its pods become ready or not (see tests/operator/emulator.py for what kmock does not do).
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import REPO
from tests.operator.emulator import Api, Call, Emulator, wait_for
from tests.operator.test_rbac import allowed

pytestmark = [pytest.mark.operator, pytest.mark.timeout(90)]

NAMESPACE = "pdorch-e2e"
RESYNC_S = 0.5  # the operator's timer; production runs 30 s
CR = "pdorch.io/v1alpha1/disaggregatedservices"
DEPLOYMENTS = "apps/v1/deployments"
STATEFULSETS = "apps/v1/statefulsets"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
NETPOLS = "networking.k8s.io/v1/networkpolicies"
PDBS = "policy/v1/poddisruptionbudgets"
CERTIFICATES = "cert-manager.io/v1/certificates"

Apply = Callable[[str, dict[str, Any]], None]

SPEC: dict[str, Any] = {
    "image": "pdorch:e2e",
    "model": {"name": "tiny"},
    "orchestrator": {"replicas": 1},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "redis": {"dev": {}},
    "transport": {"kind": "tcp"},
}


def children(name: str, *, dev_redis: bool = True) -> list[tuple[str, str]]:
    out = [
        ("v1/serviceaccounts", name),
        (CONFIGMAPS, f"{name}-config"),
        (SERVICES, name),
        (SERVICES, f"{name}-prefill"),
        (SERVICES, f"{name}-decode"),
        (DEPLOYMENTS, f"{name}-orchestrator"),
        (DEPLOYMENTS, f"{name}-prefill"),
        (DEPLOYMENTS, f"{name}-decode"),
        (PDBS, f"{name}-orchestrator"),
        (PDBS, f"{name}-prefill"),
        (PDBS, f"{name}-decode"),
        (NETPOLS, f"{name}-orchestrator"),
        (NETPOLS, f"{name}-workers"),
    ]
    if dev_redis:
        out += [
            (SERVICES, f"{name}-redis"),
            (STATEFULSETS, f"{name}-redis"),
            (NETPOLS, f"{name}-redis"),
        ]
    return out


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    emu = Emulator().start()
    yield emu
    emu.stop()


@pytest.fixture(scope="module")
def operator(emulator: Emulator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    argv = [
        sys.executable, "-m", "orchestrator.cli", "--log-level", "INFO",
        "operator", "--namespace", NAMESPACE, "--server", emulator.url,
        "--resync-interval", str(RESYNC_S),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        text = log.read_text(errors="replace")
        assert rc == 0, f"operator exited with {rc}:\n{text[-3000:]}"
        assert "Traceback" not in text, text[-5000:]


@pytest.fixture
def api(emulator: Emulator, operator: Path) -> Api:
    return Api(emulator.url, NAMESPACE)


@pytest.fixture
def apply(api: Api) -> Iterator[Callable[[str, dict[str, Any]], None]]:
    """Applies resources; deletes them after the test (fewer live resources, fewer timer
    passes loading the emulator)."""
    names: list[str] = []

    def _apply(name: str, spec: dict[str, Any]) -> None:
        create(api, name, spec)
        names.append(name)

    yield _apply
    for name in names:
        if api.get(CR, name) is not None:
            api.delete(CR, name)


def create(api: Api, name: str, spec: dict[str, Any]) -> None:
    """kubectl apply of a new resource; the emulator leaves uid, generation and
    resourceVersion to us."""
    api.create(
        CR,
        {
            "apiVersion": "pdorch.io/v1alpha1",
            "kind": "DisaggregatedService",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "uid": f"uid-{name}",
                "generation": 1,
                "resourceVersion": "1",
            },
            "spec": spec,
        },
    )


def edit_spec(api: Api, name: str, spec_patch: dict[str, Any], generation: int) -> None:
    meta = {"generation": generation, "resourceVersion": str(generation)}
    api.patch(CR, name, {"metadata": meta, "spec": spec_patch})


def set_ready(api: Api, resource: str, name: str, ready: int) -> None:
    """What the Deployment (StatefulSet) controller reports as its pods' readiness changes."""
    api.patch(resource, name, {"status": {"readyReplicas": ready}}, status=True)


def status_of(api: Api, name: str) -> dict[str, Any]:
    obj = api.get(CR, name) or {}
    status: dict[str, Any] = obj.get("status", {})
    return status


def status_where(
    api: Api, name: str, ok: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    status = status_of(api, name)
    return status if ok(status) else None


def condition(status: dict[str, Any], kind: str) -> tuple[str, str] | None:
    for c in status.get("conditions", []):
        if c["type"] == kind:
            return c["status"], c["reason"]
    return None


def all_exist(api: Api, wanted: list[tuple[str, str]]) -> list[dict[str, Any]] | None:
    found = [api.get(resource, name) for resource, name in wanted]
    return [f for f in found if f is not None] if all(found) else None


def orchestrator_args(api: Api, name: str) -> list[str]:
    deployment = api.get(DEPLOYMENTS, f"{name}-orchestrator") or {}
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    return list(containers[0]["args"]) if containers else []


def test_applied_resource_gets_its_children(api: Api, apply: Apply) -> None:
    apply("alpha", SPEC)
    objects = wait_for("every child", lambda: all_exist(api, children("alpha")))
    for obj in objects:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["kind"], owner["controller"]) == (
            "uid-alpha",
            "DisaggregatedService",
            True,
        )
    resource = api.get(CR, "alpha") or {}
    assert "pdorch.io/operator" in resource["metadata"]["finalizers"]
    # No pod is ready yet (nothing runs pods here): the status says so.
    status = wait_for("a status", lambda: status_where(api, "alpha", lambda s: "conditions" in s))
    assert status["mode"] == "unavailable"
    assert condition(status, "Ready") == ("False", "OrchestratorUnavailable")
    assert condition(status, "Degraded") == ("True", "OrchestratorUnavailable")
    assert status["observedGeneration"] == 1


def test_spec_change_patches_children(api: Api, apply: Apply) -> None:
    apply("bravo", SPEC)
    wait_for("every child", lambda: all_exist(api, children("bravo")))
    edit_spec(
        api,
        "bravo",
        {"prefill": {"replicas": 3}, "failover": {"fallback": "fail"}, "logLevel": "DEBUG"},
        generation=2,
    )

    def patched() -> bool:
        prefill = api.get(DEPLOYMENTS, "bravo-prefill") or {}
        config = api.get(CONFIGMAPS, "bravo-config") or {}
        args = orchestrator_args(api, "bravo")
        return (
            prefill.get("spec", {}).get("replicas") == 3
            and args[args.index("--fallback") + 1] == "fail"
            and config.get("data", {}).get("PDORCH_LOG_LEVEL") == "DEBUG"
        )

    wait_for("the children to follow the spec", patched)
    wait_for("observedGeneration 2", lambda: status_of(api, "bravo").get("observedGeneration") == 2)


def test_hand_deleted_or_edited_children_are_repaired(api: Api, apply: Apply) -> None:
    apply("charlie", SPEC)
    wanted = children("charlie")
    wait_for("every child", lambda: all_exist(api, wanted))
    deleted = [
        (DEPLOYMENTS, "charlie-decode"),
        (CONFIGMAPS, "charlie-config"),
        (NETPOLS, "charlie-workers"),
    ]
    for resource, name in deleted:
        # A mark the operator leaves alone on a live object, and a recreated one lacks.
        api.patch(resource, name, {"metadata": {"labels": {"e2e/generation": "old"}}})
        api.delete(resource, name)
    broken = copy.deepcopy(api.get(DEPLOYMENTS, "charlie-orchestrator") or {})
    broken["spec"]["template"]["spec"]["containers"][0]["image"] = "someone-else:latest"
    api.patch(DEPLOYMENTS, "charlie-orchestrator", {"spec": broken["spec"]})

    def repaired() -> bool:
        found = all_exist(api, wanted)
        if not found:
            return False
        recreated = all(
            "e2e/generation" not in (api.get(*ref) or {})["metadata"].get("labels", {})
            for ref in deleted
        )
        orch = api.get(DEPLOYMENTS, "charlie-orchestrator") or {}
        image = orch["spec"]["template"]["spec"]["containers"][0]["image"]
        return recreated and image == "pdorch:e2e"

    wait_for("the children to be recreated and restored", repaired)


def test_pool_without_ready_pods_degrades_and_recovers(api: Api, apply: Apply) -> None:
    apply("delta", SPEC)
    wait_for("every child", lambda: all_exist(api, children("delta")))
    for resource, name in [
        (DEPLOYMENTS, "delta-orchestrator"),
        (DEPLOYMENTS, "delta-prefill"),
        (DEPLOYMENTS, "delta-decode"),
        (STATEFULSETS, "delta-redis"),
    ]:
        set_ready(api, resource, name, 1)

    def status_is(mode: str, degraded: tuple[str, str]) -> dict[str, Any] | None:
        status = status_of(api, "delta")
        ok = status.get("mode") == mode and condition(status, "Degraded") == degraded
        return status if ok else None

    status = wait_for(
        "disaggregated", lambda: status_is("disaggregated", ("False", "AllComponentsReady"))
    )
    assert condition(status, "Ready") == ("True", "Disaggregated")
    assert status["decode"] == {"replicas": 1, "readyReplicas": 1}

    set_ready(api, DEPLOYMENTS, "delta-decode", 0)  # the decode pool's pods went unready
    status = wait_for(
        "degraded, aggregated",
        lambda: status_is("aggregated-fallback", ("True", "DecodePoolUnavailable")),
    )
    assert condition(status, "DecodePoolReady") == ("False", "NoReadyPods")
    assert condition(status, "Ready") == ("True", "AggregatedFallback")
    assert status["decode"] == {"replicas": 1, "readyReplicas": 0}

    set_ready(api, DEPLOYMENTS, "delta-decode", 1)
    wait_for(
        "disaggregated again", lambda: status_is("disaggregated", ("False", "AllComponentsReady"))
    )

    set_ready(api, DEPLOYMENTS, "delta-prefill", 0)
    wait_for(
        "prefill pool down",
        lambda: status_is("aggregated-fallback", ("True", "PrefillPoolUnavailable")),
    )


def test_a_stuck_rollout_is_not_reported_ready(api: Api, apply: Apply) -> None:
    """A spec change whose new pods never become ready (an image typo): the old pods keep
    serving, but the status must not say the new generation is Ready."""
    apply("lima", {**SPEC, "prefill": {"replicas": 2}, "decode": {"replicas": 2}})
    wait_for("every child", lambda: all_exist(api, children("lima")))
    workloads = [
        (DEPLOYMENTS, "lima-orchestrator", 1),
        (DEPLOYMENTS, "lima-prefill", 2),
        (DEPLOYMENTS, "lima-decode", 2),
        (STATEFULSETS, "lima-redis", 1),
    ]
    for resource, name, n in workloads:  # rolled out: what the controllers report
        done = {"observedGeneration": 1, "replicas": n, "readyReplicas": n, "updatedReplicas": n}
        api.patch(resource, name, {"status": done}, status=True)
    wait_for(
        "ready, rolled out",
        lambda: (
            condition(status_of(api, "lima"), "Progressing") == ("False", "RolloutComplete")
            and condition(status_of(api, "lima"), "Ready") == ("True", "Disaggregated")
        ),
    )
    edit_spec(api, "lima", {"image": "pdorch:typo"}, generation=2)

    def image(name: str) -> str:
        pod = (api.get(DEPLOYMENTS, name) or {})["spec"]["template"]["spec"]
        return str(pod["containers"][0]["image"])

    wait_for("the new image", lambda: image("lima-prefill") == "pdorch:typo")
    # New pods in ImagePullBackOff past the deadline; the strategy kept old pods serving.
    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    for _, name, n in workloads[:3]:
        rollout = {
            "observedGeneration": 2,
            "replicas": n + 1 if n == 1 else n,
            "readyReplicas": 1,
            "updatedReplicas": 1,
            "unavailableReplicas": 1,
            "conditions": [stuck],
        }
        api.patch(DEPLOYMENTS, name, {"status": rollout}, status=True)
    status = wait_for(
        "the stuck rollout reported",
        lambda: status_where(
            api, "lima", lambda s: condition(s, "Degraded") == ("True", "RolloutStuck")
        ),
    )
    assert status["observedGeneration"] == 2
    assert status["mode"] == "disaggregated"  # the old pods serve
    assert condition(status, "Ready") == ("False", "RolloutStuck")
    assert condition(status, "Progressing") == ("False", "ProgressDeadlineExceeded")


def test_deleted_resource_takes_its_children_along(api: Api, apply: Apply) -> None:
    apply("echo", SPEC)
    wanted = children("echo")
    wait_for("every child", lambda: all_exist(api, wanted))
    wait_for(
        "the finalizer", lambda: (api.get(CR, "echo") or {}).get("metadata", {}).get("finalizers")
    )
    api.delete(CR, "echo")
    wait_for("the resource to go", lambda: api.get(CR, "echo") is None)
    assert [ref for ref in wanted if api.get(*ref) is not None] == []


def test_switching_to_an_external_redis_prunes_the_dev_one(api: Api, apply: Apply) -> None:
    apply("foxtrot", SPEC)
    wait_for("every child", lambda: all_exist(api, children("foxtrot")))
    wait_for("the dev Redis's counts", lambda: "redis" in status_of(api, "foxtrot"))
    edit_spec(api, "foxtrot", {"redis": {"dev": None, "urlSecret": {"name": "redis"}}}, 2)

    def switched() -> bool:
        gone = all(
            api.get(*ref) is None
            for ref in set(children("foxtrot")) - set(children("foxtrot", dev_redis=False))
        )
        config = (api.get(CONFIGMAPS, "foxtrot-config") or {}).get("data", {})
        decode = api.get(DEPLOYMENTS, "foxtrot-decode") or {}
        pod = decode["spec"]["template"]["spec"]
        from_secret = {"name": "redis-url", "secret": {"secretName": "redis", "items": [
            {"key": "url", "path": "url"}], "defaultMode": 0o440}}  # fmt: skip
        return (
            gone
            and "PDORCH_REDIS_URL" not in config
            and from_secret in pod.get("volumes", [])
            and "redis" not in status_of(api, "foxtrot")  # nothing to count any more
        )

    wait_for("the dev Redis pruned and the Secret used", switched)
    assert all_exist(api, children("foxtrot", dev_redis=False))


def test_cert_manager_tls_renders_certificates_and_switching_it_off_prunes_them(
    api: Api, apply: Apply
) -> None:
    tls = {"mode": "cert-manager", "issuerRef": {"name": "pdorch-ca"}}
    apply("juliet", {**SPEC, "tls": tls})
    certs = [(CERTIFICATES, f"juliet-{c}") for c in ("orchestrator", "prefill", "decode")]
    found = wait_for(
        "every child and Certificate", lambda: all_exist(api, children("juliet") + certs)
    )
    for cert in found[-3:]:
        assert cert["metadata"]["ownerReferences"][0]["uid"] == "uid-juliet"
        assert cert["spec"]["commonName"].startswith("pdorch-")

    def volumes(component: str) -> list[str]:
        deployment = api.get(DEPLOYMENTS, f"juliet-{component}") or {}
        pod = deployment.get("spec", {}).get("template", {}).get("spec", {})
        return [v["name"] for v in pod.get("volumes", [])]

    assert "tls" in volumes("decode")
    # No cert-manager here: nothing issues them, and the status says so.
    degraded = ("True", "CertificatesNotReady")
    wait_for(
        "Degraded: CertificatesNotReady",
        lambda: condition(status_of(api, "juliet"), "Degraded") == degraded,
    )
    for _, name in certs:  # what cert-manager reports once it has issued one
        issued = {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}]}
        api.patch(CERTIFICATES, name, {"status": issued}, status=True)
    wait_for(
        "CertificatesReady",
        lambda: condition(status_of(api, "juliet"), "CertificatesReady") == ("True", "Issued"),
    )
    edit_spec(api, "juliet", {"tls": {"mode": "disabled", "issuerRef": None}}, 2)

    def switched_off() -> bool:
        return (
            all(api.get(*ref) is None for ref in certs)
            and "tls" not in volumes("decode")
            and condition(status_of(api, "juliet"), "CertificatesReady") is None
        )

    wait_for("the Certificates pruned and the keys unmounted", switched_off)


def test_invalid_spec_is_reported_and_nothing_is_applied(api: Api, apply: Apply) -> None:
    apply("golf", {**SPEC, "redis": {}})  # kmock does not enforce the CRD's schema

    def reported(status: dict[str, Any]) -> bool:
        return condition(status, "Degraded") is not None

    status = wait_for("a status", lambda: status_where(api, "golf", reported))
    assert condition(status, "Degraded") == ("True", "InvalidSpec")
    assert "spec.redis" in status["conditions"][0]["message"]
    assert api.get(DEPLOYMENTS, "golf-orchestrator") is None


def test_a_name_ending_in_a_childs_suffix_is_reported_and_nothing_is_applied(
    api: Api, apply: Apply
) -> None:
    """`kilo-redis` would share its Service with the dev Redis of a resource `kilo`."""
    apply("kilo-redis", SPEC)  # kmock does not evaluate the CRD's rule either

    def reported(status: dict[str, Any]) -> bool:
        return condition(status, "Degraded") is not None

    status = wait_for("a status", lambda: status_where(api, "kilo-redis", reported))
    assert condition(status, "Reconciled") == ("False", "InvalidSpec")
    assert "metadata.name: must not end in -redis" in status["conditions"][0]["message"]
    assert api.get(DEPLOYMENTS, "kilo-redis-orchestrator") is None


def test_someone_elses_object_is_left_alone(api: Api, apply: Apply) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "hotel-config"},
        "data": {"k": "v"},
    }
    api.create(CONFIGMAPS, theirs)
    apply("hotel", SPEC)
    foreign = ("True", "ForeignObjects")
    status = wait_for(
        "a foreign-object status",
        lambda: status_where(api, "hotel", lambda s: condition(s, "Degraded") == foreign),
    )
    assert "ConfigMap/hotel-config" in status["conditions"][-1]["message"]
    assert all_exist(api, [c for c in children("hotel") if c[0] != CONFIGMAPS])
    assert (api.get(CONFIGMAPS, "hotel-config") or {}).get("data") == {"k": "v"}


def _rbac_request(call: Call) -> tuple[str, str, str, str] | None:
    """(namespace, group, resource[/subresource], verb) of a resource request, None for
    discovery (which every authenticated client may do)."""
    parts = call.path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = "/".join([rest[0], *rest[2:3]])
    named = len(rest) > 1
    verb = {
        "GET": "watch" if "watch=true" in call.query else ("get" if named else "list"),
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete",
    }[call.method]
    return namespace, group, resource, verb


def test_operator_stays_within_its_namespaced_role(
    api: Api, apply: Apply, emulator: Emulator
) -> None:
    """Every request the operator (kopf and our client) made, including in the tests above,
    is allowed by manifests/operator/role.yaml in its namespace."""
    apply("india", SPEC)
    wait_for("every child", lambda: all_exist(api, children("india")))
    api.delete(CR, "india")
    wait_for("the resource to go", lambda: api.get(CR, "india") is None)
    requests = {
        _rbac_request(call)
        for call in emulator.calls()
        if not call.user_agent.startswith("Python-urllib")
    }
    requests.discard(None)
    assert ("pdorch-e2e", "apps", "deployments", "create") in requests  # the check sees ours
    assert ("pdorch-e2e", "pdorch.io", "disaggregatedservices", "watch") in requests  # and kopf's
    for request in requests:
        assert request is not None
        namespace, group, resource, verb = request
        assert namespace == NAMESPACE, f"cluster-scoped or foreign request: {request}"
        assert allowed(group, resource, verb), f"not in the Role: {request}"
