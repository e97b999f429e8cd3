"""The store contract as a Redis ACL user holding only `orchestrator.store.acl`'s rules.

Every test of ``test_store`` that takes the ``backend`` fixture runs again here, against a
redis-server started with ``requirepass`` and an ACL user limited to the orchestrator's
minimal rules (commands and key patterns): passing proves the README's ACL is enough. The
worker's and a migration's calls run as their own minimal users, and a client without the
password is refused. Passwords reach redis-server through a config file (mode 0600), never
its arguments.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import subprocess
from collections.abc import Iterator

import pytest
import redis

from orchestrator.store.acl import acl_rules
from orchestrator.store.keys import encode
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.store.server import RedisServer
from orchestrator.store.url import redacted, with_password
from tests.contract import test_store as suite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ADMIN = secrets.token_hex(16)
PASSWORDS = {role: secrets.token_hex(16) for role in ("orchestrator", "worker", "migrate")}
PREFIX = "test"
"""The contract tests' keys are ``test:<test name>:…``; the ACL grants ``test:*``."""


def _config() -> list[str]:
    lines = [f"requirepass {ADMIN}"]
    for role, password in PASSWORDS.items():
        lines.append(f"user {role} on >{password} {acl_rules(role, PREFIX)}")
    return lines


def url_of(server: RedisServer, role: str) -> str:
    return with_password(f"redis://{role}@127.0.0.1:{server.port}/0", PASSWORDS[role])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis-acl"), config=_config(), password=ADMIN)
    s.start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def settings(server: RedisServer, request: pytest.FixtureRequest) -> StoreSettings:
    return StoreSettings(
        url=url_of(server, "orchestrator"),
        prefix=f"{PREFIX}:{encode(request.node.name)}",
        socket_timeout_s=suite.HEALTHY_TIMEOUT_S,
        connect_timeout_s=suite.HEALTHY_TIMEOUT_S,
        record_ttl_s=600,
    )


@pytest.fixture
def backend(settings: StoreSettings) -> suite.Backend:
    return suite.Backend(settings)


# The contract: each test of the suite that takes `backend`, collected here too.
for _name, _test in vars(suite).items():
    if _name.startswith("test_") and "backend" in inspect.signature(_test).parameters:
        globals()[_name] = _test


def test_the_password_never_reaches_redis_servers_arguments(server: RedisServer) -> None:
    argv = " ".join(server.argv)
    assert ADMIN not in argv
    assert all(p not in argv for p in PASSWORDS.values())
    ps = subprocess.run(["ps", "-o", "args=", "-p", str(server.process.pid)],
                        capture_output=True, text=True, check=True, timeout=10).stdout  # fmt: skip
    assert "redis-server" in ps
    assert ADMIN not in ps


def test_a_client_without_the_password_is_refused(server: RedisServer) -> None:
    client = redis.Redis(port=server.port, socket_timeout=2)
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()
    wrong = redis.Redis.from_url(
        with_password(f"redis://orchestrator@127.0.0.1:{server.port}/0", "nope")
    )
    try:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()


def test_the_worker_role_heartbeats_and_nothing_more(server: RedisServer) -> None:
    worker = RedisStore(StoreSettings(url=url_of(server, "worker"), prefix=PREFIX))
    orch = RedisStore(StoreSettings(url=url_of(server, "orchestrator"), prefix=PREFIX))
    info = suite.info("w-acl")

    async def scenario() -> None:
        try:
            await worker.heartbeat(info, 5.0)
            assert [w.worker_id for w in await orch.workers()] == ["w-acl"]
            await worker.deregister("w-acl")
            assert await orch.workers() == []
        finally:
            await worker.close()
            await orch.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    client = redis.Redis.from_url(url_of(server, "worker"), socket_timeout=2)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get(f"{PREFIX}:req:{{r}}")  # a request's record: not the worker's
    finally:
        client.close()


def test_the_migrate_role_keeps_its_migration(server: RedisServer) -> None:
    from orchestrator.migrate.policy import Sample, WindowStats  # noqa: PLC0415
    from orchestrator.migrate.settings import MigrationSettings, Upstreams  # noqa: PLC0415
    from orchestrator.migrate.state import MigrationState  # noqa: PLC0415

    settings = MigrationSettings(
        "acl-test", "canary", Upstreams("http://a", "http://b", "secret-key"), percent=10.0
    )
    sample = Sample(1.0, "r1", "pdorch", "answer", False, 200, False)

    async def scenario() -> None:
        state = MigrationState(url_of(server, "migrate"), "acl-test", prefix=PREFIX)
        try:
            await state.start(settings)
            await state.record([sample], {"pdorch": WindowStats(1, 0, 1, 1, 1, 1)}, 100)
            assert await state.rollback("test", 10.0, WindowStats(1, 1, 1, 1, 1, 1))
            snap = await state.snapshot()
            assert snap.samples == 1
            assert len(snap.rollbacks) == 1
            assert await state.samples()
        finally:
            await state.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    admin = redis.Redis(port=server.port, password=ADMIN, decode_responses=True)
    try:  # the pdorch key never reaches Redis
        keys = admin.keys(f"{PREFIX}:migrate:*")
        dumped = [str(admin.dump(k)) for k in keys]
        assert keys
        assert not any("secret-key" in d for d in dumped)
    finally:
        admin.close()


def test_redis_errors_never_show_the_password(server: RedisServer) -> None:
    url = url_of(server, "orchestrator")
    assert PASSWORDS["orchestrator"] not in redacted(url)
    assert "orchestrator:***@" in redacted(url)
