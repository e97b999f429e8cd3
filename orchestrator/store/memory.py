"""`MemoryStore`: the store contract (`orchestrator.store.base.Store`) in one process.

For fast, deterministic tests of the control plane: drive, failover, relay, leases and
reapers run against it without a Redis server, and the contract suite
(``tests/contract/test_store.py``) holds it to the same behaviour as `RedisStore`.

How it keeps the contract:

- **Atomicity.** Every call yields to the event loop once on entry (as a network round trip
  would, so concurrent callers really interleave) and then runs its check-and-write without
  awaiting: nothing else runs in between.
- **One lifecycle.** Transitions go through `orchestrator.core.state.apply`, the same table
  the Redis store's Lua is rendered from.
- **Redis's shapes.** A record is kept as Redis keeps it, a hash of strings
  (`RequestRecord.to_fields`), so what a field write stores and what `get` reads back match
  the Redis store exactly, as do the order of checks and the error messages.
- **Time.** TTLs (leases, heartbeats, client attachment, records, journals) expire on an
  injectable clock in seconds (`time.monotonic` by default); `ManualClock` lets a test move
  time forward instead of waiting. ``updated_at`` and `now_ms` are that clock in ms.
- **Replicas and outages.** `peer` is a second client of the same data (another replica);
  `available` and `fail_next` make calls fail with `StoreUnavailableError` before they take
  effect, as an outage of the shared store would, for every client of it; `lose_replies`
  after they took effect (a connection dropped after the command ran). Writes to a record
  wait an outage out as the Redis store's do (`orchestrator.store.outage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from orchestrator import errors
from orchestrator.core.cost import TENANT_FLOAT_FIELDS, TENANT_INT_FIELDS
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import TERMINAL, Edge, State, apply
from orchestrator.store.base import check_settle
from orchestrator.store.outage import outlasting
from orchestrator.store.settings import StoreSettings

Clock = Callable[[], float]
"""Seconds, monotonic."""

_NEVER = math.inf
T = TypeVar("T")


class ManualClock:
    """A clock that moves only when told (`advance`), for tests of TTLs and deadlines."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time only moves forward")
        self.now += seconds


@dataclass
class _Expiring(Generic[T]):
    """A value with a TTL, as a Redis key has."""

    value: T
    expires_at: float = _NEVER


@dataclass
class _Data:
    """The shared state: what a Redis server holds (one per `MemoryStore` and its peers)."""

    clock: Clock
    records: dict[str, _Expiring[dict[str, str]]] = field(default_factory=dict)
    """id -> the record's fields, as the Redis hash holds them."""
    journals: dict[str, _Expiring[list[str]]] = field(default_factory=dict)
    """id -> `JournalEntry` JSON, in order."""
    leases: dict[str, _Expiring[str]] = field(default_factory=dict)
    """id -> the owner holding the lease."""
    clients: dict[str, _Expiring[bool]] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    tenant_live: dict[str, set[str]] = field(default_factory=dict)
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    heartbeats: dict[str, _Expiring[WorkerInfo]] = field(default_factory=dict)
    worker_index: set[str] = field(default_factory=set)
    available: bool = True
    failures_left: int = 0
    lost_replies_left: int = 0

    def live(self, table: dict[str, _Expiring[T]], key: str) -> _Expiring[T] | None:
        """The entry under ``key`` unless its TTL ran out (then it is dropped, as Redis
        drops an expired key)."""
        item = table.get(key)
        if item is not None and item.expires_at <= self.clock():
            del table[key]
            return None
        return item

    def now_ms(self) -> int:
        return int(self.clock() * 1000)


class MemoryStore:
    """The `Store` contract over dicts, for one process (see the module docstring)."""

    def __init__(
        self,
        settings: StoreSettings | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self._settings = settings or StoreSettings(url="memory://")
        self._data = _Data(clock)

    @property
    def settings(self) -> StoreSettings:
        return self._settings

    def peer(self) -> MemoryStore:
        """Another client of the same data (a second orchestrator replica)."""
        twin = MemoryStore(self._settings, clock=self._data.clock)
        twin._data = self._data
        return twin

    # ------------------------------------------------------------------ fault injection

    @property
    def available(self) -> bool:
        """False: every call (of every peer) fails with `UnavailableError` until set back."""
        return self._data.available

    @available.setter
    def available(self, value: bool) -> None:
        self._data.available = value

    def fail_next(self, n: int = 1) -> None:
        """The next ``n`` calls (of any peer) fail with `UnavailableError`, writing nothing."""
        self._data.failures_left = n

    def lose_replies(self, n: int = 1) -> None:
        """The next ``n`` calls (of any peer) take effect but fail with `UnavailableError`,
        as when the connection drops after Redis ran the command: the caller can't tell
        whether its write landed (see `orchestrator.core.records.unjournalled_after`)."""
        self._data.lost_replies_left = n

    @contextlib.asynccontextmanager
    async def _call(self, what: str) -> AsyncIterator[_Data]:
        """One round trip: yield to the loop once, fail if the store is "down", run the
        body (atomic: it never awaits), then fail if the reply is to be lost."""
        await asyncio.sleep(0)
        data = self._data
        if not data.available:
            raise errors.StoreUnavailableError(f"request store unreachable during {what}: down")
        if data.failures_left > 0:
            data.failures_left -= 1
            raise errors.StoreUnavailableError(f"request store unreachable during {what}: injected")
        yield data
        if data.lost_replies_left > 0:
            data.lost_replies_left -= 1
            raise errors.StoreUnavailableError(
                f"request store unreachable during {what}: reply lost"
            )

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        async with self._call("ping"):
            pass

    # ------------------------------------------------------------------------ requests

    async def create(self, record: RequestRecord, tenant_limit: int = 0) -> RequestRecord | None:
        async with self._call("create") as d:
            rid = record.request_id
            existing = d.live(d.records, rid)
            if existing is not None:
                return RequestRecord.from_fields(dict(existing.value))
            if tenant_limit > 0:
                live = d.tenant_live.setdefault(record.tenant, set())
                live &= d.active  # ended, expired or reaped requests no longer count
                if len(live) >= tenant_limit:
                    raise errors.OverloadedError(
                        f"tenant {record.tenant!r} has {len(live)} requests in flight "
                        f"(limit {tenant_limit})",
                        1.0,
                    )
                live.add(rid)
            now = d.clock()
            fields = record.to_fields()
            fields["updated_at"] = str(d.now_ms())
            d.records[rid] = _Expiring(fields, now + self._settings.record_ttl_s)
            d.active.add(rid)
            d.leases[rid] = _Expiring(record.owner, now + self._settings.lease_ttl_s)
            return None

    async def get(self, request_id: str) -> RequestRecord | None:
        async with self._call("get") as d:
            rec = d.live(d.records, request_id)
            return None if rec is None else RequestRecord.from_fields(dict(rec.value))

    async def transition(
        self,
        request_id: str,
        edge: Edge,
        *,
        epoch: int,
        fields: Mapping[str, Any] | None = None,
    ) -> int:
        if fields and {"state", "epoch"} & set(fields):
            raise ValueError("state and epoch are set by the transition itself")
        token = secrets.token_hex(8)  # one for every retry: see `orchestrator.store.outage`

        async def once() -> int:
            return await self._transition(request_id, edge, epoch, fields or {}, token)

        return await outlasting(self._settings.outage_s, f"transition {edge.wire}", once)

    async def _transition(
        self, request_id: str, edge: Edge, epoch: int, fields: Mapping[str, Any], token: str
    ) -> int:
        async with self._call("transition") as d:
            rec = d.live(d.records, request_id)
            if rec is None:
                raise errors.NotFoundError(f"no request {request_id!r}")
            cur = rec.value
            state, cur_epoch = State(cur["state"]), int(cur["epoch"])
            if cur.get("op") == token and (cur["state"], cur_epoch) == (
                str(edge.target),
                epoch + int(edge.rule.bumps_epoch),
            ):
                return cur_epoch  # this very call landed already, its reply was lost
            if cur["epoch"] != str(epoch):
                raise errors.StaleEpochError(
                    f"request {request_id!r}: epoch {epoch} is stale (now {cur_epoch}, {state})"
                )
            try:
                target, new_epoch = apply(edge, state, cur_epoch)
            except errors.InvalidTransitionError as exc:
                raise errors.InvalidTransitionError(
                    f"request {request_id!r} is {state}; cannot {edge.wire} (to {edge.target})"
                ) from exc
            now = str(d.now_ms())
            cur.update(state=str(target), epoch=str(new_epoch), updated_at=now, op=token)
            cur.update({k: str(v) for k, v in fields.items()})
            if target in TERMINAL:
                d.active.discard(request_id)
                d.leases.pop(request_id, None)
            return new_epoch

    async def end(
        self,
        request_id: str,
        edge: Edge,
        *,
        epoch: int,
        tenant: str,
        cost: Mapping[str, Any],
        fields: Mapping[str, Any] | None = None,
    ) -> RequestRecord:
        """The transition, then the cost (only when taken), then the final record."""
        if edge.target not in TERMINAL:
            raise ValueError(f"{edge.wire} does not end a request")
        await self.transition(request_id, edge, epoch=epoch, fields=fields)
        with contextlib.suppress(errors.PdorchError):  # the end is recorded: best effort
            await self.add_tenant_cost(tenant, cost)
        record = await self.get(request_id)
        if record is None:
            raise errors.NotFoundError(f"no request {request_id!r}")
        return record

    async def settle(
        self,
        request_id: str,
        state: State,
        *,
        tenant: str,
        cost: Mapping[str, Any],
        cost_json: str,
        fields: Mapping[str, Any] | None = None,
    ) -> bool:
        check_settle(state, fields)

        async def once() -> bool:
            async with self._call("settle") as d:
                rec = d.live(d.records, request_id)
                if rec is None or State(rec.value["state"]) is not state:
                    return False
                if rec.value.get("cost", "{}") not in ("", "{}"):  # "{}": as created
                    return False
                rec.value.update({k: str(v) for k, v in (fields or {}).items()})
                rec.value["cost"] = cost_json
                return True

        if not await outlasting(self._settings.outage_s, "settle", once):
            return False
        await self.add_tenant_cost(tenant, cost)
        return True

    async def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> None:
        if {"state", "epoch"} & set(fields):
            raise ValueError("state and epoch change only through transition()")

        async def once() -> None:
            async with self._call("set_fields") as d:
                rec = d.live(d.records, request_id)
                if rec is None:
                    raise errors.NotFoundError(f"no request {request_id!r}")
                rec.value.update({k: str(v) for k, v in fields.items()})

        await outlasting(self._settings.outage_s, "set_fields", once)

    async def append(self, request_id: str, epoch: int, entry: JournalEntry) -> int:
        async with self._call("journal append") as d:
            return self._append(d, request_id, epoch, entry)

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        edges = edges or {}
        for edge in edges.values():
            if edge.target in TERMINAL or edge.rule.bumps_epoch:
                raise ValueError(f"a journal write cannot take {edge.wire}")
        out: list[int | errors.PdorchError] = []
        async with self._call("journal append") as d:  # one round trip, like a pipeline
            for i, (rid, epoch, entry) in enumerate(items):
                try:
                    out.append(self._append(d, rid, epoch, entry, edges.get(i)))
                except errors.PdorchError as exc:  # a refusal, answered in its place
                    out.append(exc)
        return out

    def _append(
        self, d: _Data, request_id: str, epoch: int, entry: JournalEntry, edge: Edge | None = None
    ) -> int:
        rec = d.live(d.records, request_id)
        if rec is None:
            raise errors.NotFoundError(f"no request {request_id!r}")
        cur = rec.value
        if cur["epoch"] != str(epoch):
            raise errors.StaleEpochError(f"request {request_id!r}: journal epoch {epoch} is stale")
        if State(cur["state"]) in TERMINAL:
            raise errors.RequestEndedError(f"request {request_id!r} is {cur['state']}")
        end = cur.get("output_tokens", "0")
        if end != str(entry.index):
            raise errors.JournalGapError(
                f"request {request_id!r}: chunk at {entry.index} but journal ends at {end}",
                int(end),
            )
        if edge is not None and cur["state"] != str(edge.target):
            if State(cur["state"]) not in edge.sources:
                raise errors.InvalidTransitionError(
                    f"request {request_id!r} is {cur['state']}; cannot {edge.wire}"
                )
            cur["state"] = str(edge.target)
        journal = d.live(d.journals, request_id) or _Expiring[list[str]]([])
        journal.value.append(entry.to_json())
        journal.expires_at = d.clock() + self._settings.record_ttl_s
        d.journals[request_id] = journal
        count = int(end) + len(entry.token_ids)
        cur.update(output_tokens=str(count), updated_at=str(d.now_ms()))
        return count

    async def journal(self, request_id: str, start: int = 0) -> list[JournalEntry]:
        async with self._call("journal read") as d:
            journal = d.live(d.journals, request_id)
            raw: list[str] = [] if journal is None else journal.value[start:]
            return [JournalEntry.from_json(r) for r in raw]

    # ------------------------------------------------------------------ ownership

    def _holder(self, d: _Data, request_id: str) -> str | None:
        lease = d.live(d.leases, request_id)
        return None if lease is None else lease.value

    async def release_lease(self, request_id: str, owner: str) -> bool:
        async with self._call("lease release") as d:
            if self._holder(d, request_id) != owner:
                return False
            del d.leases[request_id]
            return True

    async def refresh_lease(self, request_id: str, owner: str) -> bool:
        async with self._call("lease refresh") as d:
            return self._refresh(d, request_id, owner)

    def _refresh(self, d: _Data, request_id: str, owner: str) -> bool:
        if self._holder(d, request_id) != owner:
            return False
        d.leases[request_id].expires_at = d.clock() + self._settings.lease_ttl_s
        return True

    async def refresh_leases(
        self, driven: list[tuple[str, int]], owner: str, *, retake: bool = True
    ) -> list[bool]:
        if not driven:
            return []
        async with self._call("lease refresh") as d:
            out = []
            for rid, epoch in driven:
                if self._refresh(d, rid, owner):
                    out.append(True)
                    continue
                rec = d.live(d.records, rid)
                if retake and rec is not None and self._holder(d, rid) is None:
                    cur = rec.value
                    mine = cur.get("owner") == owner and cur["epoch"] == str(epoch)
                    if mine and State(cur["state"]) not in TERMINAL:
                        d.leases[rid] = _Expiring(owner, d.clock() + self._settings.lease_ttl_s)
                        out.append(True)
                        continue
                out.append(False)
            return out

    async def lease_holders(self, request_ids: list[str]) -> list[str | None]:
        if not request_ids:
            return []
        async with self._call("lease holders") as d:
            return [self._holder(d, rid) for rid in request_ids]

    async def take_over(self, request_id: str, owner: str) -> int | None:
        async with self._call("take over") as d:
            rec = d.live(d.records, request_id)
            if rec is None:
                d.active.discard(request_id)
                return None
            cur = rec.value
            state = State(cur["state"])
            if state not in Edge.TAKE_OVER.sources:
                d.active.discard(request_id)
                return None
            if self._holder(d, request_id) is not None:
                return None
            target, epoch = apply(Edge.TAKE_OVER, state, int(cur["epoch"]))
            d.leases[request_id] = _Expiring(owner, d.clock() + self._settings.lease_ttl_s)
            cur.update(state=str(target), epoch=str(epoch), owner=owner, updated_at=str(d.now_ms()))
            return epoch

    async def now_ms(self) -> float:
        async with self._call("time") as d:
            return d.now_ms()

    async def progress(self, request_ids: list[str]) -> dict[str, tuple[State, int, str]]:
        async with self._call("progress") as d:
            out = {}
            for rid in request_ids:
                rec = d.live(d.records, rid)
                if rec is not None:
                    f = rec.value
                    out[rid] = (State(f["state"]), int(f["epoch"]), f.get("updated_at") or "0")
            return out

    async def expire(
        self, request_id: str, state: State, epoch: int, updated_at: str, error: str
    ) -> bool:
        async with self._call("expire") as d:
            rec = d.live(d.records, request_id)
            if rec is None:
                return False
            f = rec.value
            seen = (str(state), str(epoch), updated_at)
            if (f["state"], f["epoch"], f.get("updated_at")) != seen:
                return False
            if State(f["state"]) not in Edge.EXPIRE.sources:
                return False
            target, _ = apply(Edge.EXPIRE, State(f["state"]), int(f["epoch"]))
            f.update(state=str(target), finish_reason="error", error=error)
            d.active.discard(request_id)
            d.leases.pop(request_id, None)
            return True

    async def active(self) -> list[str]:
        async with self._call("active requests") as d:
            return sorted(d.active)

    # ------------------------------------------------------------------ tenants, clients

    async def add_tenant_cost(self, tenant: str, cost: Mapping[str, Any]) -> None:
        async with self._call("tenant cost") as d:
            totals = d.costs.setdefault(tenant, {})
            totals["requests"] = totals.get("requests", 0.0) + 1
            for name in TENANT_FLOAT_FIELDS:
                totals[name] = totals.get(name, 0.0) + float(cost.get(name, 0.0))
            for name in TENANT_INT_FIELDS:
                totals[name] = totals.get(name, 0.0) + int(cost.get(name, 0))

    async def tenant_costs(self) -> dict[str, dict[str, float]]:
        async with self._call("tenant costs") as d:
            return {t: dict(d.costs[t]) for t in sorted(d.costs)}

    async def touch_client(self, request_id: str, ttl_s: float) -> None:
        async with self._call("touch_client") as d:
            d.clients[request_id] = _Expiring(True, d.clock() + ttl_s)

    async def client_attached(self, request_id: str) -> bool:
        async with self._call("client_attached") as d:
            return d.live(d.clients, request_id) is not None

    # ------------------------------------------------------------------------- workers

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        async with self._call("heartbeat") as d:
            d.heartbeats[info.worker_id] = _Expiring(info, d.clock() + ttl_s)
            d.worker_index.add(info.worker_id)

    async def deregister(self, worker_id: str) -> None:
        async with self._call("deregister") as d:
            d.heartbeats.pop(worker_id, None)
            d.worker_index.discard(worker_id)

    async def worker_alive(self, worker_id: str) -> bool:
        async with self._call("worker heartbeat") as d:
            return d.live(d.heartbeats, worker_id) is not None

    async def workers(self) -> list[WorkerInfo]:
        async with self._call("list workers") as d:
            out = []
            for wid in sorted(d.worker_index):
                beat = d.live(d.heartbeats, wid)
                if beat is None:
                    d.worker_index.discard(wid)  # pruned, as the Redis store prunes its index
                else:
                    out.append(beat.value)
            return out

    # ------------------------------------------------------------------ for tests

    def worker_index(self) -> set[str]:
        """The registered-worker index as stored (to check that expired ones are pruned)."""
        return set(self._data.worker_index)

    def force_state(self, request_id: str, state: State) -> None:
        """Put a record in any state, bypassing the lifecycle (a test's raw write)."""
        self._data.records[request_id].value["state"] = str(state)
