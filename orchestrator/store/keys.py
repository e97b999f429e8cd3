"""The store's key layout in Redis: every key name is built here and nowhere else.

The Redis store, the local cluster's readiness checks and the tests that look behind the
store's back all name keys through `Keys`, so a change of layout is an edit of this module.

**No client-chosen string can name another entity's key** (issue 17). Request ids, tenants and
worker ids are client- or peer-chosen; before, ``P:req:{id}`` with ``:journal`` appended made
the request ``V:journal`` *be* request V's journal. Now every such name enters a key only
through `encode` — its UTF-8 bytes percent-encoded, keeping nothing but ``A-Z a-z 0-9 _ . - ~``
— and only inside a Redis Cluster hash tag ``{…}``, with a fixed kind before it and a fixed
suffix (or none) after it. An encoded name holds no ``{``, ``}`` or ``:``, and `Keys` refuses a
prefix with a brace, so a key's first ``{`` and the next ``}`` delimit exactly the encoded
name: (kind, name) ↔ key is one-to-one. Ordinary ids stay readable (``r-1`` is ``r-1``).

``P`` is the configured prefix (`DEFAULT_PREFIX` unless the store's settings say otherwise);
``<r>``, ``<t>``, ``<w>`` are the encoded request id, tenant and worker id:

    P:req:{<r>}             hash   the `RequestRecord`
    P:req:{<r>}:journal     list   `JournalEntry` JSON, contiguous token indices from 0
    P:req:{<r>}:owner       string the owning orchestrator's lease, with a TTL
    P:req:{<r>}:client      string set with a TTL while a client follows the request elsewhere
    P:active                set    record keys of requests not yet ended
    P:tenant:{<t>}:live     set    record keys of the tenant's live requests (only with a limit)
    P:tenant:{<t>}:cost     hash   the tenant's running cost totals
    P:tenants               set    tenants with cost totals (the names themselves: members,
                                   never keys)
    P:workers               set    worker ids that have registered (members)
    P:worker:{<w>}          string `WorkerInfo` JSON, with a TTL: the heartbeat

and, for `pdorch migrate` (`orchestrator.migrate.state`; ``<n>`` the encoded migration name,
an operator's choice, encoded all the same so ``x:window`` is not migration x's window):

    P:migrate:{<n>}             hash    the migration's settings and counters
    P:migrate:{<n>}:rollbacks   list    its rollbacks
    P:migrate:{<n>}:window      hash    the proxy's window statistics
    P:migrate:{<n>}:samples     stream  one sample per answer

**Redis Cluster.** A hash tag makes Redis hash only what is between the braces, so all keys of
one request share a slot (likewise a tenant's two keys); the fixed keys (``P:active``,
``P:tenants``, ``P:workers``) each sit in a slot of their own. What each of the Redis store's
Lua scripts and transactions touches (``R`` = the request's slot, ``T`` = the tenant's,
``A``/``S``/``W`` = the active, tenants and workers sets'; `orchestrator.store.redis_store`):

    script / call         keys                                   slots       on a cluster
    _APPEND               record, journal                        R           works
    _SET                  record                                 R           works
    _REFRESH, _RELEASE    lease                                  R           works
    _TRANSITION           record, active, lease                  R + A       CROSSSLOT
    _TAKEOVER             record, lease, active                  R + A       CROSSSLOT
    _EXPIRE               record, active, lease                  R + A       CROSSSLOT
    _CREATE               record, active, lease, tenant live     R + A + T   CROSSSLOT
    _REFRESH_MANY         lease + record of many requests        R1 + R2 …   CROSSSLOT
    migrate _ROLLBACK     migration hash, its rollbacks          its own     works
    heartbeat, deregister MULTI: worker key + workers set        W + own     CROSSSLOT
    add_tenant_cost       MULTI: tenant cost + tenants set       T + S       CROSSSLOT
    lease_holders,        MGET / pipeline over many requests     many        per-slot split
    workers, progress                                                        (client side)

``tests/contract/test_store_cluster_slots.py`` checks this table against a one-node cluster
(Redis itself refuses what crosses slots). How issue 21 (Redis Cluster) should remove each
CROSSSLOT without a new key layout:

- ``P:active`` out of the scripts: it is an index for reapers, and they already drop a member
  whose record is missing or ended (`_TAKEOVER`'s -1/-3 paths). Add before creating, remove
  after ending (two calls, in that order): a crash between them leaves a stale member the next
  reaper pass removes, never a live request missing from the index. Then `_TRANSITION`,
  `_TAKEOVER`, `_EXPIRE` touch slot R only.
- The tenant limit as a semaphore in slot T: a sorted set of record keys scored by their lease
  deadline (refreshed with the lease), pruned by score, acquired before `_CREATE` and released
  when the request ends or `_CREATE` finds the id taken; `_CREATE` then touches R only.
- `_REFRESH_MANY` grouped by slot (one call per slot, pipelined per node); MGET and the
  pipelines the same (redis-py's cluster client splits them).
- The two MULTI blocks become plain pipelines, the per-entity key written first: the sets
  are indexes whose readers already prune members without a key (`workers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote_from_bytes, unquote_to_bytes

DEFAULT_PREFIX = "pdorch"

EMPTY = "%"
"""The encoding of the empty name: a lone ``%`` is never a percent-escape, so no other name
encodes to it, and the hash tag is never ``{}`` (which Redis would ignore, hashing the key)."""


def encode(name: str) -> str:
    """``name`` as it appears in a key: UTF-8 (lone surrogates kept, ``surrogatepass``) with
    every byte but ``A-Z a-z 0-9 _ . - ~`` as ``%XX``. One-to-one; `decode` inverts it."""
    if not name:
        return EMPTY
    return quote_from_bytes(name.encode("utf-8", "surrogatepass"), safe="")


def decode(encoded: str) -> str:
    """`encode`'s inverse."""
    if encoded == EMPTY:
        return ""
    return unquote_to_bytes(encoded).decode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (each deployment, or each test, may use its own)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            # A brace in the prefix would become the hash tag of every key.
            raise ValueError(f"store key prefix {self.prefix!r} must not contain '{{' or '}}'")

    # ------------------------------------------------------------- one request: slot of {<r>}

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:req:{{{encode(request_id)}}}"

    def request_id(self, record_key: str) -> str | None:
        """The id in a record key (`request`'s inverse); None for any other key."""
        head = f"{self.prefix}:req:{{"
        if not record_key.startswith(head) or not record_key.endswith("}"):
            return None
        inner = record_key[len(head) : -1]
        if "}" in inner:
            return None
        try:
            return decode(inner)
        except UnicodeDecodeError:  # not written by `request`
            return None

    def journal(self, request_id: str) -> str:
        return f"{self.request(request_id)}:journal"

    def lease(self, request_id: str) -> str:
        return f"{self.request(request_id)}:owner"

    def client(self, request_id: str) -> str:
        return f"{self.request(request_id)}:client"

    # -------------------------------------------------------------- one tenant: slot of {<t>}

    def tenant_live(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{{{encode(tenant)}}}:live"

    def tenant_cost(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{{{encode(tenant)}}}:cost"

    # ------------------------------------------------------------------------------ workers

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{{{encode(worker_id)}}}"

    # --------------------------------------------------------- one migration: slot of {<n>}

    def migration(self, name: str) -> str:
        return f"{self.prefix}:migrate:{{{encode(name)}}}"

    def migration_rollbacks(self, name: str) -> str:
        return f"{self.migration(name)}:rollbacks"

    def migration_window(self, name: str) -> str:
        return f"{self.migration(name)}:window"

    def migration_samples(self, name: str) -> str:
        return f"{self.migration(name)}:samples"

    # ---------------------------------------------------------- fixed keys, one slot each

    @property
    def active(self) -> str:
        return f"{self.prefix}:active"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"
