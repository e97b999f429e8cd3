"""`pdorch migrate`: a proxy that cannot listen leaves the live migration's state alone.

Found by QA: a second `pdorch migrate canary --name chat --percent 100` started by mistake
on the running proxy's port failed with "Address already in use" — after it had written its
settings to Redis, so the running proxy re-read them within a second and sent every request
to pdorch (and status showed the failed proxy's upstreams and limits).
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from orchestrator.migrate import service
from orchestrator.migrate.settings import Limits, MigrationSettings, Upstreams
from orchestrator.migrate.state import MigrationState

pytestmark = pytest.mark.slow  # the redis_url fixture starts a redis-server


def _settings(percent: float, existing: str, listen: str) -> MigrationSettings:
    return MigrationSettings(
        name="chat",
        mode="canary",
        upstreams=Upstreams(existing=existing, pdorch="http://127.0.0.1:2"),
        percent=percent,
        limits=Limits(max_error_rate=0.5),
        listen=listen,
    )


def test_a_proxy_whose_port_is_taken_does_not_rewrite_the_migration(redis_url: str) -> None:
    async def scenario() -> dict[str, object]:
        state = MigrationState(redis_url, "chat")
        try:
            await state.start(_settings(5.0, "http://127.0.0.1:1", "127.0.0.1:0"))
        finally:
            await state.close()
        with socket.socket() as taken:  # the running proxy's port
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            wrong = _settings(100.0, "http://wrong:3", f"127.0.0.1:{port}")
            with pytest.raises(OSError, match="in use"):
                await service.serve(wrong, redis_url, asyncio.Event())
        return await service.status(redis_url, "chat")

    snap = asyncio.run(scenario())
    assert snap["percent"] == 5.0
    assert snap["upstreams"] == {"existing": "http://127.0.0.1:1", "pdorch": "http://127.0.0.1:2"}
    assert snap["limits"]["max_error_rate"] == 0.5  # type: ignore[index]


def test_a_password_in_an_upstream_url_is_not_kept_in_redis(redis_url: str) -> None:
    """`pdorch migrate status` (and the report) print the upstreams stored in Redis."""

    async def scenario() -> dict[str, object]:
        state = MigrationState(redis_url, "chat")
        settings = MigrationSettings(
            name="chat",
            mode="shadow",
            upstreams=Upstreams(
                existing="http://admin:hunter2@vllm:8000/v1", pdorch="https://u:s3cret@pdorch"
            ),
        )
        try:
            await state.start(settings)
        finally:
            await state.close()
        return await service.status(redis_url, "chat")

    snap = asyncio.run(scenario())
    text = service.format_status(snap)
    for shown in (str(snap), text):
        assert "hunter2" not in shown
        assert "s3cret" not in shown
    assert snap["upstreams"] == {
        "existing": "http://admin:***@vllm:8000",
        "pdorch": "https://u:***@pdorch",
    }
