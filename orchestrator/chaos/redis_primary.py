"""The ``redis:primary`` fault: a Redis Cluster primary SIGKILLed, its replica promoted.

`busiest_primary` (pure) picks the primary holding the most of the run's live request
records: each request's keys share one slot (`orchestrator.store.keys`), so a record's slot
says which primary serves the request's record, journal and lease. `PrimaryKill` does the
I/O: it kills that node, waits for the cluster to promote the replica (``cluster-node-timeout``
and an election later) and, for a heal, starts the killed node again, which rejoins as a
replica of its successor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from redis.crc import key_slot

from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.keys import Keys
from orchestrator.store.server import RedisServer, RedisServerError

PROMOTION_TIMEOUT_S = 30.0
"""The longest wait for the replica's promotion (node timeout + election: seconds)."""


def primary_of(slot: int, ranges: Sequence[tuple[int, int, int]]) -> int | None:
    """The port of the primary serving ``slot`` (``ranges``: (first, last, port))."""
    return next((port for lo, hi, port in ranges if lo <= slot <= hi), None)


def busiest_primary(
    ranges: Sequence[tuple[int, int, int]], record_slots: Mapping[str, int]
) -> tuple[int, tuple[str, ...]]:
    """The primary (port) holding the most of the given records (request id → slot; the
    lowest port on a tie, or with no records), and the requests whose records it holds."""
    held: dict[int, list[str]] = {port: [] for _, _, port in ranges}
    for rid, slot in record_slots.items():
        port = primary_of(slot, ranges)
        if port is not None:
            held[port].append(rid)
    if not held:
        raise ValueError("no slot ranges: the cluster serves nothing")
    port = min(held, key=lambda p: (-len(held[p]), p))
    return port, tuple(sorted(held[port]))


def record_slots(request_ids: Iterable[str], keys: Keys | None = None) -> dict[str, int]:
    """Request id → the slot of its record (and of all its keys)."""
    k = keys or Keys()
    return {rid: key_slot(k.request(rid).encode()) for rid in request_ids}


@dataclass(frozen=True, slots=True)
class Killed:
    primary: RedisServer
    replica: RedisServer | None
    affected: tuple[str, ...]

    def describe(self, live: int) -> str:
        replica = "no replica" if self.replica is None else f"replica :{self.replica.port}"
        return (
            f"primary :{self.primary.port} ({len(self.affected)} of {live} live records; {replica})"
        )


class PrimaryKill:
    """Kills the busiest primary of ``cluster`` and follows its failover."""

    def __init__(self, cluster: LocalRedisCluster) -> None:
        self.cluster = cluster

    def pick(self, live: Iterable[str]) -> tuple[RedisServer, tuple[str, ...]]:
        port, affected = busiest_primary(self.cluster.slot_ranges(), record_slots(live))
        return self.cluster.node(port), affected

    def kill(self, live: Iterable[str]) -> Killed:
        """Blocking (run it in a thread): resolve, find the replica, SIGKILL and reap."""
        primary, affected = self.pick(live)
        replica = self.cluster.replica_of(primary)
        primary.kill()
        return Killed(primary, replica, affected)

    async def promoted(self, killed: Killed) -> None:
        """Wait until the replica is a primary and every slot is served again (raises on
        timeout, or when there is no replica)."""
        if killed.replica is None:
            raise RedisServerError(f"primary :{killed.primary.port} had no replica to promote")
        await asyncio.to_thread(self.cluster.wait_promoted, killed.replica, PROMOTION_TIMEOUT_S)

    async def rejoin(self) -> None:
        """Start the killed node(s) again, as replicas, and wait for the sync."""
        await asyncio.to_thread(self.cluster.rejoin, PROMOTION_TIMEOUT_S)
