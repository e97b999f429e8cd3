"""`orchestrator.store.pipelining`: a loop turn's script calls go to Redis as one pipeline,
each caller gets its own reply — against a real `redis-server` on loopback (started here).

Each test runs its scenario under `asyncio.run` with a hard deadline; nothing waits on a
fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.exceptions as rexc

from orchestrator import errors
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import Edge, State
from orchestrator.store import pipelining
from orchestrator.store.connect import open_client
from orchestrator.store.pipelining import ScriptPipeline, exchange, pack, pack_resp
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.store.server import RedisServer

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")

ECHO = "return {KEYS[1], ARGV[1]}"
FAIL = "return redis.error_reply('refused ' .. ARGV[1])"


def record(rid: str) -> RequestRecord:
    return RequestRecord(rid, State.QUEUED, 1, "b" * 32, 5, 16, 1_700_000_000.5, "orch-1")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path).start()
    try:
        yield s
    finally:
        s.kill()


def run(scenario: Callable[[], Coroutine[Any, Any, T]], limit_s: float = 10.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(scenario(), limit_s)

    return asyncio.run(main())


def count_writes(client: Any) -> list[int]:
    """A log of the packed writes `exchange` makes on ``client``'s pool: the number of
    commands in each (a pipeline, or one call alone). redis-py's own commands are not
    logged."""
    made: list[int] = []
    exchanged = pipelining.exchange

    async def counted(pool: Any, commands: list[bytes]) -> list[Any]:
        if pool is client.connection_pool:
            made.append(len(commands))
        return await exchanged(pool, commands)

    pipelining.exchange = counted  # type: ignore[assignment]  # restored by the fixture
    return made


@pytest.fixture(autouse=True)
def _exchange_restored() -> Iterator[None]:
    exchanged = pipelining.exchange
    yield
    pipelining.exchange = exchanged  # type: ignore[assignment]


@contextlib.asynccontextmanager
async def piped(url: str) -> AsyncIterator[tuple[ScriptPipeline, Any, list[int]]]:
    """A pipeline over a client of its own, the client, and its packed writes
    (`count_writes`)."""
    connected = open_client(StoreSettings(url=url, socket_timeout_s=0.5))
    client = connected.client
    made = count_writes(client)
    p = ScriptPipeline(client)
    try:
        yield p, client, made
    finally:
        await p.close()
        await connected.close()


def test_a_turns_calls_go_as_one_pipeline_each_caller_getting_its_own_reply(
    server: RedisServer,
) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, made):
            echo, fail = client.register_script(ECHO), client.register_script(FAIL)
            await p.call(echo, ["k"], ["warm"])  # alone: NOSCRIPT, loaded, sent again
            await client.script_load(fail.script)
            assert made == [1, 1]
            got = await asyncio.gather(
                *(p.call(echo, [f"k{i}"], [str(i)]) for i in range(5)),
                p.call(fail, ["x"], ["this one"]),
                return_exceptions=True,
            )
            assert made == [1, 1, 6]  # one pipeline for the turn's six calls
            assert got[:5] == [[f"k{i}", str(i)] for i in range(5)]
            assert isinstance(got[5], rexc.ResponseError)
            assert "refused this one" in str(got[5])

    run(scenario)


def test_scripts_the_server_lost_are_loaded_and_only_the_refused_calls_sent_again(
    server: RedisServer,
) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, made):
            echo = client.register_script(ECHO)
            incr = client.register_script("return redis.call('INCR', KEYS[1])")
            await client.script_load(incr.script)
            assert await client.script_flush() is True
            await client.script_load(incr.script)  # only the echo script is lost
            got = await asyncio.gather(
                p.call(incr, ["n"], []), p.call(echo, ["a"], ["1"]), p.call(echo, ["b"], ["2"])
            )
            assert got == [1, ["a", "1"], ["b", "2"]]  # INCR ran once: not sent again
            assert made == [3, 2]

    run(scenario)


def test_a_caller_cancelled_before_the_flush_sends_nothing(server: RedisServer) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, _):
            incr = client.register_script("return redis.call('INCR', KEYS[1])")
            gone = asyncio.create_task(p.call(incr, ["n"], []))  # the turn's leader
            kept = asyncio.create_task(p.call(incr, ["m"], []))
            await asyncio.sleep(0)  # both queued, the leader waiting for the turn's end
            gone.cancel()  # it hands the other call on
            assert await kept == 1
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert await client.get("n") is None

    run(scenario)


def test_an_outage_fails_every_call_of_the_pipeline(server: RedisServer) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, _):
            echo = client.register_script(ECHO)
            await p.call(echo, ["k"], ["warm"])
            server.kill()
            got = await asyncio.gather(
                *(p.call(echo, [f"k{i}"], [str(i)]) for i in range(3)), return_exceptions=True
            )
            assert all(isinstance(g, (rexc.ConnectionError, OSError)) for g in got), got

    run(scenario)


def test_close_fails_queued_calls_and_refuses_new_ones(server: RedisServer) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, _):
            echo = client.register_script(ECHO)
            queued = asyncio.create_task(p.call(echo, ["k"], ["1"]))
            await asyncio.sleep(0)
            await p.close()
            await p.close()  # idempotent
            with pytest.raises(errors.StoreUnavailableError, match="closed"):
                await queued
            with pytest.raises(errors.StoreUnavailableError, match="closed"):
                await p.call(echo, ["k"], ["2"])

    run(scenario)


def test_the_stores_concurrent_transitions_share_a_pipeline_and_keep_their_checks(
    server: RedisServer,
) -> None:
    # Through `RedisStore`: several requests' transitions in one turn are one pipeline;
    # each is checked on its own (a stale epoch is refused, the others land).
    async def scenario() -> None:
        settings = StoreSettings(url=server.url, prefix="piped", socket_timeout_s=0.5)
        store = RedisStore(settings)
        try:
            for rid in ("r0", "r1", "r2", "r3"):
                assert await store.create(record(rid)) is None
            await store.transition("r0", Edge.AGGREGATE, epoch=1)  # its script loaded
            made = count_writes(store._redis)
            got = await asyncio.gather(
                store.transition("r1", Edge.AGGREGATE, epoch=1),
                store.transition("r2", Edge.AGGREGATE, epoch=7),
                store.transition("r3", Edge.PREFILL, epoch=1),
                return_exceptions=True,
            )
            assert made == [3]
            assert got[0] == 1
            assert isinstance(got[1], errors.StaleEpochError)
            assert got[2] == 1
            states = [(await store.get(r)) for r in ("r1", "r2", "r3")]
            assert [s.state for s in states if s is not None] == [
                State.DECODING,
                State.QUEUED,
                State.PREFILLING,
            ]
        finally:
            await store.close()

    run(scenario)


def test_a_call_alone_reloads_a_script_the_server_lost(server: RedisServer) -> None:
    async def scenario() -> None:
        async with piped(server.url) as (p, client, made):
            echo = client.register_script(ECHO)
            assert await p.call(echo, ["a"], ["1"]) == ["a", "1"]
            assert await client.script_flush() is True
            assert await p.call(echo, ["b"], [2]) == ["b", "2"]  # NOSCRIPT: loaded, resent
            assert made == [1, 1, 1, 1]  # each: refused, then sent again once loaded
            fail = client.register_script(FAIL)
            with pytest.raises(rexc.ResponseError, match="refused alone"):
                await p.call(fail, ["x"], ["alone"])

    run(scenario)


def test_an_exchange_cut_short_never_leaves_its_replies_to_the_next_caller(
    server: RedisServer,
) -> None:
    # One pooled connection: an exchange cancelled while Redis runs a slow script drops
    # the connection; the next exchange reads its own reply, not the slow one's.
    async def scenario() -> None:
        settings = StoreSettings(url=server.url, socket_timeout_s=2.0, max_connections=1)
        connected = open_client(settings)
        client = connected.client
        try:
            slow = client.register_script(
                "local t = redis.call('TIME'); local stop = t[1] * 1e6 + t[2] + 200000 "
                "repeat local n = redis.call('TIME') until n[1] * 1e6 + n[2] >= stop "
                "return 'slow'"
            )
            echo = client.register_script(ECHO)
            await client.script_load(slow.script)
            await client.script_load(echo.script)
            pool = client.connection_pool
            cut = asyncio.create_task(exchange(pool, [pack((b"EVALSHA", slow.sha.encode(), b"0"))]))
            await asyncio.sleep(0.05)  # written, its reply not yet read
            cut.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cut
            for i in range(3):
                command = pack((b"EVALSHA", echo.sha.encode(), b"1", b"k", str(i).encode()))
                assert await exchange(pool, [command]) == [["k", str(i)]]
        finally:
            await connected.close()

    run(scenario)


def test_the_pure_python_packing_is_hiredis_packing() -> None:
    for args in [
        (b"EVALSHA", b"0" * 40, b"2", b"req:{a}", b"", b"\xc3\xa9\r\n", b"1.5"),
        (b"PING",),
    ]:
        assert pack_resp(args) == pack(args)
    assert pack_resp((b"GET", b"k")) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
