"""A plain ``redis://`` URL naming a Redis Cluster node: refused at start with what to use
instead (`cli.common.check_redis`), and a CROSSSLOT reply met later says the same
(`store.redis_store._translated`) — the orchestrator used to start, print "ready", then
fail every request with a bare "request store error"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis import exceptions as rexc

from orchestrator import errors
from orchestrator.cli import main
from orchestrator.store.redis_store import _translated
from orchestrator.store.server import RedisServer


@pytest.mark.slow  # starts a redis-server
def test_a_plain_url_naming_a_cluster_node_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "none.json"))
    for name in ("PDORCH_REDIS_URL", "PDORCH_REDIS_URL_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = ["cluster-enabled yes", f"cluster-config-file {tmp_path / 'nodes.conf'}"]
    with RedisServer(tmp_path, config=config) as server:
        assert main(["status", "--redis", f"redis://127.0.0.1:{server.port}/0"]) == 1
    err = capsys.readouterr().err
    assert "is a Redis Cluster node: use a redis+cluster://" in err, err


@pytest.mark.parametrize(
    "reply",
    [
        rexc.ClusterCrossSlotError("Keys in request don't hash to the same slot"),
        rexc.MovedError("3999 127.0.0.1:6381"),
    ],
)
def test_a_cluster_nodes_reply_says_to_use_a_cluster_url(reply: Exception) -> None:
    async def main() -> None:
        async with _translated("list workers"):
            raise reply

    with pytest.raises(errors.UnavailableError, match="use a redis\\+cluster:// URL"):
        asyncio.run(main())


def test_a_wrong_scheme_names_the_cluster_and_sentinel_forms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["cost", "--redis", "redis-cluster://127.0.0.1:7000"])
    err = capsys.readouterr().err
    assert "redis+cluster://HOST:PORT" in err
    assert "redis+sentinel://" in err
