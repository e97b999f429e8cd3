"""QA pass 2: a Redis that answers with an error reply to the connection's settings (a DB
index it lacks) is said to have refused them, not to "not answer" (`check_redis`), and the
message holds no password. Unreachable stays "does not answer" (test_cli_errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.store.server import RedisServer

SECRET = "qa2-s3cret"

pytestmark = pytest.mark.slow  # starts a redis-server


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "none.json"))
    for name in ("PDORCH_REDIS_URL", "PDORCH_REDIS_URL_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_env")
@pytest.mark.parametrize("command", ["cost", "status"])
def test_a_db_index_redis_refuses_is_a_refusal_not_silence(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with RedisServer(tmp_path, config=[f"requirepass {SECRET}"], password=SECRET) as server:
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/99"
        assert main([command, "--redis", url]) == 1
    err = capsys.readouterr().err
    shown = f"redis://:***@127.0.0.1:{server.port}/99"
    line = (
        f"pdorch {command}: --redis {shown}: Redis refused the connection's settings: "
        "DB index is out of range"
    )
    assert line in err.splitlines(), err
    assert "does not answer" not in err
    assert SECRET not in err
