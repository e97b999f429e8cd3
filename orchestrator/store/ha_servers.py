"""Local Redis Cluster and Sentinel setups on loopback, for the tests (and a local try-out).

`LocalRedisCluster` starts ``primaries`` cluster-mode redis-servers (plus ``replicas`` each)
and joins them with ``redis-cli --cluster create``; it returns once every node says
``cluster_state:ok``. `LocalSentinel` starts a primary, its replica and one Sentinel that
watches them. Both give the ``--redis`` URL that names them (`orchestrator.store.connect`)
and let a test kill a primary and wait for the promotion. Production Redis is deployed by
the operator, not here.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from orchestrator.ports import ephemeral_floor, free_port
from orchestrator.store.server import RedisServer, RedisServerError, redis_server_binary

SETUP_TIMEOUT_S = 30.0
"""``redis-cli --cluster create`` waits for the nodes to agree (about a second each round)."""


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass  # a node not answering yet, or down: poll on
        if time.monotonic() > deadline:
            raise RedisServerError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)  # polling a condition with a deadline


SLOTS = 16384
MIN_CREATE_PRIMARIES = 3
"""``redis-cli --cluster create`` refuses fewer primaries; smaller clusters are joined by
hand (`LocalRedisCluster._join_by_hand`), without replicas."""

CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def cluster_port() -> int:
    """A free port whose cluster bus port is free too and below the ephemeral range (where
    an outgoing connection could take it before the node binds it)."""
    for _ in range(200):
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus >= ephemeral_floor():
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", bus))
            except OSError:
                continue
        return port
    raise OSError("no free loopback port pair for a cluster node")


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)


class LocalRedisCluster:
    """A Redis Cluster of ``primaries`` × (1 + ``replicas``) nodes on 127.0.0.1."""

    def __init__(
        self, workdir: Path, *, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 15000
    ) -> None:
        self.workdir = workdir
        self.node_timeout_ms = node_timeout_ms
        """A primary unreachable this long is failed over to its replica (a loaded CI
        machine must not fail one over by mistake: the default is long)."""
        self.replicas = replicas
        if primaries < MIN_CREATE_PRIMARIES and replicas:
            raise RedisServerError(f"replicas need at least {MIN_CREATE_PRIMARIES} primaries")
        self.nodes = [self._node(cluster_port()) for _ in range(primaries * (1 + replicas))]

    def _node(self, port: int) -> RedisServer:
        return RedisServer(
            self.workdir,
            port=port,
            config=(
                "cluster-enabled yes",
                f"cluster-config-file nodes-{port}.conf",
                f"cluster-node-timeout {self.node_timeout_ms}",
            ),
        )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self) -> LocalRedisCluster:
        try:
            for node in self.nodes:
                node.start()
            if len(self.nodes) < MIN_CREATE_PRIMARIES:
                self._join_by_hand()
            else:
                cli = shutil.which("redis-cli") or str(
                    Path(redis_server_binary()).with_name("redis-cli")
                )
                subprocess.run(
                    [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                     "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                    check=True, capture_output=True, timeout=SETUP_TIMEOUT_S,
                )  # fmt: skip
            for node in self.nodes:
                self.wait_ok(node.port)
            # A replica that has not synced once can't be promoted: the failover test
            # must not kill a primary before its replica holds its data.
            _wait(self._replicas_synced, SETUP_TIMEOUT_S, "the replicas to sync")
        except BaseException:
            self.stop()
            raise
        return self

    def _join_by_hand(self) -> None:
        """What ``--cluster create`` does, for the 1 or 2 primaries it refuses: each node
        serves its share of the slots, and they meet."""
        first = self.nodes[0]
        for i, node in enumerate(self.nodes):
            lo = i * SLOTS // len(self.nodes)
            hi = (i + 1) * SLOTS // len(self.nodes) - 1
            with _client(node.port) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                if node is not first:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)

    def wait_ok(self, port: int, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait until the node on ``port`` sees the cluster whole (every slot served)."""

        def ok() -> bool:
            with _client(port) as c:
                info = str(c.execute_command("CLUSTER", "INFO"))
                return "cluster_state:ok" in info and "cluster_slots_ok:16384" in info

        _wait(ok, timeout_s, f"cluster_state:ok on {port}")

    def _replicas_synced(self) -> bool:
        synced = 0
        for node in self.nodes:
            with _client(node.port) as c:
                info = c.info("replication")
            synced += info.get("role") == "slave" and info.get("master_link_status") == "up"
        return synced == len(self.nodes) // (1 + self.replicas) * self.replicas

    def roles(self) -> dict[int, str]:
        """Port -> ``master`` or ``slave``, as the first live node sees the cluster."""
        for node in self.nodes:
            if not node.running:
                continue
            with _client(node.port) as c:
                text = str(c.execute_command("CLUSTER", "NODES"))
            out = {}
            for line in text.splitlines():
                parts = line.split()
                port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                out[port] = "master" if "master" in parts[2] else "slave"
            return out
        raise RedisServerError("no cluster node is running")

    def slot_ranges(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary's port) for every served range, as the first live
        node sees the cluster (``CLUSTER SLOTS``)."""
        for node in self.nodes:
            if not node.running:
                continue
            with _client(node.port) as c:
                rows = c.execute_command("CLUSTER", "SLOTS")
            if isinstance(rows, dict):  # redis-py's parsed form: (lo, hi) -> nodes
                return sorted(
                    (int(lo), int(hi), int(v["primary"][1])) for (lo, hi), v in rows.items()
                )
            return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows)
        raise RedisServerError("no cluster node is running")

    def replica_of(self, primary: RedisServer) -> RedisServer | None:
        """A live replica of ``primary`` (None: it has none)."""
        for node in self.nodes:
            if node is primary or not node.running:
                continue
            with _client(node.port) as c:
                info = c.info("replication")
            if info.get("role") == "slave" and int(info["master_port"]) == primary.port:
                return node
        return None

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def primary_with_replica(self) -> tuple[RedisServer, RedisServer]:
        """A primary and a replica of it (``replicas`` >= 1)."""
        for node in self.nodes:
            with _client(node.port) as c:
                info = c.info("replication")
            if info.get("role") == "slave":
                port = int(info["master_port"])
                return next(n for n in self.nodes if n.port == port), node
        raise RedisServerError("no replica in the cluster")

    def wait_promoted(self, replica: RedisServer, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait until ``replica`` is a primary and the cluster serves every slot again."""

        def promoted() -> bool:
            with _client(replica.port) as c:
                return bool(c.info("replication").get("role") == "master")

        _wait(promoted, timeout_s, f"replica {replica.port} to be promoted")
        self.wait_ok(replica.port, timeout_s)

    def rejoin(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Start every killed node again (on its port and directory: its ``nodes.conf``
        makes it rejoin, as a replica of the primary that took its slots over) and wait
        until the cluster is whole and every replica synced."""
        for node in self.nodes:
            if not node.running:
                node.kill()  # reap
                node.start()
        for node in self.nodes:
            self.wait_ok(node.port, timeout_s)
        _wait(self._replicas_synced, timeout_s, "the replicas to sync")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _SentinelProcess(RedisServer):
    """redis-server in Sentinel mode (its config file is its state: it rewrites it)."""

    @property
    def argv(self) -> list[str]:
        return [redis_server_binary(), str(self.config_path), "--sentinel"]


class LocalSentinel:
    """A primary, one replica of it and one Sentinel (quorum 1) watching them, named
    ``master``; the Sentinel fails the primary over after ``down_after_ms``."""

    MASTER = "pdorch"

    def __init__(self, workdir: Path, *, down_after_ms: int = 1000) -> None:
        self.workdir = workdir
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(
            workdir / "replica", config=(f"replicaof 127.0.0.1 {self.primary.port}",)
        )
        self.down_after_ms = down_after_ms
        self.sentinel = _SentinelProcess(workdir / "sentinel", config=("port 0",))

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.MASTER}"

    def start(self) -> LocalSentinel:
        try:
            self.primary.start()
            self.replica.start()
            _wait(self._synced, SETUP_TIMEOUT_S, "the replica to sync")
            self.sentinel.config = (
                f"port {self.sentinel.port}",
                "bind 127.0.0.1",
                f"dir {self.sentinel.workdir}",
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 1",
                f"sentinel down-after-milliseconds {self.MASTER} {self.down_after_ms}",
                f"sentinel failover-timeout {self.MASTER} 10000",
            )
            self.sentinel.start()
            _wait(self._replica_known, SETUP_TIMEOUT_S, "the Sentinel to find the replica")
        except BaseException:
            self.stop()
            raise
        return self

    def _synced(self) -> bool:
        with _client(self.replica.port) as c:
            return bool(c.info("replication").get("master_link_status") == "up")

    def _replica_known(self) -> bool:
        with _client(self.sentinel.port) as c:
            return len(c.execute_command("SENTINEL", "REPLICAS", self.MASTER)) >= 1

    def replicated(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait until the replica acknowledged every write the primary took (``WAIT``): the
        store itself does not wait for replication (README "Durability, honestly"), so a
        test that kills the primary right after writing would otherwise race the replica."""
        with _client(self.primary.port) as c:
            acked = int(c.execute_command("WAIT", 1, int(timeout_s * 1000)))
        if acked < 1:
            raise RedisServerError(f"the replica did not acknowledge within {timeout_s}s")

    def master_port(self) -> int:
        with _client(self.sentinel.port) as c:
            _host, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)
        return int(port)

    def wait_promoted(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait until the Sentinel names the replica as the primary."""
        _wait(lambda: self.master_port() == self.replica.port, timeout_s, "the failover")

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.primary):
            server.kill()

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
