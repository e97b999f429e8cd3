"""The request store's contract: what the control plane may rely on, whatever the backend.

Two implementations meet it: `orchestrator.store.redis_store.RedisStore` (Lua scripts in
Redis: shared by every orchestrator replica) and `orchestrator.store.memory.MemoryStore`
(dicts in one process: fast in-process tests of the control plane). One suite checks both:
``tests/contract/test_store.py``.

The rules every implementation keeps:

- **Atomic.** Each method is one indivisible step against the shared state: two callers (two
  replicas, a replica and a reaper) never both win a check-then-write, and a refused call
  writes nothing.
- **Epoch fencing.** A request's epoch grows by one on every reassignment (`Edge.REQUEUE`,
  `Edge.TAKE_OVER`); a transition or journal append carrying another epoch is refused with
  `StaleEpochError`, so a superseded driver or a zombie worker never writes.
- **One lifecycle.** States move only along `orchestrator.core.state.Edge`, exactly as
  `orchestrator.core.state.apply` says; a terminal state removes the request from `active`
  and drops its lease.
- **Errors.** Backend trouble (unreachable, timed out, refused) is `UnavailableError`, raised
  promptly (bounded by the settings' timeouts), never a hang and never a foreign exception;
  an outage (the backend did not answer) is its subclass `StoreUnavailableError`.
- **Outages.** Writes to a request's record (`transition`, `set_fields`) wait an outage out
  for ``settings.outage_s`` before raising `StoreUnavailableError`; a transition retried
  after its reply was lost takes effect once (`orchestrator.store.outage`). Every other
  call fails at once.
  Refusals: `NotFoundError` (no such request), `StaleEpochError`, `InvalidTransitionError`
  and its subclasses `RequestEndedError` and `JournalGapError` (with ``journal_end``),
  `OverloadedError` (a tenant at its limit). ``ValueError`` is a caller's bug (writing
  state or epoch as a plain field).
- **Times.** ``updated_at`` (the progress time the deadline reaper reads) is stamped by the
  store on creation, on every transition and every journal append, on the store's clock
  (`now_ms`), never the caller's. TTLs (leases, heartbeats, client attachment, records)
  expire on that clock too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from orchestrator import errors
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import TERMINAL, Edge, State
from orchestrator.store.settings import StoreSettings


class Store(Protocol):
    """Request records, their lifecycle and token journal, ownership leases, workers."""

    @property
    def settings(self) -> StoreSettings:
        """The settings it runs with (``lease_ttl_s`` paces a replica's lease keeper)."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""
        ...

    async def ping(self) -> None:
        """Return when the store answers; `UnavailableError` otherwise."""
        ...

    # ------------------------------------------------------------------------ requests

    async def create(self, record: RequestRecord, tenant_limit: int = 0) -> RequestRecord | None:
        """Create ``record`` (in its given state and epoch) with a lease for ``record.owner``
        and return None; if its id exists, write nothing and return the existing record (an
        idempotent resubmission: the caller compares ``body_hash``).

        ``tenant_limit`` > 0: refuse with `OverloadedError`, writing nothing, when the
        record's tenant already has that many live requests (across every replica; ended
        and expired ones don't count). Checked and counted atomically with the creation.
        `ConflictError` if the existing record vanished (expired) while being read."""
        ...

    async def get(self, request_id: str) -> RequestRecord | None:
        """The stored record, or None for an unknown (or expired) id."""
        ...

    async def transition(
        self,
        request_id: str,
        edge: Edge,
        *,
        epoch: int,
        fields: Mapping[str, Any] | None = None,
    ) -> int:
        """Atomically take ``edge`` if the request is at ``epoch`` in one of the edge's
        sources, writing ``fields`` (``str()`` of each value) with it; returns the epoch
        afterwards (one more for a reassignment). Checks, in order: `NotFoundError`,
        `StaleEpochError` (epoch differs), `InvalidTransitionError` (state not a source).
        ``ValueError`` when ``fields`` names ``state`` or ``epoch``."""
        ...

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
        """A request's end: `transition` along the terminal ``edge`` (same checks, same
        refusals, same exactly-once retry through an outage; ``ValueError`` for an edge
        that does not end a request) and, only when it is taken, what follows an end — the
        request leaves the live indexes, ``cost`` (`orchestrator.core.cost.cost_fields`) is
        added to ``tenant``'s totals (`add_tenant_cost`), exactly once — and the final
        record, as `get` would read it. On one Redis server one script call, atomically;
        on a cluster one step per slot, in that order."""
        ...

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
        """Price a request whose end another caller recorded (a client's `Cancel` takes
        the terminal transition itself, before the replica driving it can `end` it): when
        the record has ended in ``state`` (a terminal one) and has no ``cost`` field yet,
        set it to ``cost_json`` (and
        ``fields``: timings), then add ``cost`` to ``tenant``'s totals (`add_tenant_cost`).
        Exactly once whoever asks, retries included (the field is the guard); True when
        this call priced it. Two steps: a crash between them leaves the record priced and
        the tenant's totals short by it (never counted twice)."""
        ...

    async def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> None:
        """Write informational fields (timings, workers) of an existing record, unchecked.
        `NotFoundError` for an unknown id; ``ValueError`` for ``state`` or ``epoch`` (those
        change only through `transition`), with nothing written."""
        ...

    async def append(self, request_id: str, epoch: int, entry: JournalEntry) -> int:
        """Journal a relayed chunk and return the new output token count. Accepted only at
        the journal's end (``entry.index == output_tokens``), at the current epoch, of a live
        request. Checks, in order: `NotFoundError`, `StaleEpochError`, `RequestEndedError`
        (terminal), `JournalGapError` (``journal_end`` says where to continue)."""
        ...

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        """`append` for many (request id, epoch, entry) — of one request or many — in one
        round trip: applied in order, each checked exactly as `append` checks it and
        independently of the others (one request's refusal leaves the others' writes).
        ``edges`` (item index -> edge; ``ValueError`` for an edge that ends or reassigns a
        request): that item's request also takes the edge, atomically with the item's
        write — moved to the edge's target if it is in one of its sources, left be if it is
        at the target already (a retried write), else the item is refused with
        `InvalidTransitionError` after the other checks (the decode stream's first chunk
        adopts the KV this way: `Edge.KV_ADOPTED` without a round trip of its own).
        One result per item: the new output token count, or the refusal `append` would
        raise, returned. `UnavailableError` is raised when the store could not be reached;
        any of the items may then have landed or not (a writer resyncs on the
        `JournalGapError` its next write gets). Where only part of it could (a Redis
        Cluster node down, the others up), the items that part holds get
        `StoreUnavailableError` — landed or not, as above — and the others their results."""
        ...

    async def journal(self, request_id: str, start: int = 0) -> list[JournalEntry]:
        """The journal's entries from entry ``start`` (an entry offset, not a token index);
        empty for an unknown id."""
        ...

    # ------------------------------------------------------------------ ownership

    async def release_lease(self, request_id: str, owner: str) -> bool:
        """Drop the lease if ``owner`` holds it (a hand-off: a peer may take over at once);
        whether it did."""
        ...

    async def refresh_lease(self, request_id: str, owner: str) -> bool:
        """Extend ``owner``'s lease by ``settings.lease_ttl_s``; False if it is not the
        holder (expired or taken over)."""
        ...

    async def refresh_leases(
        self, driven: list[tuple[str, int]], owner: str, *, retake: bool = True
    ) -> list[bool]:
        """`refresh_lease` for many (request id, epoch) at once, one result each. With
        ``retake``, a lapsed lease nobody holds is taken again, but only while the record
        still names ``owner`` at that epoch and has not ended (a takeover or hand-off wins)."""
        ...

    async def lease_holders(self, request_ids: list[str]) -> list[str | None]:
        """The owner holding each request's lease, None where none is held (a hint for
        reapers; `take_over` is the atomic check)."""
        ...

    async def take_over(self, request_id: str, owner: str) -> int | None:
        """Become the owner of a live request whose lease lapsed: the `Edge.TAKE_OVER` edge
        (queued, epoch + 1, ``owner`` recorded, lease taken). Returns the new epoch; None
        when the lease is held, the request ended or is unknown (both leave `active`)."""
        ...

    async def now_ms(self) -> float:
        """The store's clock in milliseconds: the one ``updated_at`` is written with."""
        ...

    async def progress(self, request_ids: list[str]) -> dict[str, tuple[State, int, str]]:
        """(state, epoch, ``updated_at`` as stored) of each of the requests that exists."""
        ...

    async def expire(
        self, request_id: str, state: State, epoch: int, updated_at: str, error: str
    ) -> bool:
        """Fail (`Edge.EXPIRE`, ``finish_reason`` "error", ``error``) a request that made no
        progress since `progress` read (state, epoch, updated_at); False, writing nothing,
        when it moved meanwhile or ended."""
        ...

    async def active(self) -> list[str]:
        """Ids of requests not yet in a terminal state, sorted. Every live request is
        listed; on Redis, a request whose end a replica recorded just before it died may
        stay listed until a `take_over` (which answers None for it) drops it."""
        ...

    # ------------------------------------------------------------------ tenants, clients

    async def add_tenant_cost(self, tenant: str, cost: Mapping[str, Any]) -> None:
        """Add a finished request's cost (`orchestrator.core.cost.cost_fields`) to its
        tenant's running totals, atomically."""
        ...

    async def tenant_costs(self) -> dict[str, dict[str, float]]:
        """Every tenant's totals: requests, usd, GPU-seconds per pool, transfer."""
        ...

    async def touch_client(self, request_id: str, ttl_s: float) -> None:
        """A client follows the request (from some replica) for the next ``ttl_s``."""
        ...

    async def client_attached(self, request_id: str) -> bool:
        """Whether a `touch_client` is still within its TTL."""
        ...

    # ------------------------------------------------------------------------- workers

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Publish (or replace) a worker's info, alive for ``ttl_s``."""
        ...

    async def deregister(self, worker_id: str) -> None:
        """Remove a worker at once (it is shutting down); a no-op for an unknown id."""
        ...

    async def worker_alive(self, worker_id: str) -> bool:
        """Whether the worker's heartbeat is within its TTL."""
        ...

    async def workers(self) -> list[WorkerInfo]:
        """Workers with a live heartbeat, by id; expired ones are pruned from the index."""
        ...


def check_settle(state: State, fields: Mapping[str, Any] | None) -> None:
    """`Store.settle`'s arguments, checked alike by every store: ``ValueError`` for a state
    that is not an end, or fields that would set the state, the epoch or the cost."""
    if state not in TERMINAL:
        raise ValueError(f"{state} is not an end")
    if fields and {"state", "epoch", "cost"} & set(fields):
        raise ValueError("settle sets the cost, never state or epoch")
