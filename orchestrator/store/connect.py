"""Which Redis a URL names, and a client for it: one server, a Redis Cluster, or the primary
that Sentinel names.

    redis://[USER@]HOST:PORT/DB                        one server (rediss://: TLS; unix://)
    redis+cluster://[USER@]HOST:PORT[,HOST:PORT…]      a Redis Cluster, found from any of
                                                       the nodes listed (rediss+cluster://)
    redis+sentinel://[USER@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]
                                                       the primary the Sentinels call MASTER,
                                                       re-asked after every failover
                                                       (rediss+sentinel://)

Passwords and TLS options are as for one server (`orchestrator.store.url`): the password,
folded in from a file, belongs to the data nodes' user; query options (``ssl_ca_certs``, …)
apply to every node, Sentinels included. Sentinels are reached without a password.

**Why a scheme, not auto-detection.** Detecting a cluster costs a round trip before the
first call, fails while Redis is down (a store must be constructible then: it reports the
outage on its first call), and would make the store's shape depend on which node answered
at start. The scheme says it once; a plain ``redis://`` pointed at a cluster node fails on
its first key of another node with an error that names ``redis+cluster://`` (`MOVED`, see
`orchestrator.store.redis_store`).

`parse` is pure; `open_client` builds redis-py's asyncio client for what it parsed,
`sync_client` a blocking one (for the local cluster's readiness polls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from orchestrator.store.settings import StoreSettings

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
"""Every scheme ``--redis`` takes."""

CLUSTER_RETRIES = 1
"""redis-py's cluster client retries a call that met a dead node once, after refreshing its
slot map: enough to follow a failover that already happened. Longer outages are the store's
to outlast (`orchestrator.store.outage`), so calls still fail promptly."""


class RedisUrlError(ValueError):
    """A Redis URL this module can't use (said without the password)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What a Redis URL names (pure: no connection)."""

    kind: str
    """``single``, ``cluster`` or ``sentinel``."""
    url: str = field(repr=False)  # it may hold the password
    """A one-node URL redis-py parses for the connection options: the whole URL for one
    server; for the others, the first node's, with the user, password and query."""
    nodes: tuple[tuple[str, int], ...] = ()
    """The cluster nodes or Sentinels listed."""
    master: str = ""
    """The Sentinel master's name."""


def parse(url: str) -> Target:
    """The `Target` of ``url``; `RedisUrlError` for a malformed one."""
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise RedisUrlError(f"Redis URL scheme must be one of {', '.join(SCHEMES)}")
    if scheme not in CLUSTER_SCHEMES and scheme not in SENTINEL_SCHEMES:
        return Target("single", url)
    plain = CLUSTER_SCHEMES.get(scheme) or SENTINEL_SCHEMES[scheme]
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": said here, never with the URL itself
        raise RedisUrlError(str(exc)) from None
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(h) for h in hosts.split(",") if h)
    if not nodes:
        raise RedisUrlError("a Redis Cluster or Sentinel URL lists at least one HOST:PORT")
    path = [p for p in parts.path.split("/") if p]
    db = "0"
    master = ""
    if scheme in SENTINEL_SCHEMES:
        if not path or len(path) > 2:
            raise RedisUrlError("a Sentinel URL ends in /MASTER-NAME or /MASTER-NAME/DB")
        master = path[0]
        db = path[1] if len(path) == 2 else "0"
    elif path and path != ["0"]:
        raise RedisUrlError("a Redis Cluster has database 0 only")
    host, port = nodes[0]
    netloc = f"{userinfo}{at}{host}:{port}"
    first = urlunsplit((plain, netloc, f"/{db}", parts.query, ""))
    kind = "sentinel" if scheme in SENTINEL_SCHEMES else "cluster"
    return Target(kind, first, nodes, master)


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise RedisUrlError(f"{text!r} is not HOST:PORT")
    if not 0 < int(port) <= MAX_PORT:
        raise RedisUrlError(f"{text!r}: port out of range 1-{MAX_PORT}")
    return host.strip("[]"), int(port)


MAX_PORT = 65535


@dataclass(slots=True)
class Connected:
    """A client and how to close everything it opened."""

    client: Any
    """redis-py's asyncio `Redis` or `RedisCluster` (only partly typed: Any at this one
    boundary)."""
    cluster: bool
    close: Callable[[], Awaitable[None]]


def open_client(settings: StoreSettings) -> Connected:
    """A client for ``settings.url`` (no connection is made until the first call), with
    the settings' timeouts and connection limits."""
    import redis.asyncio as aioredis  # noqa: PLC0415 - only the store imports redis
    from redis.asyncio.connection import parse_url  # noqa: PLC0415

    target = parse(settings.url)
    timeouts: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
    }
    if target.kind == "single":
        # A blocking pool: redis-py's default pool fails a call at once ("Too many
        # connections") when all are busy, which a few hundred concurrent requests reach.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url,
            max_connections=settings.max_connections,
            timeout=settings.pool_timeout_s,
            decode_responses=True,
            health_check_interval=5,
            **timeouts,
        )
        client = aioredis.Redis.from_pool(pool)  # owns the pool: closes it
        return Connected(client, False, client.aclose)
    if target.kind == "cluster":
        from redis.asyncio.cluster import ClusterNode  # noqa: PLC0415
        from redis.asyncio.retry import Retry  # noqa: PLC0415
        from redis.backoff import ExponentialWithJitterBackoff  # noqa: PLC0415

        cluster = aioredis.RedisCluster.from_url(
            target.url,
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            decode_responses=True,
            # Per node; a call finding every connection busy fails (`MaxConnectionsError`,
            # an outage to the store) rather than waiting, unlike one server's pool.
            max_connections=settings.max_connections,
            retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), CLUSTER_RETRIES),
            **timeouts,
        )
        return Connected(cluster, True, cluster.aclose)
    return _sentinel(target, settings, dict(parse_url(target.url)), timeouts)


def _sentinel(
    target: Target, settings: StoreSettings, options: dict[str, Any], timeouts: dict[str, Any]
) -> Connected:
    import redis.asyncio as aioredis  # noqa: PLC0415
    from redis.asyncio.connection import BlockingConnectionPool, SSLConnection  # noqa: PLC0415
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool  # noqa: PLC0415
    from redis.exceptions import RedisError  # noqa: PLC0415

    class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
        """Sentinel's pool (each new connection asks for the current primary) that waits
        for a free connection, as one server's pool does."""

    options = dict(options)
    for name in ("host", "port"):
        options.pop(name, None)
    tls = options.pop("connection_class", None) is SSLConnection
    tls_options = {k: v for k, v in options.items() if k.startswith("ssl")}
    sentinel = Sentinel(
        list(target.nodes),
        sentinel_kwargs={**timeouts, **tls_options, **({"ssl": True} if tls else {})},
    )
    client = sentinel.master_for(
        target.master,
        redis_class=aioredis.Redis,
        connection_pool_class=BlockingSentinelPool,
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_s,
        decode_responses=True,
        health_check_interval=5,
        ssl=tls,
        **timeouts,
        **options,
    )

    async def close() -> None:
        try:
            await client.aclose()
            await client.connection_pool.disconnect()
        finally:
            with contextlib.suppress(RedisError, OSError):  # closing: nothing left to do
                await sentinel.aclose()

    return Connected(client, False, close)


def sync_client(url: str, timeout_s: float = 1.0) -> Any:
    """A blocking redis-py client for ``url`` (one server, a cluster or a Sentinel primary),
    decoding replies: for tools that poll (the local cluster's readiness checks). Its
    multi-key calls must stay in one slot (a cluster refuses others)."""
    import redis  # noqa: PLC0415 - only the store's side imports redis

    target = parse(url)
    timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if target.kind == "cluster":
        from redis.cluster import ClusterNode  # noqa: PLC0415

        nodes = [ClusterNode(h, p) for h, p in target.nodes]  # type: ignore[no-untyped-call]
        try:  # the client connects here, to learn the slots
            return redis.RedisCluster.from_url(
                target.url, startup_nodes=nodes, decode_responses=True, **timeouts
            )
        except redis.RedisClusterException as exc:
            raise _cluster_start_error(exc) from None
    if target.kind == "sentinel":
        options = redis.connection.parse_url(target.url)  # type: ignore[no-untyped-call]
        auth = {k: options[k] for k in ("username", "password", "db") if k in options}
        sentinel = _sync_sentinel_class()(list(target.nodes), sentinel_kwargs=timeouts, **timeouts)
        return sentinel.master_for(target.master, decode_responses=True, **auth)
    return redis.Redis.from_url(url, decode_responses=True, **timeouts)


def _cluster_start_error(exc: Exception) -> Exception:
    """What redis-py's cluster client failing at start means, as the error a one-server
    client raises for it: refused credentials an `AuthenticationError` (redis-py wraps them
    in "Redis Cluster cannot be connected"), a node not in cluster mode an error reply that
    names the URL to use; anything else as it was."""
    import redis  # noqa: PLC0415

    cause = exc.__cause__
    if (
        isinstance(cause, redis.AuthenticationError)
        or "NOAUTH" in str(exc)
        or ("HELLO must be called with the client already authenticated" in str(exc))
    ):
        return redis.AuthenticationError(str(cause or exc))
    if "Cluster mode is not enabled" in str(exc):
        return redis.ResponseError(
            "not a Redis Cluster (cluster mode is not enabled on this node): "
            "name one server with redis://HOST:PORT/DB"
        )
    return exc


def _sync_sentinel_class() -> type[Any]:
    """redis-py's blocking `Sentinel`, whose "no master found" names each Sentinel by its
    address: redis-py's names it by its client's whole repr (a screenful per Sentinel)."""
    from redis.sentinel import MasterNotFoundError, Sentinel  # noqa: PLC0415

    class ShortSentinel(Sentinel):
        def discover_master(self, service_name: str) -> Any:
            try:
                return super().discover_master(service_name)
            except MasterNotFoundError as exc:
                text = str(exc)
                for node in self.sentinels:
                    kwargs = node.connection_pool.connection_kwargs
                    where = f"Sentinel {kwargs.get('host')}:{kwargs.get('port')}"
                    text = text.replace(str(node), where)
                raise MasterNotFoundError(text) from None

    return ShortSentinel
