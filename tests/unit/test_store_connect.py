"""`orchestrator.store.connect.parse`: which Redis a ``--redis`` URL names (pure)."""

from __future__ import annotations

import pytest

from orchestrator.store.connect import RedisUrlError, Target, parse
from orchestrator.store.url import redacted, with_password


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://h:1/2", Target("single", "redis://h:1/2")),
        (
            "rediss://u@h:1/0?ssl_ca_certs=/ca.pem",
            Target("single", "rediss://u@h:1/0?ssl_ca_certs=/ca.pem"),
        ),
        ("unix:///tmp/r.sock", Target("single", "unix:///tmp/r.sock")),
        (
            "redis+cluster://a:1,b:2,[::1]:3",
            Target("cluster", "redis://a:1/0", (("a", 1), ("b", 2), ("::1", 3))),
        ),
        (
            "rediss+cluster://u:p%40w@a:1/0?ssl_ca_certs=/ca.pem",
            Target("cluster", "rediss://u:p%40w@a:1/0?ssl_ca_certs=/ca.pem", (("a", 1),)),
        ),
        (
            "redis+sentinel://s1:26379,s2:26379/main",
            Target("sentinel", "redis://s1:26379/0", (("s1", 26379), ("s2", 26379)), "main"),
        ),
        (
            "rediss+sentinel://u@s1:1/main/3",
            Target("sentinel", "rediss://u@s1:1/3", (("s1", 1),), "main"),
        ),
    ],
)
def test_a_url_names_one_server_a_cluster_or_a_sentinel_primary(url: str, target: Target) -> None:
    assert parse(url) == target


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://h:1", "scheme"),
        ("redis+cluster://", "at least one"),
        ("redis+cluster://a", "HOST:PORT"),
        ("redis+cluster://a:x", "HOST:PORT"),
        ("redis+cluster://a:1/2", "database 0"),
        ("redis+sentinel://a:1", "MASTER-NAME"),
        ("redis+sentinel://a:1/m/0/x", "MASTER-NAME"),
    ],
)
def test_a_malformed_url_is_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(RedisUrlError, match=why):
        parse(url)


def test_a_password_folds_into_and_is_masked_in_a_cluster_url() -> None:
    url = with_password("redis+cluster://orch@a:1,b:2", "s3cret")
    assert parse(url).url == "redis://orch:s3cret@a:1/0"
    assert redacted(url) == "redis+cluster://orch:***@a:1,b:2"
    assert "s3cret" not in str(parse(url).nodes)


def test_the_store_parses_replies_with_hiredis() -> None:
    """hiredis is a dependency (``redis[hiredis]``) and redis-py picks it: a store
    connection's reply parser is the C one (the connection is built, not opened)."""
    from redis._parsers.hiredis import _AsyncHiredisParser  # noqa: PLC0415

    from orchestrator.store.connect import open_client  # noqa: PLC0415
    from orchestrator.store.settings import StoreSettings  # noqa: PLC0415

    connected = open_client(StoreSettings(url="redis://127.0.0.1:1/0"))
    connection = connected.client.connection_pool.make_connection()
    assert isinstance(connection._parser, _AsyncHiredisParser)
