"""Request state in Redis: records, atomic transitions, the token journal, worker heartbeats.

Every state change is ONE Lua script that checks the expected state(s) and epoch before it
writes — no read-modify-write from Python — so two orchestrators, or an orchestrator and a
reaper, can never both win. redis-py's `Script` re-loads a script on NOSCRIPT (the script
cache is lost when Redis restarts or fails over).

It meets the store contract, `orchestrator.store.base.Store`. The key layout is
`orchestrator.store.keys`.

Redis errors are translated here: connection problems, timeouts and error replies become
`UnavailableError` with a message that holds none of Redis's text (that goes to the log):
`StoreUnavailableError` for an outage, which writes to a record wait out for
``settings.outage_s`` (`orchestrator.store.outage`); script refusals become
`StaleEpochError`/`InvalidTransitionError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis.exceptions as rexc
from redis.crc import key_slot

from orchestrator import errors
from orchestrator.core.cost import TENANT_FLOAT_FIELDS, TENANT_INT_FIELDS
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import TERMINAL, Edge, State
from orchestrator.store import scripts
from orchestrator.store.base import check_settle
from orchestrator.store.connect import open_client
from orchestrator.store.keys import Keys
from orchestrator.store.lua import PRELUDE
from orchestrator.store.outage import outlasting
from orchestrator.store.pipelining import ScriptPipeline, pipelined
from orchestrator.store.settings import StoreSettings

__all__ = ["RedisStore", "StoreSettings"]

log = logging.getLogger(__name__)

_TERMINAL = frozenset(str(s) for s in TERMINAL)

_OUTAGES = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    OSError,
    rexc.ClusterDownError,  # a slot's primary failed and no replica took over yet
    rexc.TryAgainError,  # a slot being moved
    rexc.ReadOnlyError,  # a primary demoted under a connection made before the failover
    rexc.SlotNotCoveredError,
    rexc.RedisClusterUnreachableError,
)
"""Errors that mean "no answer now", retried by writes (`orchestrator.store.outage`)."""

APPEND_CALL_MAX = 256
"""Chunks per journal script call on one server: a batch's call holds Redis for its
length (each chunk is a few commands inside the script), so a very large batch is split
into calls of this size, pipelined, to keep other clients' latency bounded."""

JOURNAL_KEYS_CACHED = 4096
"""Requests whose journal keys `RedisStore` keeps built (far more than stream at once on a
replica; past it the cache starts again)."""

INDEX_GRACE_S = 60.0
"""How old an index entry whose record is missing must be before a scan drops it. A request
is indexed with (on one server: just before) the creation of its record, so an entry
without a record may be a creation in flight: a create call fails within its timeouts, far
below this."""


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """Redis's errors as `UnavailableError`. The message says only what failed: it reaches
    clients (gRPC details, HTTP bodies, a failed record's ``error``), while Redis's text
    (addresses, WRONGTYPE, script names and lines) goes to this module's log alone."""
    try:
        yield
    except _OUTAGES as exc:
        # BusyLoadingError (a restarted Redis loading its data) is a ConnectionError: an
        # outage too, which writes wait out (`orchestrator.store.outage`); so is a cluster
        # or a Sentinel primary in the middle of a failover.
        log.info("request store unreachable during %s: %s", what, exc)  # callers warn
        raise errors.StoreUnavailableError(f"request store unreachable ({what})") from exc
    except (rexc.MovedError, rexc.ClusterCrossSlotError) as exc:
        # A plain URL naming a cluster node: a key elsewhere (MOVED), or a script's keys
        # in more than one slot (CROSSSLOT).
        log.warning("request store during %s: a Redis Cluster node (%s)", what, exc)
        raise errors.UnavailableError(
            f"request store error ({what}): Redis is a cluster; use a redis+cluster:// URL"
        ) from exc
    except (rexc.RedisError, rexc.RedisClusterException) as exc:
        # An error reply is a bug or tampering, not an outage: loud, with Redis's words.
        log.exception("request store error during %s", what)
        raise errors.UnavailableError(f"request store error ({what})") from exc


def _refused(
    request_id: str, edge: Edge, epoch: int, code: int, res: list[Any]
) -> errors.PdorchError:
    """What a refused transition script's reply (code, state, epoch) means."""
    if code == -1:
        return errors.NotFoundError(f"no request {request_id!r}")
    state, cur_epoch = res[1], res[2]
    if code == -2:
        return errors.StaleEpochError(
            f"request {request_id!r}: epoch {epoch} is stale (now {cur_epoch}, {state})"
        )
    return errors.InvalidTransitionError(
        f"request {request_id!r} is {state}; cannot {edge.wire} (to {edge.target})"
    )


def _check_journal_edge(edge: Edge) -> None:
    """An edge a journal write may take along: one that neither ends the request nor
    reassigns it (those have their own calls: `RedisStore.end`, `RedisStore.transition`)."""
    if edge.target in TERMINAL or edge.rule.bumps_epoch:
        raise ValueError(f"a journal write cannot take {edge.wire}")


def _appended(
    request_id: str, epoch: int, entry: JournalEntry, res: Any, edge: Edge | None = None
) -> int | errors.PdorchError:
    """A `scripts.APPEND` reply: the new output token count, or the refusal it means."""
    code = int(res[0])
    if code == -5:
        wire = edge.wire if edge is not None else "?"
        return errors.InvalidTransitionError(f"request {request_id!r} is {res[1]}; cannot {wire}")
    if code == 1:
        return int(res[1])
    if code == -1:
        return errors.NotFoundError(f"no request {request_id!r}")
    if code == -2:
        return errors.StaleEpochError(f"request {request_id!r}: journal epoch {epoch} is stale")
    if code == -3:
        return errors.RequestEndedError(f"request {request_id!r} is {res[1]}")
    return errors.JournalGapError(
        f"request {request_id!r}: chunk at {entry.index} but journal ends at {res[1]}",
        int(res[1]),
    )


class RedisStore:
    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        connected = open_client(settings)  # one server, a cluster or a Sentinel primary
        self._redis: Any = connected.client
        self._cluster = connected.cluster
        self._close = connected.close
        self._pipeline = None if self._cluster else ScriptPipeline(self._redis)
        """A request's own script calls (create, transitions, its end, a journal batch's
        call), each loop turn's sent together (`orchestrator.store.pipelining`); a cluster's
        are sent one by one."""
        self._acquire: Any = self._redis.register_script(PRELUDE + scripts.ACQUIRE)
        self._unindex: Any = self._redis.register_script(PRELUDE + scripts.UNINDEX)
        self._create: Any = self._redis.register_script(PRELUDE + scripts.CREATE)
        self._transition: Any = self._redis.register_script(PRELUDE + scripts.TRANSITION)
        self._end: Any = self._redis.register_script(PRELUDE + scripts.END)
        self._append: Any = self._redis.register_script(PRELUDE + scripts.APPEND)
        self._set: Any = self._redis.register_script(PRELUDE + scripts.SET)
        self._settle: Any = self._redis.register_script(PRELUDE + scripts.SETTLE)
        self._keys = Keys(settings.prefix)
        self._workers = self._keys.workers
        self._active = self._keys.active
        self._refresh: Any = self._redis.register_script(PRELUDE + scripts.REFRESH)
        self._refresh_many: Any = self._redis.register_script(PRELUDE + scripts.REFRESH_MANY)
        self._release: Any = self._redis.register_script(PRELUDE + scripts.RELEASE)
        self._expire: Any = self._redis.register_script(PRELUDE + scripts.EXPIRE)
        self._takeover: Any = self._redis.register_script(PRELUDE + scripts.TAKEOVER)
        self._journal_keys: dict[str, tuple[str, str]] = {}
        """Request id -> (record, journal) keys of the requests journalled lately."""
        self._parsed: dict[str, WorkerInfo] = {}
        """Heartbeat JSON -> WorkerInfo, from the last `workers` call: a heartbeat changes
        once per interval, while `workers` runs for every request (200 parses each)."""

    async def close(self) -> None:
        if self._pipeline is not None:
            await self._pipeline.close()
        await self._close()

    async def _script(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """``script``'s reply, sent with the loop turn's other calls on one server."""
        if self._pipeline is None:
            return await script(keys=keys, args=args)
        return await self._pipeline.call(script, keys, args)

    async def ping(self) -> None:
        async with _translated("ping"):
            await self._redis.ping()

    # ------------------------------------------------------------------------ requests

    async def create(self, record: RequestRecord, tenant_limit: int = 0) -> RequestRecord | None:
        """Create ``record``; if its id exists, return the existing record instead.

        ``tenant_limit`` > 0: refuse (`OverloadedError`) when the record's tenant already has
        that many live requests, on all replicas together (checked and counted atomically)."""
        fields = record.to_fields()
        flat = [x for kv in fields.items() for x in kv]
        rid = record.request_id
        key = self._keys.request(rid)
        counted = False
        # Slot by slot (Redis Cluster: no script crosses slots): the tenant's count (atomic
        # in its own slot), then the index of live requests with the record (one script on
        # one server). What a failure in between leaves is an index entry without a record,
        # which scans drop (`INDEX_GRACE_S`), or a record of a request not admitted (see
        # below).
        if tenant_limit > 0:
            counted = await self._acquire_tenant(record.tenant, key, tenant_limit)
        create_args = [
            self.settings.record_ttl_s,
            record.owner,
            int(self.settings.lease_ttl_s * 1000),
            "1" if tenant_limit > 0 else "",
            *flat,
        ]
        async with _translated("create"):
            if self._cluster:
                # One round trip: both nodes get theirs at once, and a failure of either
                # fails the call: the request is not admitted, and a retry (the same id)
                # indexes it.
                _, res = await self._scripts(
                    [
                        (self._acquire, [self._active], [key, 0, 0]),
                        (self._create, [key, self._keys.lease(rid)], create_args),
                    ]
                )
            else:  # one server: the index and the record in one script (one command)
                res = await self._script(
                    self._create, [key, self._keys.lease(rid), self._active], create_args
                )
        if int(res[0]) == 1:
            return None
        # The id exists: a resubmission. Undo what this call indexed that the existing
        # record doesn't own: the live index (a cluster's, added beside the script) of one
        # that ended; the tenant's count, if this call counted it.
        live = self._cluster and res[2] in _TERMINAL
        if live or counted:
            await self._unindexed(key, record.tenant, counted=counted, grace_s=0, live=live)
        existing = await self.get(record.request_id)
        if existing is None:  # expired between the two calls: treat as a fresh conflict
            raise errors.ConflictError(f"request {record.request_id!r} is being replaced")
        return existing

    async def _acquire_tenant(self, tenant: str, key: str, limit: int) -> bool:
        """Count ``key`` against ``tenant``'s limit, atomically in the tenant's slot;
        whether it was added (False: it was counted already). At the limit, members whose
        requests ended (a replica died before it uncounted them) are dropped and the count
        tried once more; `OverloadedError` if it is still full."""
        inflight = self._keys.tenant_inflight(tenant)
        args = [key, limit, self.settings.record_ttl_s]
        for pruned in (False, True):
            async with _translated("create"):
                res = await self._acquire(keys=[inflight], args=args)
            if int(res[0]) == 1:
                return bool(int(res[1]))
            if pruned or not await self._prune(inflight):
                break
        raise errors.OverloadedError(
            f"tenant {tenant!r} has {int(res[1])} requests in flight (limit {limit})", 1.0
        )

    async def _prune(self, index: str) -> int:
        """Drop from ``index`` the requests that ended or whose record is gone (after
        `INDEX_GRACE_S`); how many were dropped."""
        async with _translated("index scan"):
            members = await self._redis.zrange(index, 0, -1)
            pipe = self._redis.pipeline(transaction=False)
            for key in members:
                pipe.hget(key, "state")
            states = await pipe.execute() if members else []
            dropped = 0
            for key, state in zip(members, states, strict=True):
                if state is None or state in _TERMINAL:
                    grace = 0 if state else int(INDEX_GRACE_S * 1000)
                    dropped += int(await self._unindex(keys=[index], args=[key, grace]))
        return dropped

    async def _unindexed(
        self,
        key: str,
        tenant: str,
        *,
        counted: bool,
        grace_s: float,
        live: bool = True,
        outlast: bool = False,
    ) -> None:
        """Drop a request from the live index (``live``) and, if ``counted``, from its
        tenant's count: after it ended, or when its record is gone (``grace_s``). Best
        effort: the step that ended the request is done, and an entry left behind is dropped
        by the next scan that meets it (a takeover scan, a full tenant). With ``outlast``
        (a request's own end), an outage is waited out as the end itself was."""
        grace = int(grace_s * 1000)
        indexes = [self._active] if live else []
        if counted:
            indexes.append(self._keys.tenant_inflight(tenant))

        async def once() -> None:
            async with _translated("index"):  # both in one round trip (any order is safe)
                await self._scripts([(self._unindex, [i], [key, grace]) for i in indexes])

        try:
            await outlasting(self.settings.outage_s if outlast else 0, "index", once)
        except errors.UnavailableError as exc:
            log.warning("request %s: index not updated, left to the scans: %s", key, exc)

    async def get(self, request_id: str) -> RequestRecord | None:
        async with _translated("get"):
            fields = await self._redis.hgetall(self._keys.request(request_id))
        return RequestRecord.from_fields(fields) if fields else None

    async def transition(
        self,
        request_id: str,
        edge: Edge,
        *,
        epoch: int,
        fields: Mapping[str, Any] | None = None,
    ) -> int:
        """Atomically take ``edge`` if the request is at ``epoch`` in one of the edge's sources;
        the request's epoch afterwards (one more for a reassignment)."""
        if fields and {"state", "epoch"} & set(fields):
            raise ValueError("state and epoch are set by the transition itself")
        flat = [str(x) for kv in (fields or {}).items() for x in kv]
        key = self._keys.request(request_id)
        keys = [key, self._keys.lease(request_id)]
        args = [epoch, edge.wire, secrets.token_hex(8), *flat]  # one token for every retry

        async def once() -> Any:
            async with _translated("transition"):
                return await self._script(self._transition, keys, args)

        res = await outlasting(self.settings.outage_s, f"transition {edge.wire}", once)
        code = int(res[0])
        if code == 1:
            if res[1] in _TERMINAL:  # ended: out of the indexes (after the record, see create)
                await self._unindexed(key, res[3], counted=res[4] == "1", grace_s=0, outlast=True)
            return int(res[2])
        raise _refused(request_id, edge, epoch, code, res)

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
        """A request's end (`Store.end`): on one server ONE `scripts.END` script call — the terminal
        transition, the indexes, the tenant's cost and the final record (before: a
        transition, an index pipeline, a MULTI and a read, four round trips). On a cluster
        (the record's, the indexes' and the tenant's slots differ) it is `transition`,
        `add_tenant_cost` and `get`, slot by slot, as before."""
        if edge.target not in TERMINAL:
            raise ValueError(f"{edge.wire} does not end a request")
        if fields and {"state", "epoch"} & set(fields):
            raise ValueError("state and epoch are set by the transition itself")
        if self._cluster:
            return await self._end_by_slot(request_id, edge, epoch, tenant, cost, fields)
        flat = [str(x) for kv in (fields or {}).items() for x in kv]
        key = self._keys.request(request_id)
        keys = [
            key,
            self._keys.lease(request_id),
            self._active,
            self._keys.tenant_inflight(tenant),
            self._keys.tenant_cost(tenant),
            self._keys.tenants,
        ]
        increments: list[Any] = []
        for name in TENANT_FLOAT_FIELDS:
            increments += (name, repr(float(cost.get(name, 0.0))))
        for name in TENANT_INT_FIELDS:
            increments += (name, int(cost.get(name, 0)))
        token = secrets.token_hex(8)  # one for every retry, as `transition`'s
        args = [epoch, edge.wire, token, tenant, len(TENANT_FLOAT_FIELDS),
                len(TENANT_INT_FIELDS), *increments, *flat]  # fmt: skip

        async def once() -> Any:
            async with _translated("end"):
                return await self._script(self._end, keys, args)

        res = await outlasting(self.settings.outage_s, f"end {edge.wire}", once)
        code = int(res[0])
        if code == 1:
            flat_record = res[1]
            return RequestRecord.from_fields(
                dict(zip(flat_record[::2], flat_record[1::2], strict=True))
            )
        if code == -4:  # the record names another tenant than the caller: the general way
            return await self._end_by_slot(request_id, edge, epoch, tenant, cost, fields)
        raise _refused(request_id, edge, epoch, code, res)

    async def _end_by_slot(
        self,
        request_id: str,
        edge: Edge,
        epoch: int,
        tenant: str,
        cost: Mapping[str, Any],
        fields: Mapping[str, Any] | None,
    ) -> RequestRecord:
        """`end` one slot at a time: the transition (which unindexes), the cost, the read."""
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
        """`Store.settle`: one `scripts.SETTLE` call (the record's slot), then the tenant's."""
        check_settle(state, fields)
        args = [str(state), cost_json, *(str(x) for kv in (fields or {}).items() for x in kv)]

        async def once() -> Any:
            async with _translated("settle"):
                return await self._script(self._settle, [self._keys.request(request_id)], args)

        if not int(await outlasting(self.settings.outage_s, "settle", once)):
            return False
        await self.add_tenant_cost(tenant, cost)
        return True

    async def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> None:
        """Informational fields only (timings, workers); never state or epoch."""
        if {"state", "epoch"} & set(fields):
            raise ValueError("state and epoch change only through transition()")
        flat = [str(x) for kv in fields.items() for x in kv]

        async def once() -> Any:
            async with _translated("set_fields"):
                return await self._script(self._set, [self._keys.request(request_id)], flat)

        found = await outlasting(self.settings.outage_s, "set_fields", once)
        if not int(found):
            raise errors.NotFoundError(f"no request {request_id!r}")

    async def append(self, request_id: str, epoch: int, entry: JournalEntry) -> int:
        """Journal a relayed chunk; returns the new output token count."""
        got = (await self.append_many([(request_id, epoch, entry)]))[0]
        if isinstance(got, errors.PdorchError):
            raise got
        return got

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        """`append` for many chunks in one round trip, each checked on its own and in order
        (``edges``: item -> an edge it takes too, in the same script: `Store.append_many`).

        On one server (or a Sentinel primary) it is ONE script call for the whole batch
        (up to `APPEND_CALL_MAX` chunks a call; more are pipelined): the journal writer's
        group commit then costs a command, not a command per chunk, to pack and parse. On a
        cluster no script may cross slots, so each request's chunks are one call of their
        own, all pipelined (each node gets its share). A script cache lost meanwhile
        (NOSCRIPT) is refilled and the calls it refused are sent again."""
        if not items:
            return []
        edges = edges or {}
        for edge in edges.values():
            _check_journal_edge(edge)
        groups = self._append_groups(items)
        calls = []
        for group in groups:
            keys: list[str] = []
            args: list[Any] = [self.settings.record_ttl_s]
            for i in group:
                rid, epoch, entry = items[i]
                keys += self._append_keys(rid)
                taken = edges.get(i)
                wire = b"" if taken is None else taken.wire.encode()
                # Bytes already: `pipelining.wire` passes them as they are.
                args += (
                    b"%d" % epoch,
                    b"%d" % entry.index,
                    b"%d" % len(entry.token_ids),
                    entry.to_json().encode(),
                    wire,
                )
            calls.append((keys, args))
        async with _translated("journal append"):
            replies = await self._append_calls(calls)
            if all(isinstance(r, _OUTAGES) for r in replies):
                raise replies[0]  # nothing reached: the store is unreachable
        out: list[int | errors.PdorchError] = [0] * len(items)
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, _OUTAGES):
                # A cluster node down, the others up: their calls landed and must be
                # reported so (else their writers take their own landed chunks, seen again,
                # for another writer's); this request's call may have landed or not.
                log.info("request store unreachable during journal append: %s", reply)
                down = errors.StoreUnavailableError("request store unreachable (journal append)")
                for i in group:
                    out[i] = down
                continue
            for k, i in enumerate(group):
                rid, epoch, entry = items[i]
                out[i] = _appended(rid, epoch, entry, reply[2 * k : 2 * k + 2], edges.get(i))
        return out

    def _append_groups(self, items: Sequence[tuple[str, int, JournalEntry]]) -> list[list[int]]:
        """Indexes of ``items`` per script call: in order, at most `APPEND_CALL_MAX` a call;
        on a cluster, one request's chunks a call (its keys share a slot)."""
        if not self._cluster:
            n = len(items)
            return [
                list(range(i, min(i + APPEND_CALL_MAX, n))) for i in range(0, n, APPEND_CALL_MAX)
            ]
        by_request: dict[str, list[int]] = {}
        for i, (rid, _, _) in enumerate(items):
            by_request.setdefault(rid, []).append(i)
        return list(by_request.values())

    async def _append_calls(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """The `scripts.APPEND` calls' replies. On a cluster, one pipeline per node (by the
        client's slot map), all at once: a node that is down fails its own calls only —
        their replies are the outage's exception — while the others' land and are answered
        (one pipeline across the nodes raised for all, the landed ones included). An error
        reply is raised."""
        if not self._cluster or len(calls) == 1:
            return await self._pipelined(calls)
        by_node: dict[str, list[int]] = {}
        for i, (keys, _) in enumerate(calls):
            try:
                node = self._redis.get_node_from_key(keys[0])
            except rexc.SlotNotCoveredError:  # no slot map yet: the client will find it
                node = None
            by_node.setdefault("" if node is None else node.name, []).append(i)
        groups = list(by_node.values())
        got = await asyncio.gather(
            *(self._pipelined([calls[i] for i in group]) for group in groups),
            return_exceptions=True,
        )
        replies: list[Any] = [None] * len(calls)
        for group, result in zip(groups, got, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, _OUTAGES):
                raise result  # an error reply, a cancellation
            for k, i in enumerate(group):
                replies[i] = result if isinstance(result, BaseException) else result[k]
        return replies

    async def _pipelined(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """The calls' replies: one call alone (redis-py reloads a lost script), or
        pipelined — where, after a NOSCRIPT, only the calls it refused are sent again (the
        others were applied: sent twice, they would be refused as gaps). Raises an error
        reply, or the outage that stopped the pipeline."""
        if len(calls) == 1:
            keys, args = calls[0]
            return [await self._script(self._append, keys, args)]
        replies = await pipelined(self._redis, [(self._append, k, a) for k, a in calls])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply  # an error reply: the caller translates it
        return replies

    def _append_keys(self, request_id: str) -> tuple[str, str]:
        """A request's record and journal keys, built once per request (not per chunk: an
        id's encoding was ~2 % of the relay's profile at 50 streams)."""
        keys = self._journal_keys.get(request_id)
        if keys is None:
            if len(self._journal_keys) >= JOURNAL_KEYS_CACHED:
                self._journal_keys.clear()  # ended requests' keys: start again
            record = self._keys.request(request_id)
            keys = self._journal_keys[request_id] = (record, f"{record}:journal")
        return keys

    async def journal(self, request_id: str, start: int = 0) -> list[JournalEntry]:
        async with _translated("journal read"):
            raw = await self._redis.lrange(self._keys.journal(request_id), start, -1)
        return [JournalEntry.from_json(r) for r in raw]

    # ------------------------------------------------------------------ ownership

    async def release_lease(self, request_id: str, owner: str) -> bool:
        """Give up ``owner``'s lease (shutting down): a peer may take the request over now."""
        async with _translated("lease release"):
            return bool(int(await self._release(keys=[self._keys.lease(request_id)], args=[owner])))

    async def refresh_lease(self, request_id: str, owner: str) -> bool:
        """Extend ``owner``'s lease on the request; False if it is no longer the owner."""
        async with _translated("lease refresh"):
            held = await self._refresh(
                keys=[self._keys.lease(request_id)],
                args=[owner, int(self.settings.lease_ttl_s * 1000)],
            )
        return bool(int(held))

    async def refresh_leases(
        self, driven: list[tuple[str, int]], owner: str, *, retake: bool = True
    ) -> list[bool]:
        """`refresh_lease` for many (request id, epoch) in one round trip (a replica's lease
        keeper); with ``retake``, a lapsed lease nobody took is taken again (see the script)."""
        if not driven:
            return []
        args = [owner, int(self.settings.lease_ttl_s * 1000), "1" if retake else "0"]
        # One script per slot on a cluster (scripts can't cross slots), pipelined: redis-py
        # sends each node its share. One script for all on one server.
        groups: dict[int, list[int]] = {}
        for i, (rid, _) in enumerate(driven):
            slot = key_slot(self._keys.request(rid).encode()) if self._cluster else 0
            groups.setdefault(slot, []).append(i)
        calls = [
            (
                self._refresh_many,
                [
                    k
                    for i in ix
                    for k in (self._keys.lease(driven[i][0]), self._keys.request(driven[i][0]))
                ],
                args + [driven[i][1] for i in ix],
            )
            for ix in groups.values()
        ]
        async with _translated("lease refresh"):
            replies = await self._scripts(calls)
        held = [False] * len(driven)
        for ix, reply in zip(groups.values(), replies, strict=True):
            for i, h in zip(ix, reply, strict=True):
                held[i] = bool(int(h))
        return held

    async def _scripts(self, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Each (script, keys, args) run in one pipeline, in order (on a cluster each node
        gets its share); the scripts are loaded and the pipeline sent again if a node lost
        its script cache (NOSCRIPT)."""
        if len(calls) <= 1:
            return [await script(keys=k, args=a) for script, k, a in calls]
        for attempt in range(2):
            pipe = self._redis.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            try:
                return list(await pipe.execute())
            except rexc.NoScriptError:
                if attempt:
                    raise
                for source in {script.script for script, _, _ in calls}:
                    await self._redis.script_load(source)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _mget(self, keys: list[str]) -> list[Any]:
        """MGET, split per slot on a cluster (one pipeline, each node its share)."""
        if self._cluster:
            return list(await self._redis.mget_nonatomic(keys))
        return list(await self._redis.mget(keys))

    async def lease_holders(self, request_ids: list[str]) -> list[str | None]:
        """The owner holding each request's lease, None where it expired (one round trip:
        a reaper checks every live request each second; `take_over` stays the atomic
        check)."""
        if not request_ids:
            return []
        async with _translated("lease holders"):
            return await self._mget([self._keys.lease(r) for r in request_ids])

    async def take_over(self, request_id: str, owner: str) -> int | None:
        """Become the owner of a live request whose lease expired; returns the new epoch."""
        key = self._keys.request(request_id)
        async with _translated("take over"):
            res = await self._takeover(
                keys=[key, self._keys.lease(request_id)],
                args=[owner, int(self.settings.lease_ttl_s * 1000)],
            )
        code = int(res[0])
        if code == -1:  # no record: an expired one, or one being created (the grace)
            await self._unindexed(key, "", counted=False, grace_s=INDEX_GRACE_S)
        elif code == -3:  # ended, and a replica died before it dropped it from the indexes
            await self._unindexed(key, res[2], counted=res[3] == "1", grace_s=0)
        return int(res[1]) if code == 1 else None

    async def now_ms(self) -> float:
        """Redis's clock (the one progress times are written with), in milliseconds."""
        async with _translated("time"):
            seconds, micros = await self._redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def progress(self, request_ids: list[str]) -> dict[str, tuple[State, int, str]]:
        """(state, epoch, updated_at as stored) of each request that still exists."""
        async with _translated("progress"):
            pipe = self._redis.pipeline(transaction=False)
            for rid in request_ids:
                pipe.hmget(self._keys.request(rid), "state", "epoch", "updated_at")
            rows = await pipe.execute()
        return {
            rid: (State(row[0]), int(row[1]), row[2] or "0")
            for rid, row in zip(request_ids, rows, strict=True)
            if row[0] is not None
        }

    async def expire(
        self, request_id: str, state: State, epoch: int, updated_at: str, error: str
    ) -> bool:
        """Fail a request that made no progress since (state, epoch, updated_at) was read."""
        key = self._keys.request(request_id)
        async with _translated("expire"):
            res = await self._expire(
                keys=[key, self._keys.lease(request_id)],
                args=[str(state), str(epoch), updated_at, error],
            )
        if int(res[0]) != 1:
            return False
        await self._unindexed(key, res[1], counted=res[2] == "1", grace_s=0)
        return True

    async def add_tenant_cost(self, tenant: str, cost: Mapping[str, Any]) -> None:
        """Add a finished request's cost to its tenant's running totals."""
        key = self._keys.tenant_cost(tenant)
        async with _translated("tenant cost"):
            # The index and the totals together (a tenant with totals is always indexed):
            # on one server one MULTI; on a cluster (two slots) the index first — a crash
            # before the totals leaves a tenant with none, which `tenant_costs` skips — and
            # the totals one MULTI in the tenant's slot.
            pipe = self._redis.pipeline(transaction=True)
            if self._cluster:
                await self._redis.sadd(self._keys.tenants, tenant)
            else:
                pipe.sadd(self._keys.tenants, tenant)
            pipe.hincrby(key, "requests", 1)
            for name in TENANT_FLOAT_FIELDS:
                pipe.hincrbyfloat(key, name, float(cost.get(name, 0.0)))
            for name in TENANT_INT_FIELDS:
                pipe.hincrby(key, name, int(cost.get(name, 0)))
            await pipe.execute()

    async def tenant_costs(self) -> dict[str, dict[str, float]]:
        """Every tenant's totals: requests, usd, GPU-seconds per pool, transfer."""
        async with _translated("tenant costs"):
            tenants = sorted(await self._redis.smembers(self._keys.tenants))
            out = {}
            for tenant in tenants:
                raw = await self._redis.hgetall(self._keys.tenant_cost(tenant))
                if raw:
                    out[tenant] = {k: float(v) for k, v in raw.items()}
        return out

    async def touch_client(self, request_id: str, ttl_s: float) -> None:
        """A client is attached to the request (following it) for the next ``ttl_s``."""
        async with _translated("touch_client"):
            await self._redis.set(self._keys.client(request_id), "1", px=int(ttl_s * 1000))

    async def client_attached(self, request_id: str) -> bool:
        async with _translated("client_attached"):
            return bool(await self._redis.exists(self._keys.client(request_id)))

    async def active(self) -> list[str]:
        """Ids of requests not yet in a terminal state."""
        async with _translated("active requests"):
            keys = await self._redis.zrange(self._active, 0, -1)
        return sorted(rid for k in keys if (rid := self._keys.request_id(k)) is not None)

    # ------------------------------------------------------------------------- workers

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        # Not a MULTI (two slots): the index's reader prunes an id without a heartbeat, so
        # either order of landing is safe; a heartbeat adds the id again every interval.
        async with _translated("heartbeat"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._keys.worker(info.worker_id), info.to_json(), px=int(ttl_s * 1000))
            pipe.sadd(self._workers, info.worker_id)
            await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        async with _translated("deregister"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(self._keys.worker(worker_id))
            pipe.srem(self._workers, worker_id)
            await pipe.execute()

    async def worker_alive(self, worker_id: str) -> bool:
        async with _translated("worker heartbeat"):
            return bool(await self._redis.exists(self._keys.worker(worker_id)))

    async def workers(self) -> list[WorkerInfo]:
        """Workers whose heartbeat is alive (expired ones are pruned from the index)."""
        async with _translated("list workers"):
            ids = sorted(await self._redis.smembers(self._workers))
            if not ids:
                return []
            values = await self._mget([self._keys.worker(i) for i in ids])
            dead = [i for i, v in zip(ids, values, strict=True) if v is None]
            if dead:
                await self._redis.srem(self._workers, *dead)
        known = self._parsed
        self._parsed = {v: known.get(v) or WorkerInfo.from_json(v) for v in values if v}
        return list(self._parsed.values())
