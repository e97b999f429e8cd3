"""The one Redis launcher (`orchestrator.store.server.RedisServer`) on real processes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from orchestrator.store.server import RedisServer, RedisServerError

pytestmark = pytest.mark.timeout(60)


def client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2, decode_responses=True)


@pytest.mark.parametrize("appendonly", [True, False], ids=["aof", "no-aof"])
def test_restart_keeps_the_data_only_with_an_aof(tmp_path: Path, appendonly: bool) -> None:
    with RedisServer(tmp_path, appendonly=appendonly) as server:
        port = server.port
        c = client(server)
        try:
            assert c.set("k", "v")
            server.kill()  # a crash, not a clean shutdown
            server.restart()
            assert server.port == port
            assert c.get("k") == ("v" if appendonly else None)
        finally:
            c.close()


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "a") as first:
        second = RedisServer(tmp_path / "b", port=first.port)  # the port is taken
        with pytest.raises(RedisServerError, match="exited"):
            second.start()
        assert not second.running


def test_stop_ends_a_stopped_server_and_is_idempotent(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    server.signal(signal.SIGSTOP)  # hung
    server.stop(grace_s=5)
    assert not server.running
    assert server.process.returncode is not None
    server.stop()
