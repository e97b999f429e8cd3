"""Make the cluster match a rendered service, read back its readiness, tear it down.

Level-triggered and idempotent: each pass renders the whole service from the spec, creates
what is missing, patches what drifted (`drift`), deletes what the spec no longer renders
(`prune`), then computes the status from what the API reports. Running it twice, or
concurrently with a hand edit, converges. Children are found by name (`naming`) and touched
only when their owner reference names this resource.

One object the API server refuses (a 422 for a value the CRD let through, a 403, a 409 that
outlived its retry) does not stop the pass: the rest is applied (render puts the
NetworkPolicies first), and the status says which objects failed and the API's message
(`Reconciled` False). Only an API server that does not answer at all ends the pass early:
nothing else would get through either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.operator import health, naming
from orchestrator.operator.drift import drifted, owned_by, patch_for
from orchestrator.operator.errors import (
    ForeignObjectError,
    KubeApiError,
    KubeUnreachableError,
    ObjectConflictError,
    SpecError,
)
from orchestrator.operator.kube import KubeClient
from orchestrator.operator.naming import Identity, Ref
from orchestrator.operator.render import child_refs, render
from orchestrator.operator.spec import TLS_COMPONENTS, ServiceSpec, parse_spec

CREATED, PATCHED, UNCHANGED, TERMINATING = "created", "patched", "unchanged", "terminating"
FOREIGN = "foreign"  # a child's name is taken by an object this resource does not control


FAILED = "failed"  # the API refused the create, patch or delete: see Outcome.failures


@dataclass(frozen=True)
class Failure:
    """An object the API refused, and what it said."""

    message: str
    transient: bool  # worth trying again soon (a conflict, a busy server)


@dataclass(frozen=True)
class Outcome:
    actions: Mapping[str, str]  # "Kind/name" → created | patched | unchanged | … | failed
    pruned: tuple[str, ...]
    failures: Mapping[str, Failure] = field(default_factory=dict)  # "Kind/name" → why

    def changes(self) -> dict[str, str]:
        return {k: v for k, v in self.actions.items() if v not in (UNCHANGED, FOREIGN, FAILED)}

    def foreign(self) -> list[str]:
        return [k for k, v in self.actions.items() if v == FOREIGN]

    def failed(self) -> dict[str, str]:
        return {k: f.message for k, f in self.failures.items()}

    @property
    def retry_soon(self) -> bool:
        return any(f.transient for f in self.failures.values())


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
    status = await observe(
        client,
        identity,
        spec,
        previous_conditions,
        now,
        outcome.foreign(),
        failed=outcome.failed(),
    )
    return status, outcome


async def apply(
    client: KubeClient, identity: Identity, objects: Sequence[dict[str, Any]]
) -> Outcome:
    """Apply every object, in order, past any the API refuses (recorded in the outcome);
    then prune. Raises only when the API server does not answer."""
    actions: dict[str, str] = {}
    failures: dict[str, Failure] = {}
    for obj in objects:
        key = str(Ref.of(obj))
        try:
            actions[key] = await apply_one(client, identity, obj)
        except ForeignObjectError:  # leave it alone; apply the rest; the status says so
            actions[key] = FOREIGN
        except KubeUnreachableError:
            raise
        except KubeApiError as exc:
            actions[key] = FAILED
            failures[key] = Failure(str(exc), exc.transient)
    pruned = await prune(client, identity, {Ref.of(obj) for obj in objects}, failures)
    return Outcome(actions=actions, pruned=tuple(pruned), failures=failures)


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


async def prune(
    client: KubeClient,
    identity: Identity,
    keep: set[Ref],
    failures: dict[str, Failure] | None = None,
) -> list[str]:
    """Delete children the spec no longer renders (e.g. the dev Redis after a switch to
    a Secret's URL). A refused delete goes into `failures` (when given) and the rest go on."""
    pruned = []
    for ref in child_refs(identity):
        if ref in keep:
            continue
        try:
            if await _delete_if_owned(client, identity, ref):
                pruned.append(str(ref))
        except KubeUnreachableError:
            raise
        except KubeApiError as exc:
            if failures is None:
                raise
            failures[str(ref)] = Failure(str(exc), exc.transient)
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
    *,
    failed: Mapping[str, str] | None = None,
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
        failed=failed or {},
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
