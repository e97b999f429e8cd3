"""Make the cluster match a rendered service, read back its readiness, tear it down.

Level-triggered and idempotent: each pass renders the whole service from the spec, creates
what is missing, patches what drifted (`drift`), deletes what the spec no longer renders
(`prune`), then computes the status from what the API reports. Running it twice, or
concurrently with a hand edit, converges. Children are found by name (`naming`) and touched
only when their owner reference names this resource.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.operator import health, naming
from orchestrator.operator.drift import drifted, owned_by, patch_for
from orchestrator.operator.errors import ForeignObjectError, ObjectConflictError, SpecError
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.naming import Identity, Ref
from orchestrator.operator.render import child_refs, render
from orchestrator.operator.spec import TLS_COMPONENTS, ServiceSpec, parse_spec

CREATED, PATCHED, UNCHANGED, TERMINATING = "created", "patched", "unchanged", "terminating"
FOREIGN = "foreign"  # a child's name is taken by an object this resource does not control


@dataclass(frozen=True)
class Outcome:
    actions: Mapping[str, str]  # "Kind/name" → created | patched | unchanged | … | foreign
    pruned: tuple[str, ...]

    def changes(self) -> dict[str, str]:
        return {k: v for k, v in self.actions.items() if v not in (UNCHANGED, FOREIGN)}

    def foreign(self) -> list[str]:
        return [k for k, v in self.actions.items() if v == FOREIGN]


async def reconcile(
    client: KubeClient,
    identity: Identity,
    raw_spec: Mapping[str, Any],
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> tuple[dict[str, Any], Outcome | None]:
    """One full pass; returns the status to write and what was changed (None: the spec is
    invalid, nothing was applied, the status says why)."""
    try:
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        status = health.invalid_spec(str(exc), identity.generation, previous_conditions, now)
        return status, None
    outcome = await apply(client, identity, render(identity, spec))
    status = await observe(client, identity, spec, previous_conditions, now, outcome.foreign())
    return status, outcome


async def apply(
    client: KubeClient, identity: Identity, objects: Sequence[dict[str, Any]]
) -> Outcome:
    actions: dict[str, str] = {}
    for obj in objects:
        try:
            actions[str(Ref.of(obj))] = await apply_one(client, identity, obj)
        except ForeignObjectError:  # leave it alone; apply the rest; the status says so
            actions[str(Ref.of(obj))] = FOREIGN
    pruned = await prune(client, identity, {Ref.of(obj) for obj in objects})
    return Outcome(actions=actions, pruned=tuple(pruned))


async def apply_one(client: KubeClient, identity: Identity, desired: dict[str, Any]) -> str:
    ref = Ref.of(desired)
    live = await client.get(ref)
    if live is None:
        try:
            await client.create(desired)
        except ObjectConflictError:  # created since our get (a concurrent pass, a person)
            live = await client.get(ref)
            if live is None:
                raise
        else:
            return CREATED
    if not owned_by(live, identity.uid):
        raise ForeignObjectError(f"{ref} exists and is not controlled by {identity.name}")
    if live.get("metadata", {}).get("deletionTimestamp"):
        return TERMINATING  # being deleted: the next pass creates it again
    if drifted(desired, live):
        await client.patch(ref, patch_for(desired, live))
        return PATCHED
    return UNCHANGED


async def prune(client: KubeClient, identity: Identity, keep: set[Ref]) -> list[str]:
    """Delete children the spec no longer renders (e.g. the dev Redis after a switch to
    a Secret's URL)."""
    pruned = []
    for ref in child_refs(identity):
        if ref not in keep and await _delete_if_owned(client, identity, ref):
            pruned.append(str(ref))
    return pruned


async def teardown(client: KubeClient, identity: Identity) -> list[str]:
    """Delete every child, in reverse creation order. Owner references would make the
    garbage collector do this too; doing it here makes deletion finish before the resource
    disappears, and works where no garbage collector runs."""
    deleted = []
    for ref in reversed(child_refs(identity)):
        if await _delete_if_owned(client, identity, ref):
            deleted.append(str(ref))
    return deleted


async def observe(
    client: KubeClient,
    identity: Identity,
    spec: ServiceSpec,
    previous_conditions: Sequence[Mapping[str, Any]],
    now: str,
    foreign: Sequence[str] = (),
) -> dict[str, Any]:
    n = naming.names(identity)
    ns = identity.namespace

    async def workload(kind: str, name: str, desired: int) -> health.Workload:
        return health.workload_from(await client.get(Ref("apps/v1", kind, ns, name)), desired)

    redis = await workload("StatefulSet", n.redis, 1) if spec.redis.dev is not None else None
    certificates = None
    if spec.tls.mode == "cert-manager":
        certificates = {}
        for component in TLS_COMPONENTS:
            name = naming.certificate(identity, component)
            live = await client.get(Ref("cert-manager.io/v1", "Certificate", ns, name))
            certificates[name] = health.certificate_ready(live)
    return health.assess(
        orchestrator=await workload("Deployment", n.orchestrator, spec.orchestrator.replicas),
        prefill=await workload("Deployment", n.prefill, spec.prefill.replicas),
        decode=await workload("Deployment", n.decode, spec.decode.replicas),
        redis=redis,
        fallback=spec.failover.fallback,
        foreign=foreign,
        certificates=certificates,
        generation=identity.generation,
        previous=previous_conditions,
        now=now,
    )


async def _delete_if_owned(client: KubeClient, identity: Identity, ref: Ref) -> bool:
    live = await client.get(ref)
    if live is None or not owned_by(live, identity.uid):
        return False
    return await client.delete(ref)
