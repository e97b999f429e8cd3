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
    P:live                  zset   record keys of requests not yet ended -> ms indexed
    P:tenant:{<t>}:inflight zset   record keys of the tenant's live requests -> ms counted
                                   (only with a limit)
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
one request share a slot (likewise a tenant's keys); the fixed keys (``P:live``,
``P:tenants``, ``P:workers``) each sit in a slot of their own. No Lua script or MULTI touches
two slots (issue 21); what each of the Redis store's calls touches (``R`` = the request's
slot, ``T`` = the tenant's, ``L``/``S``/``W`` = the live, tenants and workers indexes';
`orchestrator.store.redis_store`, its scripts `orchestrator.store.scripts`), in the order it
touches them:

    call              steps (each one script or command, one slot)
    create            [limit: ACQUIRE T] → ACQUIRE L + CREATE R (one pipeline)
    transition        TRANSITION R; on an end → UNINDEX L [, UNINDEX T if counted]
    end               one server: END (R, L, T, S in one script); a cluster: transition
                      as above → add_tenant_cost → HGETALL R
    expire            EXPIRE R; when failed → UNINDEX L [, T]
    take_over         TAKEOVER R; ended → UNINDEX L [, T]; no record → UNINDEX L (grace)
    append, set_fields, refresh/release_lease           one script, R (an append's edge
                                                        too: KV_ADOPTED with the chunk)
    refresh_leases    REFRESH_MANY once per slot of the requests given, one pipeline
    lease_holders, workers, progress                    MGET / pipeline split per slot
    add_tenant_cost   SADD S → MULTI on the tenant's cost hash (T)
    heartbeat, deregister                               SET/DEL worker key, SADD/SREM W
                                                        (a pipeline, no MULTI)
    migrate _ROLLBACK migration hash, its rollbacks     its own slot

What is atomic, and why the order keeps the invariants:

- **The live index is written around the record, never in its script.** A request is
  indexed (``L``) in the creation's pipeline — on one server before the record, in order;
  on a cluster at once, the creation failing (not admitted) if either write does, and a
  retry of the same id indexing it again — and unindexed only after its end is recorded.
  So what a crash leaves is an index entry without a live record — which the reapers drop
  (`TAKEOVER` says "ended" or "missing"; a missing record only once its entry is older than
  ``INDEX_GRACE_S``, as it may be a creation in flight) — never an *admitted* live request
  missing from the index (which nobody would take over). Each entry holds the time it was
  indexed.
- **The tenant limit is a counter in the tenant's own slot.** `ACQUIRE` counts and adds in
  one script, so two replicas never both take the last place: live requests never exceed
  the limit. The record carries ``counted``; its end uncounts it. A replica that died
  between an end and the uncount leaves a place taken: the next creation that finds the
  tenant full checks each counted request's record and frees the ended (or long missing)
  ones, then counts again — an undercount for a moment, never an overcount.
- **Worker and tenant indexes** are written in a pipeline; their readers skip an id
  without a heartbeat (pruning it) or a tenant without totals.

``tests/contract/test_store_cluster_slots.py`` runs every call against a one-node cluster
(Redis refuses a script or MULTI that crosses slots), and ``tests/contract/test_store.py``
runs the whole contract on a 3-primary cluster.
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

    def tenant_inflight(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{{{encode(tenant)}}}:inflight"

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
        return f"{self.prefix}:live"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"
