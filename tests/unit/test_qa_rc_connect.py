"""QA (Redis Cluster / Sentinel URLs): malformed URLs, start errors said in one line."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.sentinel import MasterNotFoundError

from orchestrator.store.connect import RedisUrlError, _cluster_start_error, parse, sync_client


def test_an_unparsable_cluster_url_is_a_redis_url_error_that_hides_its_password() -> None:
    with pytest.raises(RedisUrlError) as caught:
        parse("redis+cluster://u:sekret@[::1:27001")
    assert "sekret" not in str(caught.value)


@pytest.mark.parametrize("port", ["0", "99999"])
def test_a_port_out_of_range_is_refused_when_parsed(port: str) -> None:
    with pytest.raises(RedisUrlError, match="out of range"):
        parse(f"redis+cluster://127.0.0.1:{port}")
    with pytest.raises(RedisUrlError, match="out of range"):
        parse(f"redis+sentinel://127.0.0.1:{port}/m")


def test_refused_cluster_credentials_are_an_authentication_error() -> None:
    auth = redis.AuthenticationError("invalid username-password pair")
    wrapped = redis.RedisClusterException("Redis Cluster cannot be connected: invalid …")
    wrapped.__cause__ = auth
    assert isinstance(_cluster_start_error(wrapped), redis.AuthenticationError)


def test_a_node_not_in_cluster_mode_names_the_url_to_use() -> None:
    inner = redis.RedisClusterException("Cluster mode is not enabled on this node")
    outer = redis.RedisClusterException(
        "Redis Cluster cannot be connected. Please provide at least one reachable node: "
        "Cluster mode is not enabled on this node"
    )
    outer.__cause__ = inner
    err = _cluster_start_error(outer)
    assert isinstance(err, redis.ResponseError)
    assert "redis://" in str(err)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_sentinel_answering_is_said_in_one_short_line() -> None:
    port = _closed_port()
    client = sync_client(f"redis+sentinel://127.0.0.1:{port}/mymaster", timeout_s=0.5)
    with pytest.raises(MasterNotFoundError) as caught:
        client.ping()
    text = str(caught.value)
    assert f"Sentinel 127.0.0.1:{port}" in text
    assert "ConnectionPool" not in text
    assert len(text) < 300
