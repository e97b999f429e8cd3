"""The store's key layout in Redis: every key name is built here and nowhere else.

The Redis store, the local cluster's readiness checks and the tests that look behind the
store's back all name keys through `Keys`, so a change of layout (hash tags for Redis
Cluster, an encoding of ids) is an edit of this one module.

``P`` is the configured prefix (`DEFAULT_PREFIX` unless the store's settings say otherwise):

    P:req:{id}            hash   the `RequestRecord`
    P:req:{id}:journal    list   `JournalEntry` JSON, contiguous token indices from 0
    P:req:{id}:owner      string the owning orchestrator's lease, with a TTL
    P:req:{id}:client     string set with a TTL while a client follows the request elsewhere
    P:active              set    record keys of requests not yet ended
    P:tenant:{t}:live     set    record keys of the tenant's live requests (only with a limit)
    P:tenant:{t}          hash   the tenant's running cost totals
    P:tenants             set    tenants with cost totals
    P:workers             set    worker ids that have registered
    P:worker:{id}         string `WorkerInfo` JSON, with a TTL: the heartbeat
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pdorch"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (each deployment, or each test, may use its own)."""

    prefix: str = DEFAULT_PREFIX

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def request_id(self, record_key: str) -> str | None:
        """The id in a record key (`request`'s inverse); None for any other key."""
        head = f"{self.prefix}:req:"
        return record_key[len(head) :] if record_key.startswith(head) else None

    def journal(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:journal"

    def lease(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:owner"

    def client(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:client"

    @property
    def active(self) -> str:
        return f"{self.prefix}:active"

    def tenant_live(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:live"

    def tenant_cost(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"
