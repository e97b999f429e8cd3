"""The store contract (`orchestrator.store.base.Store`), run against both implementations:
`RedisStore` on a real `redis-server` on loopback, started by this module, and `MemoryStore`;
and `RedisStore` again on a real 3-primary Redis Cluster (``redis+cluster://``, issue 21),
started once for the module.

Every semantic test takes the `backend` fixture and runs once per implementation. Tests that
need a real Redis by nature (key TTLs, the script cache, killed, restarted or hung servers)
take `settings` or `doomed` and run against Redis only; the in-memory store's own TTL and
outage behaviour is covered in ``tests/unit/test_memory_store.py``.

Each test runs its scenario under `asyncio.run` with a hard deadline and works under its own
key prefix, so the tests share one server without seeing each other's keys. Nothing waits on
a fixed sleep: readiness and TTL expiry are polled with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.crc import key_slot

from orchestrator import errors
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.state import ENDING, Edge, State, apply
from orchestrator.ports import free_port
from orchestrator.store import pipelining
from orchestrator.store.base import Store
from orchestrator.store.connect import open_client
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.keys import Keys, encode
from orchestrator.store.memory import MemoryStore
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.store.server import RedisServer

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")

SOCKET_TIMEOUT_S = 0.5
"""Short, so a hung or dead server is noticed fast; a healthy loopback call takes ~0.1 ms.
For the tests that stop or kill a server (`doomed_settings`)."""

HEALTHY_TIMEOUT_S = 5.0
"""The module's shared server is never stopped: its calls get the time a loaded 2-core CI
machine may need (a 0.5 s connect timed out there once, in a full `make test`)."""


# ------------------------------------------------------------------ a real redis-server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """Three primaries, every slot served; no replica (the failover test has its own)."""
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


@pytest.fixture
def doomed(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, which the test may kill or stop."""
    s = RedisServer(tmp_path).start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def settings(server: RedisServer, request: pytest.FixtureRequest) -> StoreSettings:
    """Settings for a `RedisStore` on the module's server, under the test's own prefix."""
    return StoreSettings(
        url=server.url,
        prefix=f"test:{encode(request.node.name)}",  # no hash-tag braces of a param's id
        socket_timeout_s=HEALTHY_TIMEOUT_S,
        connect_timeout_s=HEALTHY_TIMEOUT_S,
        record_ttl_s=600,
    )


# ------------------------------------------------------------------ the implementations


@dataclass
class Backend:
    """One implementation under test: `open` gives clients (replicas) of one shared state."""

    settings: StoreSettings
    memory: MemoryStore | None = None
    """The in-memory store whose peers `open` hands out; None: Redis."""
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    client: Any = None
    """A raw client, opened by the first `force_state` and closed with `open`'s store."""

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[Store]:
        store: Store = RedisStore(self.settings) if self.memory is None else self.memory.peer()
        try:
            yield store
        finally:
            await store.close()
            await self.stack.aclose()
            self.client = None

    async def force_state(self, request_id: str, state: State) -> None:
        """Put a record in any state behind the store's back (no edge leads everywhere)."""
        if self.memory is not None:
            self.memory.force_state(request_id, state)
            return
        if self.client is None:  # one for the test: a cluster client's start reads COMMAND
            self.client = await self.stack.enter_async_context(raw(self.settings.url))
        await self.client.hset(Keys(self.settings.prefix).request(request_id), "state", str(state))

    async def worker_index(self) -> set[str]:
        """The registered-worker index as stored, expired workers not yet pruned included."""
        if self.memory is not None:
            return self.memory.worker_index()
        async with raw(self.settings.url) as client:
            return set(await client.smembers(Keys(self.settings.prefix).workers))


@pytest.fixture(params=["redis", "memory", "cluster"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "memory":
        settings = StoreSettings(url="memory://", record_ttl_s=600)
        return Backend(settings, MemoryStore(settings))
    settings = request.getfixturevalue("settings")
    if request.param == "cluster":
        settings = replace(settings, url=request.getfixturevalue("redis_cluster").url)
    return Backend(settings)


# ------------------------------------------------------------------ helpers


def run(scenario: Callable[[], Coroutine[Any, Any, T]], limit_s: float = 10.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(scenario(), limit_s)

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def opened(settings: StoreSettings) -> AsyncIterator[RedisStore]:
    """A Redis store (for the Redis-only tests)."""
    store = RedisStore(settings)
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def raw(url: str) -> AsyncIterator[Any]:
    """A plain client (of a server or a cluster), to look at keys and poke the server behind
    the store's back."""
    connected = open_client(StoreSettings(url=url, socket_timeout_s=2))
    try:
        yield connected.client
    finally:
        await connected.close()


def record(rid: str = "r1", *, body: str = "b" * 32, epoch: int = 0) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        state=State.QUEUED,
        epoch=epoch,
        body_hash=body,
        prompt_tokens=5,
        max_tokens=16,
        created_at=1_700_000_000.5,
        owner="orch-1",
    )


def stored(got: RequestRecord | None) -> RequestRecord | None:
    """A record as read back, without the progress time the store's scripts stamp on it."""
    return None if got is None else replace(got, updated_at=0.0)


def info(wid: str, *, active: int = 0) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        role="decode",
        address=f"127.0.0.1:{5000 + len(wid)}",
        kv_address="127.0.0.1:6000",
        transport="tcp",
        model="tiny",
        fingerprint="f",
        max_context=2048,
        vocab_size=1000,
        kv_bytes_per_token=64,
        kv_capacity_bytes=1 << 20,
        active=active,
    )


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)  # poll interval, not a wait for the thing itself


# ------------------------------------------------------------------ records


def test_create_then_get_round_trips(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.create(record()) is None
            assert stored(await store.get("r1")) == record()

    run(scenario)


def test_get_unknown_is_none(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.get("nobody") is None

    run(scenario)


def test_duplicate_create_returns_the_existing_record(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            first = record(body="1" * 32)
            assert await store.create(first) is None
            await store.transition("r1", Edge.PREFILL, epoch=0)
            again = await store.create(record(body="2" * 32))
            assert stored(again) == replace(first, state=State.PREFILLING)  # untouched

    run(scenario)


def test_a_resubmission_leaves_the_live_index_as_it_was(backend: Backend) -> None:
    # A live request stays listed; an ended one is not listed again by its resubmission.
    async def scenario() -> None:
        async with backend.open() as store:
            for rid in ("live", "ended"):
                assert await store.create(record(rid)) is None
            await store.transition("ended", Edge.AGGREGATE, epoch=0)
            await store.transition("ended", Edge.FINISH, epoch=0)
            assert await store.active() == ["live"]
            for rid in ("live", "ended"):
                assert await store.create(record(rid)) is not None
            assert await store.active() == ["live"]

    run(scenario)


# Redis only: counts the server's commands.
def test_a_creation_is_one_script_call_on_one_server(settings: StoreSettings) -> None:
    # A request's creation indexes it live in the record's own script: one command to
    # pack, send and parse (it was a pipeline of two).
    async def evalsha_calls(client: Any) -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            assert await store.create(record("r0")) is None  # script loaded, connected
            before = await evalsha_calls(client)
            assert await store.create(record("r1")) is None
            assert await evalsha_calls(client) - before == 1
            assert await store.active() == ["r0", "r1"]

    run(scenario)


# Redis only: reads the key's TTL (memory: test_memory_store.py, records expire).
def test_create_sets_the_record_ttl(settings: StoreSettings) -> None:
    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            await store.create(record())
            ttl = await client.ttl(Keys(settings.prefix).request("r1"))
            assert 0 < ttl <= settings.record_ttl_s

    run(scenario)


# ------------------------------------------------------------------ transitions


def test_transition_from_an_allowed_source(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.transition(
                "r1", Edge.PREFILL, epoch=0, fields={"prefill_worker": "p1", "kv_bytes": 42}
            )
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.epoch) == (State.PREFILLING, 0)
            assert (got.prefill_worker, got.kv_bytes) == ("p1", 42)

    run(scenario)


def test_transition_walks_the_happy_path(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            for edge in (Edge.PREFILL, Edge.KV_SENT, Edge.KV_ADOPTED, Edge.FINISH):
                await store.transition("r1", edge, epoch=0)
            got = await store.get("r1")
            assert got is not None
            assert got.state is State.DONE

    run(scenario)


def test_stale_epoch_is_refused(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record(epoch=2))
            for wrong in (1, 3):
                with pytest.raises(errors.StaleEpochError):
                    await store.transition("r1", Edge.PREFILL, epoch=wrong)
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.epoch) == (State.QUEUED, 2)

    run(scenario)


def test_wrong_state_is_refused(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.transition("r1", Edge.PREFILL, epoch=0)
            with pytest.raises(errors.InvalidTransitionError, match="prefilling") as info:
                await store.transition(
                    "r1", Edge.AGGREGATE, epoch=0, fields={"decode_worker": "d9"}
                )
            assert info.type is errors.InvalidTransitionError
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.decode_worker) == (State.PREFILLING, "")  # nothing written

    run(scenario)


def test_sources_follow_the_state_machine(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            with pytest.raises(errors.InvalidTransitionError):
                await store.transition("r1", Edge.KV_ADOPTED, epoch=0)  # queued: no KV sent
            await store.transition("r1", Edge.AGGREGATE, epoch=0)
            await store.transition("r1", Edge.CANCEL, epoch=0)
            with pytest.raises(errors.InvalidTransitionError):
                await store.transition("r1", Edge.FAIL, epoch=0)  # already ended

    run(scenario)


def test_every_edge_in_the_store_agrees_with_the_python_rule(backend: Backend) -> None:
    # The Lua scripts are rendered from `core.state`: from every state, each edge does in Redis
    # (and in memory) exactly what `apply` says (target and epoch), or is refused with nothing
    # written.
    async def scenario() -> None:
        async with backend.open() as store:
            for edge, state in itertools.product(Edge, State):
                rid = f"{edge.wire}-{state}"
                await store.create(record(rid, epoch=3))
                await backend.force_state(rid, state)
                try:
                    expected: tuple[State, int] | None = apply(edge, state, 3)
                except errors.InvalidTransitionError:
                    expected = None
                if expected is None:
                    with pytest.raises(errors.InvalidTransitionError):
                        await store.transition(rid, edge, epoch=3)
                else:
                    assert await store.transition(rid, edge, epoch=3) == expected[1]
                got = await store.get(rid)
                assert got is not None
                assert (got.state, got.epoch) == (expected or (state, 3)), (edge, state)

    run(scenario)


def test_transition_of_unknown_request_is_not_found(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            with pytest.raises(errors.NotFoundError):
                await store.transition("nobody", Edge.PREFILL, epoch=0)

    run(scenario)


def test_new_epoch_fences_the_old_one(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.transition("r1", Edge.PREFILL, epoch=0)
            assert await store.transition("r1", Edge.REQUEUE, epoch=0) == 1
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.epoch) == (State.QUEUED, 1)
            with pytest.raises(errors.StaleEpochError):
                await store.transition("r1", Edge.PREFILL, epoch=0)
            await store.transition("r1", Edge.PREFILL, epoch=1)

    run(scenario)


def test_set_fields_writes_informational_fields(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.set_fields("r1", {"decode_worker": "d1", "kv_bytes": 7})
            got = await store.get("r1")
            assert got is not None
            assert (got.decode_worker, got.kv_bytes, got.state) == ("d1", 7, State.QUEUED)

    run(scenario)


@pytest.mark.parametrize("field", ["state", "epoch"])
def test_set_fields_refuses_state_and_epoch(backend: Backend, field: str) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            with pytest.raises(ValueError, match="transition"):
                await store.set_fields("r1", {field: "1", "owner": "x"})
            assert stored(await store.get("r1")) == record()  # nothing written, not "owner"

    run(scenario)


@pytest.mark.parametrize("bump", [True, False], ids=["new-epoch", "same-epoch"])
def test_concurrent_transitions_have_exactly_one_winner(backend: Backend, bump: bool) -> None:
    async def scenario() -> None:
        async with backend.open() as a, backend.open() as b:  # two orchestrators
            await a.create(record())

            async def attempt(i: int) -> None:
                await (a if i % 2 else b).transition(
                    "r1",
                    Edge.REQUEUE if bump else Edge.PREFILL,
                    epoch=0,
                    fields={"owner": f"o{i}"},
                )

            results = await asyncio.gather(*(attempt(i) for i in range(20)), return_exceptions=True)
            winners = [i for i, r in enumerate(results) if r is None]
            assert len(winners) == 1, results
            loser = errors.StaleEpochError if bump else errors.InvalidTransitionError
            assert all(type(r) is loser for r in results if r is not None), results
            got = await a.get("r1")
            assert got is not None
            assert (got.state, got.epoch, got.owner) == (
                State.QUEUED if bump else State.PREFILLING,
                1 if bump else 0,
                f"o{winners[0]}",
            )

    run(scenario)


# ------------------------------------------------------------------ journal


def test_journal_appends_contiguously_and_reads_from_an_offset(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            first = JournalEntry(0, (10, 11, 12), "abc")
            second = JournalEntry(3, (13,), "d")
            third = JournalEntry(4, (14, 15), "é")
            assert await store.append("r1", 0, first) == 3
            assert await store.append("r1", 0, second) == 4
            assert await store.append("r1", 0, third) == 6
            got = await store.get("r1")
            assert got is not None
            assert got.output_tokens == 6
            assert await store.journal("r1") == [first, second, third]
            assert await store.journal("r1", 1) == [second, third]  # offset counts entries
            assert await store.journal("r1", 3) == []

    run(scenario)


def test_journal_of_unknown_request_is_empty(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.journal("nobody") == []

    run(scenario)


@pytest.mark.parametrize(("index", "what"), [(0, "duplicate"), (1, "overlap"), (3, "gap")])
def test_journal_refuses_out_of_place_chunks(backend: Backend, index: int, what: str) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.append("r1", 0, JournalEntry(0, (1, 2), "ab"))
            with pytest.raises(errors.JournalGapError, match="journal ends at 2") as info:
                await store.append("r1", 0, JournalEntry(index, (9,), what))
            assert info.value.journal_end == 2  # where a writer must continue
            assert await store.journal("r1") == [JournalEntry(0, (1, 2), "ab")]
            got = await store.get("r1")
            assert got is not None
            assert got.output_tokens == 2

    run(scenario)


def test_journal_is_epoch_checked(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.transition("r1", Edge.PREFILL, epoch=0)
            await store.transition("r1", Edge.REQUEUE, epoch=0)
            for wrong in (0, 2):
                with pytest.raises(errors.StaleEpochError):
                    await store.append("r1", wrong, JournalEntry(0, (1,), "a"))
            assert await store.journal("r1") == []
            assert await store.append("r1", 1, JournalEntry(0, (1,), "a")) == 1

    run(scenario)


@pytest.mark.parametrize("end", [State.DONE, State.FAILED, State.CANCELLED])
def test_journal_is_refused_after_the_request_ended(backend: Backend, end: State) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.create(record())
            await store.transition("r1", Edge.AGGREGATE, epoch=0)
            await store.append("r1", 0, JournalEntry(0, (1,), "a"))
            await store.transition("r1", ENDING[end], epoch=0)
            with pytest.raises(errors.RequestEndedError, match=str(end)):
                await store.append("r1", 0, JournalEntry(1, (2,), "b"))
            assert await store.journal("r1") == [JournalEntry(0, (1,), "a")]

    run(scenario)


def test_journal_of_unknown_request_is_not_found(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            with pytest.raises(errors.NotFoundError):
                await store.append("nobody", 0, JournalEntry(0, (1,), "a"))

    run(scenario)


def test_append_many_checks_each_chunk_as_append_does(backend: Backend) -> None:
    # One round trip for chunks of several requests (the journal writer's group commit):
    # in order, each checked on its own, a refusal answered in its place, never raised.
    async def scenario() -> None:
        async with backend.open() as store:
            for rid in ("r1", "r2", "r3"):
                await store.create(record(rid))
            await store.transition("r3", Edge.PREFILL, epoch=0)
            await store.transition("r3", Edge.REQUEUE, epoch=0)  # r3 now at epoch 1
            got = await store.append_many(
                [
                    ("r1", 0, JournalEntry(0, (1, 2), "ab")),
                    ("r2", 0, JournalEntry(0, (7,), "x")),
                    ("r1", 0, JournalEntry(2, (3,), "c")),  # after the first: chained
                    ("r3", 0, JournalEntry(0, (5,), "s")),  # stale epoch
                    ("r2", 0, JournalEntry(5, (8,), "y")),  # a gap
                    ("nobody", 0, JournalEntry(0, (1,), "a")),
                ]
            )
            assert got[:3] == [2, 1, 3]
            assert isinstance(got[3], errors.StaleEpochError)
            assert isinstance(got[4], errors.JournalGapError)
            assert got[4].journal_end == 1
            assert isinstance(got[5], errors.NotFoundError)
            assert await store.journal("r1") == [
                JournalEntry(0, (1, 2), "ab"),
                JournalEntry(2, (3,), "c"),
            ]
            assert await store.journal("r2") == [JournalEntry(0, (7,), "x")]
            assert await store.journal("r3") == []
            assert await store.append_many([]) == []

    run(scenario)


# Redis only: NOSCRIPT exists only in Redis.
def test_append_many_survives_a_script_cache_flush(settings: StoreSettings) -> None:
    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            await store.create(record("r1"))
            assert await client.script_flush() is True
            got = await store.append_many(
                [("r1", 0, JournalEntry(0, (1,), "a")), ("r1", 0, JournalEntry(1, (2,), "b"))]
            )
            assert got == [1, 2]

    run(scenario)


# Redis only: counts the server's commands.
def test_append_many_is_one_script_call_on_one_server(
    settings: StoreSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The group commit's point: a batch of chunks of several requests costs one command to
    # pack, send and parse, not one per chunk; a batch over the cap is split into calls
    # (pipelined), and each call still chains a request's chunks in order.
    async def evalsha_calls(client: Any) -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            for rid in ("r1", "r2"):
                await store.create(record(rid))
            chunks = [
                ("r1", 0, JournalEntry(0, (1,), "a")),
                ("r2", 0, JournalEntry(0, (7, 8), "xy")),
                ("r1", 0, JournalEntry(1, (2, 3), "bc")),
                ("r2", 0, JournalEntry(2, (9,), "z")),
                ("r1", 0, JournalEntry(3, (4,), "d")),
            ]
            await client.script_load(store._append.script)  # no NOSCRIPT round counted
            before = await evalsha_calls(client)
            assert await store.append_many(chunks[:4]) == [1, 2, 3, 3]
            assert await evalsha_calls(client) - before == 1
            monkeypatch.setattr("orchestrator.store.redis_store.APPEND_CALL_MAX", 2)
            await store.create(record("r3"))
            split = [("r3", 0, JournalEntry(i, (i,), str(i))) for i in range(5)]
            before = await evalsha_calls(client)
            assert await store.append_many([chunks[4], *split]) == [4, 1, 2, 3, 4, 5]
            assert await evalsha_calls(client) - before == 3
            assert [e.index for e in await store.journal("r3")] == [0, 1, 2, 3, 4]
            assert [e.index for e in await store.journal("r1")] == [0, 1, 3]

    run(scenario)


# Redis only: counts the store's round trips.
def test_a_tenant_cost_is_one_round_trip_on_one_server(settings: StoreSettings) -> None:
    # A request's end pays for its tenant's totals: index and totals in one MULTI, not a
    # SADD and then a MULTI.
    async def scenario() -> None:
        async with opened(settings) as store:
            client = store._redis  # the round trips are the point
            direct, piped = [], []
            execute, pipeline = client.execute_command, client.pipeline

            async def counted_execute(*args: Any, **kwargs: Any) -> Any:
                direct.append(args[0])
                return await execute(*args, **kwargs)

            def counted_pipeline(*args: Any, **kwargs: Any) -> Any:
                piped.append(kwargs.get("transaction", args[0] if args else True))
                return pipeline(*args, **kwargs)

            client.execute_command, client.pipeline = counted_execute, counted_pipeline
            await store.add_tenant_cost("t1", {"usd": 2.5, "transfer_bytes": 10})
            client.execute_command, client.pipeline = execute, pipeline
            assert (direct, piped) == ([], [True])
            costs = await store.tenant_costs()
            assert (costs["t1"]["requests"], costs["t1"]["usd"]) == (1, 2.5)

    run(scenario)


def test_append_many_takes_an_edge_with_its_chunk(backend: Backend) -> None:
    # The decode stream's first chunk adopts the KV in its own journal write: the edge is
    # taken atomically with the chunk, once (a retried write finds it taken), and refused
    # (the chunk with it) from a state that is not one of its sources.
    async def scenario() -> None:
        async with backend.open() as store:
            for rid in ("r1", "r2"):
                await store.create(record(rid, epoch=1))
                await store.transition(rid, Edge.PREFILL, epoch=1)
            await store.transition("r1", Edge.KV_SENT, epoch=1)
            adopt = Edge.KV_ADOPTED
            got = await store.append_many(
                [
                    ("r1", 1, JournalEntry(0, (1,), "a")),
                    ("r2", 1, JournalEntry(0, (5,), "e")),  # still prefilling: refused
                    ("r1", 1, JournalEntry(1, (2,), "b")),
                ],
                edges={0: adopt, 1: adopt},
            )
            assert (got[0], got[2]) == (1, 2)
            assert isinstance(got[1], errors.InvalidTransitionError)
            r1, r2 = await store.get("r1"), await store.get("r2")
            assert r1 is not None
            assert r2 is not None
            assert (r1.state, r1.output_tokens) == (State.DECODING, 2)
            assert (r2.state, r2.output_tokens) == (State.PREFILLING, 0)
            assert await store.journal("r2") == []
            # At the edge's target already (a write retried after a lost reply): no-op.
            assert await store.append_many(
                [("r1", 1, JournalEntry(2, (3,), "c"))], edges={0: adopt}
            ) == [3]
            await store.transition("r1", Edge.FINISH, epoch=1)  # decoding -> done
            for edge in (Edge.FINISH, Edge.REQUEUE):  # ends, or reassigns: not a write's
                with pytest.raises(ValueError, match="cannot take"):
                    await store.append_many(
                        [("r2", 1, JournalEntry(0, (5,), "e"))], edges={0: edge}
                    )

    run(scenario)


def test_end_records_the_end_the_indexes_and_the_cost_once(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:

            def of(rid: str) -> RequestRecord:
                return replace(record(rid, epoch=1), tenant="acme")

            cost = {"usd": 0.25, "transfer_bytes": 10}
            assert await store.create(of("e1"), tenant_limit=1) is None
            await store.transition("e1", Edge.AGGREGATE, epoch=1)
            with pytest.raises(errors.StaleEpochError):  # fenced: nothing written
                await store.end("e1", Edge.FINISH, epoch=2, tenant="acme", cost=cost)
            assert "acme" not in await store.tenant_costs()
            with pytest.raises(ValueError, match="does not end"):
                await store.end("e1", Edge.KV_ADOPTED, epoch=1, tenant="acme", cost=cost)
            with pytest.raises(errors.OverloadedError):  # the tenant's one place is taken
                await store.create(of("e2"), tenant_limit=1)
            got = await store.end(
                "e1", Edge.FINISH, epoch=1, tenant="acme", cost=cost,
                fields={"finish_reason": "length"},
            )  # fmt: skip
            assert (got.state, got.epoch, got.finish_reason) == (State.DONE, 1, "length")
            assert stored(got) == stored(await store.get("e1"))
            assert "e1" not in await store.active()
            totals = (await store.tenant_costs())["acme"]
            assert (totals["requests"], totals["usd"], totals["transfer_bytes"]) == (1, 0.25, 10)
            assert await store.create(of("e2"), tenant_limit=1) is None  # its place is free
            with pytest.raises(errors.InvalidTransitionError):  # ended once, counted once
                await store.end("e1", Edge.FAIL, epoch=1, tenant="acme", cost=cost)
            with pytest.raises(errors.NotFoundError):
                await store.end("nope", Edge.FAIL, epoch=1, tenant="acme", cost=cost)
            assert (await store.tenant_costs())["acme"]["requests"] == 1

    run(scenario)


def test_settle_prices_a_request_someone_else_ended_once(backend: Backend) -> None:
    """A client's Cancel ends a request before its run can: `settle` prices it — the
    record's cost and fields, the tenant's totals — only when it has ended and has no
    cost yet, once whoever asks; an ended-and-priced one (`end`) and a live one never."""

    async def scenario() -> None:
        async with backend.open() as store:
            cost = {"usd": 0.5, "transfer_bytes": 7}
            for rid in ("s1", "s2", "s3"):
                rec = replace(record(rid, epoch=1), tenant="acme")
                assert await store.create(rec) is None
                await store.transition(rid, Edge.AGGREGATE, epoch=1)
            assert not await store.settle(
                "s1", State.CANCELLED, tenant="acme", cost=cost, cost_json='{"usd": 0.5}'
            )
            await store.transition("s1", Edge.CANCEL, epoch=1)
            priced = await store.settle(
                "s1", State.CANCELLED, tenant="acme", cost=cost, cost_json='{"usd": 0.5}',
                fields={"timings": '{"total_ms": 3}'},
            )  # fmt: skip
            assert priced
            got = await store.get("s1")
            assert got is not None
            assert (got.state, got.cost, got.timings) == (
                State.CANCELLED,
                {"usd": 0.5},
                {"total_ms": 3},
            )
            assert not await store.settle(
                "s1", State.CANCELLED, tenant="acme", cost=cost, cost_json='{"usd": 9}'
            )
            await store.end("s2", Edge.FINISH, epoch=1, tenant="acme", cost=cost,
                            fields={"cost": '{"usd": 0.5}'})  # fmt: skip
            assert not await store.settle(
                "s2", State.CANCELLED, tenant="acme", cost=cost, cost_json='{"usd": 9}'
            )
            assert not await store.settle(
                "nope", State.CANCELLED, tenant="acme", cost=cost, cost_json="{}"
            )
            await store.transition("s3", Edge.FAIL, epoch=1)  # failed, not cancelled
            assert not await store.settle(
                "s3", State.CANCELLED, tenant="acme", cost=cost, cost_json="{}"
            )
            totals = (await store.tenant_costs())["acme"]
            assert (totals["requests"], totals["usd"], totals["transfer_bytes"]) == (2, 1.0, 14)

    run(scenario)


# Redis (one server) and memory: each loses a reply its own way.
@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_an_end_retried_after_its_reply_was_lost_counts_the_cost_once(
    settings: StoreSettings, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The end's write lands and its reply is lost: the retry (`orchestrator.store.outage`)
    # is answered as done — the record ended once, the tenant's cost counted once.
    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if kind == "memory":
                memory = MemoryStore(StoreSettings(url="memory://", outage_s=5.0))
                store: Store = memory
            else:
                redis_store = await stack.enter_async_context(
                    opened(replace(settings, outage_s=5.0))
                )
                store = redis_store
            assert await store.create(replace(record("e1", epoch=1), tenant="t")) is None
            await store.transition("e1", Edge.AGGREGATE, epoch=1)
            if kind == "memory":
                memory.lose_replies(1)
            else:
                sha, exchanged, lost = redis_store._end.sha.encode(), pipelining.exchange, []

                async def reply_lost(pool: Any, commands: list[bytes]) -> list[Any]:
                    got = await exchanged(pool, commands)
                    if not lost and any(sha in c for c in commands):
                        lost.append(got)  # the end ran; its reply never reaches the store
                        raise redis.exceptions.ConnectionError("reply lost")
                    return got

                monkeypatch.setattr(pipelining, "exchange", reply_lost)
            got = await store.end("e1", Edge.FINISH, epoch=1, tenant="t", cost={"usd": 1.0})
            assert (got.state, got.epoch) == (State.DONE, 1)
            costs = (await store.tenant_costs())["t"]
            assert (costs["requests"], costs["usd"]) == (1, 1.0)
            assert kind == "memory" or len(lost) == 1

    run(scenario)


# Redis only: counts the round trips.
def test_a_requests_end_is_one_script_call_on_one_server(
    settings: StoreSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The end of a request (issue 21's fixed cost): terminal transition, lease, live index,
    # the tenant's count and totals and the final record, in one call — before: a
    # transition, an index pipeline, a MULTI and a read.
    async def scenario() -> None:
        async with opened(settings) as store:
            await store.create(replace(record("e1", epoch=1), tenant="t"), tenant_limit=5)
            await store.transition("e1", Edge.AGGREGATE, epoch=1)
            client = store._redis
            await client.script_load(store._end.script)  # no NOSCRIPT round in the count
            direct: list[Any] = []
            sent: list[list[bytes]] = []
            execute, exchanged = client.execute_command, pipelining.exchange

            async def counted_execute(*args: Any, **kwargs: Any) -> Any:
                direct.append(args[0])
                return await execute(*args, **kwargs)

            async def counted_exchange(pool: Any, commands: list[bytes]) -> list[Any]:
                sent.append(commands)
                return await exchanged(pool, commands)

            client.execute_command = counted_execute
            monkeypatch.setattr(pipelining, "exchange", counted_exchange)
            got = await store.end("e1", Edge.FINISH, epoch=1, tenant="t", cost={"usd": 2.0})
            client.execute_command = execute
            assert direct == []
            assert [len(commands) for commands in sent] == [1]
            assert b"EVALSHA" in sent[0][0]
            assert store._end.sha.encode() in sent[0][0]
            assert got.state is State.DONE
            assert "e1" not in await store.active()
            assert (await store.tenant_costs())["t"]["usd"] == 2.0
            async with raw(settings.url) as plain:
                keys = Keys(settings.prefix)
                assert await plain.zcard(keys.tenant_inflight("t")) == 0
                assert not await plain.exists(keys.lease("e1"))

    run(scenario)


# Redis only: reads the key's TTL (memory: test_memory_store.py, journals expire).
def test_journal_expires_with_the_record(settings: StoreSettings) -> None:
    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            await store.create(record())
            await store.append("r1", 0, JournalEntry(0, (1,), "a"))
            ttl = await client.ttl(Keys(settings.prefix).journal("r1"))
            assert 0 < ttl <= settings.record_ttl_s

    run(scenario)


# ------------------------------------------------------------------ workers


def test_heartbeat_lists_workers(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.workers() == []
            await store.heartbeat(info("w2"), ttl_s=30)
            await store.heartbeat(info("w1"), ttl_s=30)
            assert await store.workers() == [info("w1"), info("w2")]
            await store.heartbeat(info("w1", active=5), ttl_s=30)  # a refresh replaces it
            assert await store.workers() == [info("w1", active=5), info("w2")]

    run(scenario)


def test_deregister_removes_a_worker(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.heartbeat(info("w1"), ttl_s=30)
            await store.heartbeat(info("w2"), ttl_s=30)
            await store.deregister("w1")
            await store.deregister("never-registered")
            assert await store.workers() == [info("w2")]
            assert await backend.worker_index() == {"w2"}

    run(scenario)


def test_expired_heartbeat_drops_the_worker(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            await store.heartbeat(info("short"), ttl_s=0.3)
            await store.heartbeat(info("long"), ttl_s=30)
            assert [w.worker_id for w in await store.workers()] == ["long", "short"]

            async def short_gone() -> bool:
                return [w.worker_id for w in await store.workers()] == ["long"]

            await eventually(short_gone, 5.0, "the 0.3 s heartbeat to expire")
            # The index is pruned too, not just filtered.
            assert await backend.worker_index() == {"long"}

    run(scenario)


def test_worker_alive_follows_the_heartbeat(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert not await store.worker_alive("w1")
            await store.heartbeat(info("w1"), ttl_s=30)
            await store.heartbeat(info("w2"), ttl_s=0.3)
            assert await store.worker_alive("w1")
            await store.deregister("w1")
            assert not await store.worker_alive("w1")

            async def w2_dead() -> bool:
                return not await store.worker_alive("w2")

            await eventually(w2_dead, 5.0, "the 0.3 s heartbeat to expire")

    run(scenario)


# ------------------------------------------------------------------ failures


async def script_loads(client: Any) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_script|load", {}).get("calls", 0))


# Redis only: NOSCRIPT after a flushed script cache exists only in Redis.
def test_scripts_survive_a_script_cache_flush(settings: StoreSettings) -> None:
    # NOSCRIPT (as after a restart or failover): the store must reload its Lua and carry on.
    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            await store.create(record("r1"))
            await store.transition("r1", Edge.AGGREGATE, epoch=0)
            await store.append("r1", 0, JournalEntry(0, (1,), "a"))
            loads_before = await script_loads(client)
            assert await client.script_flush() is True
            await store.transition("r1", Edge.FINISH, epoch=0)
            assert await client.script_flush() is True
            assert await store.create(record("r2")) is None
            assert await client.script_flush() is True
            await store.transition("r2", Edge.AGGREGATE, epoch=0)
            assert await client.script_flush() is True
            assert await store.append("r2", 0, JournalEntry(0, (1,), "a")) == 1
            got = await store.get("r1")
            assert got is not None
            assert got.state is State.DONE
            # Each flush really cost a NOSCRIPT and a reload (the test exercised the path);
            # an end runs two scripts (the record's, then the index's); a creation on one
            # server runs one (the record's, which indexes it too).
            assert await script_loads(client) - loads_before == 5

    run(scenario)


def doomed_settings(url: str, outage_s: float = 0.0) -> StoreSettings:
    """Calls fail at once on an outage, unless ``outage_s`` (the writes' window) is given."""
    return StoreSettings(
        url=url,
        socket_timeout_s=SOCKET_TIMEOUT_S,
        connect_timeout_s=SOCKET_TIMEOUT_S,
        outage_s=outage_s,
    )


def every_call(store: Store) -> list[Callable[[], Awaitable[object]]]:
    return [
        store.ping,
        lambda: store.create(record("r2")),
        lambda: store.get("r1"),
        lambda: store.transition("r1", Edge.PREFILL, epoch=0),
        lambda: store.set_fields("r1", {"owner": "x"}),
        lambda: store.append("r1", 0, JournalEntry(0, (1,), "a")),
        lambda: store.journal("r1"),
        lambda: store.heartbeat(info("w1"), ttl_s=30),
        lambda: store.deregister("w1"),
        store.workers,
        lambda: store.worker_alive("w1"),
    ]


async def assert_unavailable_fast(store: Store) -> None:
    for call in every_call(store):
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError, match="unreachable"):
            await call()
        assert time.monotonic() - started < SOCKET_TIMEOUT_S, call


# Redis only: a killed server (memory: test_an_unavailable_memory_store_fails_every_call).
def test_killed_redis_is_unavailable_not_a_hang(doomed: RedisServer) -> None:
    async def scenario() -> None:
        async with opened(doomed_settings(doomed.url)) as store:
            await store.create(record("r1"))  # connected and working
            doomed.kill()
            await assert_unavailable_fast(store)

    run(scenario)


# Redis only: a restarted server and the connection pool reconnecting.
def test_store_recovers_when_redis_comes_back(doomed: RedisServer) -> None:
    async def scenario() -> None:
        async with opened(doomed_settings(doomed.url)) as store:
            await store.ping()
            doomed.kill()
            with pytest.raises(errors.UnavailableError):
                await store.ping()
            doomed.restart()  # the same port
            await store.ping()
            assert await store.create(record("r1")) is None

    run(scenario)


# Redis only: connections refused.
def test_never_started_redis_is_unavailable() -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # a free port: connections are refused

    async def scenario() -> None:
        async with opened(doomed_settings(nobody)) as store:
            await assert_unavailable_fast(store)

    run(scenario)


# Redis only: a stopped server and the socket timeout.
def test_hung_redis_times_out_as_unavailable(doomed: RedisServer) -> None:
    async def scenario() -> None:
        async with opened(doomed_settings(doomed.url)) as store:
            await store.ping()
            doomed.signal(signal.SIGSTOP)  # the fixture kills it
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError) as info:
                await store.get("r1")
            elapsed = time.monotonic() - started
            assert isinstance(info.value.__cause__, redis.TimeoutError)
            assert SOCKET_TIMEOUT_S * 0.9 <= elapsed < SOCKET_TIMEOUT_S * 3

    run(scenario)


# Redis only: a restart (stopped, then started on the same port with its AOF) — issue 18,
# defect 3: the failover loop's backoff gave up on a 1.5-2 s Redis restart.
def test_a_write_outlasts_a_redis_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True).start()

    async def scenario() -> None:
        async with opened(doomed_settings(server.url, outage_s=15.0)) as store:
            assert await store.create(record("r1")) is None
            await asyncio.to_thread(server.stop)  # SIGTERM: the AOF is flushed

            async def back_in(outage_s: float) -> None:
                await asyncio.sleep(outage_s)  # the outage itself, not a wait for a condition
                await asyncio.to_thread(server.start)  # same port, same AOF

            restarted = asyncio.create_task(back_in(2.0))
            started = time.monotonic()
            assert await store.transition("r1", Edge.PREFILL, epoch=0) == 0
            waited = time.monotonic() - started
            await restarted
            assert waited >= 2.0  # it waited the outage out, then wrote
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.epoch) == (State.PREFILLING, 0)

    try:
        run(scenario, limit_s=40)
    finally:
        server.kill()


# Redis only: an outage longer than the window.
def test_a_write_beyond_the_outage_window_fails_with_a_store_error(doomed: RedisServer) -> None:
    async def scenario() -> None:
        async with opened(doomed_settings(doomed.url, outage_s=1.0)) as store:
            assert await store.create(record("r1")) is None
            doomed.kill()
            started = time.monotonic()
            with pytest.raises(errors.StoreUnavailableError) as info:
                await store.transition("r1", Edge.PREFILL, epoch=0)
            waited = time.monotonic() - started
            assert "outage window of 1 s (transition prefill)" in str(info.value)
            assert 1.0 <= waited < 1.0 + 2 * SOCKET_TIMEOUT_S + 1.0  # the window, one try more

    run(scenario)


def test_a_transition_retried_after_its_reply_was_lost_lands_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write can land and its reply be lost; the retry (`orchestrator.store.outage`)
    carries the same token and is answered as done — not refused as stale, not applied
    twice. A write from another call (another token) is refused as before."""
    import secrets  # noqa: PLC0415 (patched for this test only)

    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.create(record("r1", epoch=1)) is None
            monkeypatch.setattr(secrets, "token_hex", lambda n: "one-call")
            assert await store.transition("r1", Edge.REQUEUE, epoch=1) == 2
            assert await store.transition("r1", Edge.REQUEUE, epoch=1) == 2  # its retry
            got = await store.get("r1")
            assert got is not None
            assert (got.state, got.epoch) == (State.QUEUED, 2)
            monkeypatch.setattr(secrets, "token_hex", lambda n: "another-call")
            with pytest.raises(errors.StaleEpochError):
                await store.transition("r1", Edge.REQUEUE, epoch=1)

    run(scenario)


def test_a_memory_store_write_outlasts_an_outage_and_a_lost_reply() -> None:
    async def scenario() -> None:
        store = MemoryStore(StoreSettings(url="memory://", outage_s=5.0))
        await store.create(record("r1", epoch=1))
        store.fail_next(3)
        assert await store.transition("r1", Edge.AGGREGATE, epoch=1) == 1
        store.lose_replies(1)  # REQUEUE lands, its reply is lost: the retry says done
        assert await store.transition("r1", Edge.REQUEUE, epoch=1) == 2
        got = await store.get("r1")
        assert got is not None
        assert (got.state, got.epoch) == (State.QUEUED, 2)

    run(scenario)


def test_an_unavailable_memory_store_fails_every_call() -> None:
    # The in-memory store's outage switch, for fast outage tests of the control plane.
    async def scenario() -> None:
        store = MemoryStore(StoreSettings(url="memory://", outage_s=0))
        peer = store.peer()
        await store.create(record("r1"))
        store.available = False  # an outage of the shared store: every client sees it
        await assert_unavailable_fast(peer)
        store.available = True
        store.fail_next(2)
        for _ in range(2):
            with pytest.raises(errors.UnavailableError, match="unreachable"):
                await peer.transition("r1", Edge.PREFILL, epoch=0)
        await peer.transition("r1", Edge.PREFILL, epoch=0)  # nothing was written before
        got = await store.get("r1")
        assert got is not None
        assert got.state is State.PREFILLING
        store.lose_replies(1)  # the write lands, its reply does not
        with pytest.raises(errors.UnavailableError, match="reply lost"):
            await peer.append("r1", 0, JournalEntry(0, (1,), "a"))
        with pytest.raises(errors.JournalGapError) as gap:
            await peer.append("r1", 0, JournalEntry(0, (1,), "a"))  # the writer's retry
        assert gap.value.journal_end == 1
        assert await store.journal("r1") == [JournalEntry(0, (1,), "a")]

    run(scenario)


# ------------------------------------------------------------------ hand-off and attachment


def test_lease_holders_and_refreshes_in_one_call(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.lease_holders([]) == []
            assert await store.create(record("l1", epoch=1)) is None  # owner orch-1
            assert await store.create(record("l2", epoch=1)) is None
            assert await store.release_lease("l2", "orch-1")
            assert await store.lease_holders(["l1", "l2", "nope"]) == ["orch-1", None, None]
            assert await store.refresh_leases([], "orch-1") == []
            held = await store.refresh_leases([("l1", 1), ("l2", 1), ("nope", 1)], "orch-1",
                                              retake=False)  # fmt: skip
            assert held == [True, False, False]  # only the holder's own lease is extended
            assert await store.refresh_leases([("l1", 1)], "orch-2") == [False]
            assert await store.lease_holders(["l1"]) == ["orch-1"]

    run(scenario)


def test_a_lapsed_lease_nobody_took_is_retaken_only_by_its_owner(
    backend: Backend,
) -> None:
    """A replica whose event loop stalled past its lease TTL gets the lease back if no peer
    took the request over meanwhile; never after a takeover, a hand-off or the end."""

    async def scenario() -> None:
        async with backend.open() as store:
            for rid in ("a", "b", "c", "d"):
                assert await store.create(record(rid, epoch=1)) is None  # owner orch-1
                assert await store.release_lease(rid, "orch-1")  # as if it lapsed
            assert await store.take_over("b", "orch-2") == 2  # a peer took b over
            assert await store.release_lease("b", "orch-2")  # ... and its lease lapsed too
            await store.transition("c", Edge.AGGREGATE, epoch=1)
            await store.transition("c", Edge.FINISH, epoch=1)
            held = await store.refresh_leases([("a", 1), ("b", 1), ("c", 1), ("d", 2)], "orch-1")
            # a: retaken; b: the record names orch-2 at epoch 2; c: ended; d: wrong epoch.
            assert held == [True, False, False, False]
            assert await store.lease_holders(["a", "b", "c", "d"]) == ["orch-1", None, None, None]
            assert await store.refresh_leases([("d", 1)], "orch-1", retake=False) == [False]

    run(scenario)


def test_release_lease_lets_a_peer_take_over_at_once(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.create(record("h1", epoch=1)) is None  # owner orch-1
            assert await store.take_over("h1", "orch-2") is None  # the lease is held
            assert not await store.release_lease("h1", "orch-2")  # not the holder: no-op
            assert await store.take_over("h1", "orch-2") is None
            assert await store.release_lease("h1", "orch-1")
            assert await store.take_over("h1", "orch-2") == 2  # at once, epoch + 1
            got = await store.get("h1")
            assert got is not None
            assert (got.owner, got.epoch, got.state) == ("orch-2", 2, State.QUEUED)

    run(scenario)


def test_client_attachment_expires(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert not await store.client_attached("c1")
            await store.touch_client("c1", 0.3)
            assert await store.client_attached("c1")

            async def gone() -> bool:
                return not await store.client_attached("c1")

            await eventually(gone, 5, "the attachment to expire")

    run(scenario)


# ------------------------------------------------------------------ deadlines


def test_progress_time_moves_with_every_write(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.create(record("p1", epoch=1)) is None
            ((state, epoch, created),) = (await store.progress(["p1", "nope"])).values()
            assert (state, epoch) == (State.QUEUED, 1)
            now = await store.now_ms()
            assert 0 <= now - float(created) < 5000  # Redis's clock, in ms (may be the same ms)

            async def moved(before: str) -> str:
                _, _, after = (await store.progress(["p1"]))["p1"]
                assert float(after) >= float(before)
                return after

            await asyncio.sleep(0.005)  # the clock must tick between two writes
            await store.transition("p1", Edge.AGGREGATE, epoch=1)
            t1 = await moved(created)
            await asyncio.sleep(0.005)
            await store.append("p1", 1, JournalEntry(0, (1, 2), "ab"))
            t2 = await moved(t1)
            assert float(t2) > float(created)

    run(scenario)


def test_expire_fails_only_a_request_that_made_no_progress(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:
            assert await store.create(record("x1", epoch=1)) is None
            await store.transition("x1", Edge.AGGREGATE, epoch=1)
            seen = (await store.progress(["x1"]))["x1"]
            await asyncio.sleep(0.005)
            await store.append("x1", 1, JournalEntry(0, (7,), "z"))  # progress after the read
            assert not await store.expire("x1", seen[0], seen[1], seen[2], "late")
            state, epoch, updated = (await store.progress(["x1"]))["x1"]
            assert await store.expire("x1", state, epoch, updated, "no progress for 2s")
            got = await store.get("x1")
            assert got is not None
            assert (got.state, got.finish_reason, got.error) == (
                State.FAILED, "error", "no progress for 2s"
            )  # fmt: skip
            assert "x1" not in await store.active()
            assert await store.take_over("x1", "orch-9") is None  # ended: nothing to take

    run(scenario)


# ------------------------------------------------------------------ tenant limits


def test_tenant_limit_counts_live_requests_of_that_tenant_only(backend: Backend) -> None:
    async def scenario() -> None:
        async with backend.open() as store:

            def of(rid: str, tenant: str) -> RequestRecord:
                return replace(record(rid, epoch=1), tenant=tenant)

            assert await store.create(of("t1", "acme"), tenant_limit=2) is None
            assert await store.create(of("t2", "acme"), tenant_limit=2) is None
            with pytest.raises(errors.OverloadedError, match="'acme' has 2 requests"):
                await store.create(of("t3", "acme"), tenant_limit=2)
            assert await store.get("t3") is None  # nothing written for a refusal
            assert await store.create(of("b1", "beta"), tenant_limit=2) is None
            # A resubmission of a live request is not a new request: never refused.
            again = await store.create(of("t1", "acme"), tenant_limit=2)
            assert again is not None
            assert again.request_id == "t1"
            # Ending one (done) and expiring another (a reaper) free their slots.
            await store.transition("t1", Edge.AGGREGATE, epoch=1)
            await store.transition("t1", Edge.FINISH, epoch=1)
            assert await store.create(of("t3", "acme"), tenant_limit=2) is None
            state, epoch, updated = (await store.progress(["t2"]))["t2"]
            assert await store.expire("t2", state, epoch, updated, "stuck")
            assert await store.create(of("t4", "acme"), tenant_limit=2) is None
            with pytest.raises(errors.OverloadedError):
                await store.create(of("t5", "acme"), tenant_limit=2)
            # Without a limit nothing is counted or refused.
            assert await store.create(of("t6", "acme")) is None

    run(scenario)


@pytest.fixture(params=["redis", "cluster"])
def redis_settings(request: pytest.FixtureRequest, settings: StoreSettings) -> StoreSettings:
    """`settings` on one server, then on the module's Redis Cluster."""
    if request.param == "cluster":
        return replace(settings, url=request.getfixturevalue("redis_cluster").url)
    return settings


# Redis only: a replica that died between a request's end and its uncounting (issue 21: the
# tenant's count and the live index are separate steps, no longer one script).
def test_a_place_left_taken_by_a_dead_replica_is_freed_when_the_tenant_is_full(
    redis_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.store import redis_store  # noqa: PLC0415 (its grace, patched here)

    def of(rid: str) -> RequestRecord:
        return replace(record(rid, epoch=1), tenant="acme")

    async def scenario() -> None:
        keys = Keys(redis_settings.prefix)
        async with opened(redis_settings) as store, raw(redis_settings.url) as client:
            assert await store.create(of("a"), tenant_limit=2) is None
            assert await store.create(of("b"), tenant_limit=2) is None
            # a's end recorded, then its replica died before uncounting it:
            await client.hset(keys.request("a"), "state", str(State.DONE))
            # b's counted place, but its record never written (died before creating it):
            await client.delete(keys.request("b"))
            assert await store.create(of("c"), tenant_limit=2) is None  # a's place, freed
            with pytest.raises(errors.OverloadedError):  # b may still be being created
                await store.create(of("d"), tenant_limit=2)
            assert await store.get("d") is None
            monkeypatch.setattr(redis_store, "INDEX_GRACE_S", 0.0)  # b's creation is over
            assert await store.create(of("d"), tenant_limit=2) is None
            with pytest.raises(errors.OverloadedError):
                await store.create(of("e"), tenant_limit=2)

    run(scenario)


# Redis only: the live index is written around the record (issue 21).
def test_stale_live_index_entries_leave_at_the_next_takeover_scan(
    redis_settings: StoreSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.store import redis_store  # noqa: PLC0415 (its grace, patched here)

    async def scenario() -> None:
        keys = Keys(redis_settings.prefix)
        async with opened(redis_settings) as store, raw(redis_settings.url) as client:
            for rid in ("ended", "missing", "live"):
                assert await store.create(record(rid, epoch=1)) is None
                assert await store.release_lease(rid, "orch-1")
            await client.hset(keys.request("ended"), "state", str(State.DONE))  # then died
            await client.delete(keys.request("missing"))  # indexed, never created (yet?)
            assert await store.active() == ["ended", "live", "missing"]
            assert await store.take_over("ended", "orch-2") is None
            assert await store.take_over("missing", "orch-2") is None
            assert await store.active() == ["live", "missing"]  # may be being created
            monkeypatch.setattr(redis_store, "INDEX_GRACE_S", 0.0)
            assert await store.take_over("missing", "orch-2") is None
            assert await store.take_over("live", "orch-2") == 2
            assert await store.active() == ["live"]

    run(scenario)


# ------------------------------------------------------------------ client-chosen names

SUFFIXES = (":journal", ":owner", ":client")
"""What the key layout before issue 17 appended to a record's key: a request id ending in one
of them named another request's journal, lease or attachment."""

VICTIMS = ("V", "{V}", "a:b}{", "ünï-日本-🙂", "é" * 128)
"""Request ids with a hash-tag brace, a colon, non-ASCII, 256 UTF-8 bytes."""


async def _drive(store: Store, rid: str, tokens: tuple[int, ...]) -> None:
    """What a running request writes: its record, a journal entry, its lease, a client."""
    assert await store.create(record(rid, epoch=1)) is None, rid
    await store.transition(rid, Edge.AGGREGATE, epoch=1)
    assert await store.append(rid, 1, JournalEntry(0, tokens, "t")) == len(tokens)
    await store.touch_client(rid, 60)
    assert await store.refresh_leases([(rid, 1)], "orch-1") == [True]


async def _finish(store: Store, rid: str, tokens: tuple[int, ...]) -> None:
    n = len(tokens)
    assert await store.append(rid, 1, JournalEntry(n, tokens, "u")) == 2 * n
    assert await store.refresh_lease(rid, "orch-1")
    await store.transition(rid, Edge.FINISH, epoch=1)


async def _intact(store: Store, rid: str, tokens: tuple[int, ...]) -> None:
    got = await store.get(rid)
    assert got is not None, rid
    assert (got.request_id, got.state, got.epoch, got.output_tokens) == (
        rid, State.DONE, 1, 2 * len(tokens)
    )  # fmt: skip
    assert await store.journal(rid) == [
        JournalEntry(0, tokens, "t"), JournalEntry(len(tokens), tokens, "u")
    ]  # fmt: skip
    assert await store.client_attached(rid)


@pytest.mark.parametrize("attacker_first", [False, True], ids=["victim-first", "attacker-first"])
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("victim", VICTIMS)
def test_an_id_naming_another_requests_key_leaves_it_intact(
    backend: Backend, victim: str, suffix: str, attacker_first: bool
) -> None:
    """Issue 17: `V:journal` was V's journal key, `Z:owner` Z's lease (WRONGTYPE, records
    destroyed, takeover loops). Both requests now run side by side, each with its own state."""
    attacker = victim + suffix
    first, second = (attacker, victim) if attacker_first else (victim, attacker)
    mine = {victim: (1, 2, 3), attacker: (7, 8)}

    async def scenario() -> None:
        async with backend.open() as store:
            await _drive(store, first, mine[first])
            await _drive(store, second, mine[second])
            assert sorted(await store.active()) == sorted([victim, attacker])
            assert await store.lease_holders([victim, attacker]) == ["orch-1", "orch-1"]
            await _finish(store, first, mine[first])
            await _finish(store, second, mine[second])
            for rid in (victim, attacker):
                await _intact(store, rid, mine[rid])
            assert await store.active() == []

    run(scenario)


@pytest.mark.parametrize("victim", ["V", "{V}", "日本"])
def test_taking_over_a_colliding_id_leaves_the_other_request_be(
    backend: Backend, victim: str
) -> None:
    """The takeover loop of issue 17: releasing, retaking and taking over `V:owner` must not
    touch V's lease, and V's lapsed lease is taken over at V's epoch only."""

    async def scenario() -> None:
        async with backend.open() as store:
            for rid in (victim, victim + ":owner", victim + ":journal"):
                assert await store.create(record(rid, epoch=1)) is None
            assert await store.release_lease(victim + ":owner", "orch-1")
            assert await store.take_over(victim + ":owner", "orch-2") == 2
            assert await store.take_over(victim, "orch-2") is None  # V's lease is still held
            assert await store.release_lease(victim, "orch-1")
            assert await store.take_over(victim, "orch-3") == 2
            holders = await store.lease_holders([victim, victim + ":owner", victim + ":journal"])
            assert holders == ["orch-3", "orch-2", "orch-1"]
            state, epoch, updated = (await store.progress([victim + ":journal"]))[
                victim + ":journal"
            ]
            assert await store.expire(victim + ":journal", state, epoch, updated, "stuck")
            got = await store.get(victim)
            assert got is not None
            assert (got.state, got.epoch, got.owner) == (State.QUEUED, 2, "orch-3")
            assert sorted(await store.active()) == sorted([victim, victim + ":owner"])

    run(scenario)


@pytest.mark.parametrize("attacker_first", [False, True], ids=["victim-first", "attacker-first"])
@pytest.mark.parametrize("victim", ["T", "{T}", "a:b", "日本"])
def test_a_tenant_naming_another_tenants_key_leaves_it_intact(
    backend: Backend, victim: str, attacker_first: bool
) -> None:
    """Issue 17: tenant `T:live`'s cost totals were tenant T's live set (every later request
    of T failed with WRONGTYPE). Limits and totals stay per tenant."""
    attacker = victim + ":live"

    async def scenario() -> None:
        async with backend.open() as store:
            order = (attacker, victim) if attacker_first else (victim, attacker)
            for n, tenant in enumerate(order):
                rid = f"r{n}"
                assert await store.create(replace(record(rid, epoch=1), tenant=tenant), 1) is None
                await store.transition(rid, Edge.AGGREGATE, epoch=1)
                await store.transition(rid, Edge.FINISH, epoch=1)
                await store.add_tenant_cost(tenant, {"usd": 1.0 + n, "transfer_bytes": 10})
            # Each tenant's one slot is free again, and is its own.
            assert await store.create(replace(record("v", epoch=1), tenant=victim), 1) is None
            assert await store.create(replace(record("a", epoch=1), tenant=attacker), 1) is None
            with pytest.raises(errors.OverloadedError):
                await store.create(replace(record("v2", epoch=1), tenant=victim), 1)
            costs = await store.tenant_costs()
            assert set(costs) == {victim, attacker}
            for n, tenant in enumerate(order):
                assert (costs[tenant]["requests"], costs[tenant]["usd"]) == (1, 1.0 + n)

    run(scenario)


# Redis Cluster only: the wrong scheme.
def test_a_plain_url_to_a_cluster_node_says_to_use_the_cluster_scheme(
    redis_cluster: LocalRedisCluster,
) -> None:
    plain = f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0"

    async def scenario() -> None:
        async with opened(doomed_settings(plain)) as store:
            port = redis_cluster.nodes[0].port
            with redis.Redis(port=port) as client:
                ranges = [(r[0], r[1]) for r in client.cluster("SLOTS") if r[2][1] == port]
            theirs = next(  # an id whose slot another node serves: MOVED
                rid
                for rid in (f"r{i}" for i in range(64))
                if not any(lo <= key_slot(Keys().request(rid).encode()) <= hi for lo, hi in ranges)
            )
            with pytest.raises(errors.UnavailableError, match="redis\\+cluster://"):
                await store.get(theirs)

    run(scenario)


# Redis only: a key of the wrong type, written behind the store's back.
def test_a_redis_error_is_unavailable_without_redis_text(
    settings: StoreSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis's own words (WRONGTYPE, script names) reach the log, never a caller's message."""

    async def scenario() -> None:
        async with opened(settings) as store, raw(settings.url) as client:
            await client.set(Keys(settings.prefix).request("r1"), "not a hash")
            with pytest.raises(errors.UnavailableError) as info:
                await store.get("r1")
            with pytest.raises(errors.UnavailableError) as info2:
                await store.append("r1", 0, JournalEntry(0, (1,), "a"))
            for exc in (info.value, info2.value):
                assert "WRONGTYPE" not in str(exc)
                assert "request store" in str(exc)
                assert isinstance(exc.__cause__, redis.ResponseError)

    with caplog.at_level("WARNING", logger="orchestrator.store.redis_store"):
        run(scenario)
    assert "WRONGTYPE" in caplog.text
