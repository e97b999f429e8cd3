"""Every `RedisStore` call runs on Redis Cluster: no script or MULTI crosses slots.

Issue 17 designed the keys for Redis Cluster (`orchestrator.store.keys`): everything of one
request shares a hash tag. A one-node cluster (``--cluster-enabled yes``, all 16384 slots on
it) refuses a script, MULTI or MGET whose keys hash to different slots (``CROSSSLOT``) exactly
as a real cluster does, so a call that works here touches one slot per script or
transaction. Issue 21 took the fleet-wide indexes out of the scripts (the table in
``keys.py``); the calls that crossed slots before are `WERE_CROSSING`, and run now through
``redis+cluster://`` (a many-request call is split per slot; `test_store.py` runs the
whole contract on a 3-primary cluster).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis

from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import Edge, State
from orchestrator.store.ha_servers import cluster_port
from orchestrator.store.keys import Keys
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.store.server import RedisServer

pytestmark = pytest.mark.timeout(60)

RID = "V:journal"  # a suffix of its own: still one slot with its journal, lease and client key


class ClusterNode(RedisServer):
    """A redis-server in cluster mode; `serve_all_slots` makes it a whole one-node cluster."""

    @property
    def argv(self) -> list[str]:
        conf = self.workdir / f"nodes-{self.port}.conf"
        return [*super().argv, "--cluster-enabled", "yes", "--cluster-config-file", str(conf)]

    def serve_all_slots(self, timeout_s: float = 10.0) -> None:
        with redis.Redis(port=self.port, decode_responses=True) as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            for _ in range(int(timeout_s / 0.02)):
                if "cluster_state:ok" in client.execute_command("CLUSTER", "INFO"):
                    return
                asyncio.run(asyncio.sleep(0.02))  # polling the state, with a deadline
        raise AssertionError("the one-node cluster never reached cluster_state:ok")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterNode]:
    # Its cluster bus (port + 10000) below the ephemeral range too: CI lost a run to an
    # outgoing connection holding it ("Failed listening on port 34072 (cluster)").
    n = ClusterNode(tmp_path_factory.mktemp("cluster"), port=cluster_port())
    n.start()
    try:
        n.serve_all_slots()
        yield n
    finally:
        n.kill()


def _record(rid: str) -> RequestRecord:
    return RequestRecord(rid, State.QUEUED, 1, "b" * 32, 5, 16, 1.0, owner="orch-1")


def _info(wid: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid, role="decode", address="127.0.0.1:1", kv_address="127.0.0.1:2",
        transport="tcp", model="tiny", fingerprint="f", max_context=64, vocab_size=10,
        kv_bytes_per_token=1, kv_capacity_bytes=1,
    )  # fmt: skip


Call = Callable[[RedisStore], Awaitable[object]]

ONE_SLOT: dict[str, Call] = {
    "get": lambda s: s.get(RID),
    "set_fields": lambda s: s.set_fields(RID, {"decode_worker": "w"}),
    "append": lambda s: s.append(RID, 1, JournalEntry(0, (1,), "a")),
    # A pipeline (no MULTI) of one script call per chunk: each call on its own request's
    # slot, so the journal writer's batches of many requests run on a cluster.
    "append_many of two requests": lambda s: s.append_many(
        [(RID, 1, JournalEntry(0, (1,), "a")), ("other", 1, JournalEntry(0, (1,), "a"))]
    ),
    "journal": lambda s: s.journal(RID),
    "refresh_lease": lambda s: s.refresh_lease(RID, "orch-1"),
    "refresh_leases of one request": lambda s: s.refresh_leases([(RID, 1)], "orch-1"),
    "release_lease": lambda s: s.release_lease(RID, "orch-1"),
    "lease_holders of one request": lambda s: s.lease_holders([RID]),
    "progress": lambda s: s.progress([RID, "other"]),
    "touch_client": lambda s: s.touch_client(RID, 5),
    "client_attached": lambda s: s.client_attached(RID),
    "active": lambda s: s.active(),
    "worker_alive": lambda s: s.worker_alive("w1"),
}
"""Calls whose keys share one slot: they ran on a cluster before issue 21."""

WERE_CROSSING: dict[str, Call] = {
    "create": lambda s: s.create(_record("new")),
    "transition": lambda s: s.transition(RID, Edge.AGGREGATE, epoch=1),
    "take_over": lambda s: s.take_over(RID, "orch-2"),
    "expire": lambda s: s.expire(RID, State.QUEUED, 1, "0", "stuck"),
    "refresh_leases of two requests": lambda s: s.refresh_leases([(RID, 1), ("b", 1)], "o"),
    "lease_holders of two requests": lambda s: s.lease_holders([RID, "b"]),
    "add_tenant_cost": lambda s: s.add_tenant_cost("t", {"usd": 1.0}),
    "heartbeat": lambda s: s.heartbeat(_info("w1"), 5),
    "deregister": lambda s: s.deregister("w1"),
    "workers": lambda s: s.workers(),
    "tenant_costs": lambda s: s.tenant_costs(),
    "create with a tenant limit": lambda s: s.create(_record("limited"), tenant_limit=5),
    "transition to an end": lambda s: s.transition(RID, Edge.CANCEL, epoch=1),
    "end": lambda s: s.end(RID, Edge.CANCEL, epoch=1, tenant="", cost={"usd": 1.0}),
    "append_many with an edge": lambda s: s.append_many(
        [(RID, 1, JournalEntry(0, (1,), "a"))], edges={0: Edge.AGGREGATE}
    ),
}
"""Calls that touch a fleet-wide index or many requests: CROSSSLOT before issue 21."""


def _run(node: ClusterNode, call: Call) -> None:
    url = f"redis+cluster://127.0.0.1:{node.port}"
    settings = StoreSettings(url=url, socket_timeout_s=2.0, record_ttl_s=600)
    keys = Keys(settings.prefix)

    async def scenario() -> None:
        store = RedisStore(settings)
        try:
            # The record, as `create` would write it (behind the store's back), so each call
            # finds a live request.
            fields = {**_record(RID).to_fields(), "updated_at": "0"}
            await store._redis.hset(keys.request(RID), mapping=fields)
            await store._redis.set(keys.lease(RID), "orch-1", px=5000)
            await call(store)
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


@pytest.mark.parametrize("name", sorted(ONE_SLOT))
def test_a_call_on_one_requests_keys_runs_on_a_cluster(node: ClusterNode, name: str) -> None:
    _run(node, ONE_SLOT[name])


@pytest.mark.parametrize("name", sorted(WERE_CROSSING))
def test_a_call_that_crossed_slots_runs_on_a_cluster(node: ClusterNode, name: str) -> None:
    _run(node, WERE_CROSSING[name])


def test_a_node_refuses_keys_of_two_slots(node: ClusterNode) -> None:
    """The check is real: two requests' keys in one MGET are refused, one request's are not."""
    keys = Keys()
    with redis.Redis(port=node.port) as client:
        client.mget([keys.request("a"), keys.journal("a"), keys.lease("a"), keys.client("a")])
        with pytest.raises(redis.ResponseError, match="same slot"):  # CROSSSLOT
            client.mget([keys.request("a"), keys.request("b")])
