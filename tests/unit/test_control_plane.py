"""The control plane in one process: drive, failover, relay, leases, takeover, cancel, detach.

Against `MemoryStore` and a fake worker fleet (`tests.unit.control_fakes`): no Redis, no
worker processes. Waits are short real time (watch steps of 10 ms) or the store's
`ManualClock` (lease TTLs, deadlines); every test runs under a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from orchestrator import errors
from orchestrator.control.failover import ATTEMPTS_IN_ALL, STREAK_SPAN
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.orchestrator import ControlSettings, GenerateInput, Orchestrator, OutChunk
from orchestrator.core.breaker import BreakerState
from orchestrator.core.deadlines import StateDeadlines
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge, State
from orchestrator.store.memory import ManualClock, MemoryStore
from orchestrator.store.settings import StoreSettings
from tests.unit.control_fakes import FakeFleet, FakeWorker, logprob, token

FAST = ControlSettings(
    watch_interval_s=0.01,
    token_timeout_s=5.0,
    retry_initial_s=0.001,
    retry_max_s=0.005,
    follow_poll_s=0.005,
    attach_refresh_s=0.05,
    reap_interval_s=0.01,
    detach_grace_s=5.0,
)
LIMIT_S = 10.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


async def setup(
    *workers: FakeWorker,
    settings: ControlSettings = FAST,
    store: MemoryStore | None = None,
    owner: str = "a",
) -> tuple[Orchestrator, MemoryStore, ControlMetrics]:
    store = store or MemoryStore(StoreSettings(url="memory://", outage_s=2.0))
    for w in workers:
        await store.heartbeat(w.info, 1e6)
    metrics = ControlMetrics()
    fleet = FakeFleet(*workers)
    return Orchestrator(store, fleet.as_clients(), settings, owner, metrics), store, metrics


def inp(rid: str = "r1", max_tokens: int = 6) -> GenerateInput:
    return GenerateInput(request_id=rid, token_ids=(1, 2, 3), max_tokens=max_tokens)


async def collect(stream: AsyncIterator[OutChunk]) -> list[OutChunk]:
    return [c async for c in stream]


def assert_contiguous(chunks: list[OutChunk], n: int, finish: str = "length") -> None:
    """Every token index 0..n-1 exactly once, in order, with its token; then the finish."""
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == [token(i) for i in range(n)]
    starts = [c.index for c in chunks if c.token_ids]
    assert starts == sorted(set(starts))
    assert chunks[-1].finish_reason == finish


async def eventually(what: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    """Poll a condition (of the store, a fake worker) until it holds; fail after ``within_s``."""
    async with asyncio.timeout(within_s):
        while not await what():  # noqa: ASYNC110 (a condition of state, not of an event)
            await asyncio.sleep(0.005)


async def state_is(store: MemoryStore, rid: str, state: State) -> bool:
    record = await store.get(rid)
    return record is not None and record.state is state


def metric(m: ControlMetrics, line: str) -> bool:
    return line in generate_latest(m.registry).decode()


# ---------------------------------------------------------------------- the happy path


def test_disaggregated_request_is_journalled_and_recorded() -> None:
    async def main() -> None:
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode")
        orch, store, _ = await setup(p0, d0)
        chunks = await collect(orch.generate(inp(max_tokens=6)))
        assert_contiguous(chunks, 6)
        record = chunks[-1].record
        assert record is not None
        assert record.state is State.DONE
        assert record.epoch == 1
        assert (record.mode, record.prefill_worker, record.decode_worker) == (
            "disaggregated", "p0", "d0",
        )  # fmt: skip
        assert record.output_tokens == 6
        assert record.kv_bytes > 0
        assert record.cost["prefill_gpu_s"] > 0
        assert record.cost["decode_gpu_s"] > 0
        journal = await store.journal("r1")
        assert [t for e in journal for t in e.token_ids] == [token(i) for i in range(6)]
        assert await store.active() == []  # ended: no lease, nothing left to reap

    run(main())


def test_a_client_chooses_its_chunk_window() -> None:
    """A request's ``chunk_window_ms`` is the coalescing window its worker stream is asked
    for, disaggregated or aggregated; 0 leaves the replica's ``stream_flush_ms``."""

    async def main() -> None:
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode")
        orch, _, _ = await setup(p0, d0, settings=replace(FAST, stream_flush_ms=40.0))
        assert_contiguous(await collect(orch.generate(inp("r1"))), 6)
        windowed = replace(inp("r2"), chunk_window_ms=1000)
        assert_contiguous(await collect(orch.generate(windowed)), 6)
        assert d0.windows == [40.0, 1000.0]
        a0 = FakeWorker("a0", "decode")  # no prefill pool: aggregated on it
        orch, _, _ = await setup(a0, settings=replace(FAST, stream_flush_ms=40.0))
        assert_contiguous(await collect(orch.generate(replace(inp("r3"), chunk_window_ms=250))), 6)
        assert a0.windows == [250.0]

    run(main())


class _CallCountingStore(MemoryStore):
    """Records the request-path calls a request makes (issue 21: the fixed cost per request
    is its store round trips); what `end` does inside is the store's business (one script
    on Redis), not recorded."""

    def __init__(self) -> None:
        super().__init__(StoreSettings(url="memory://", outage_s=2.0))
        self.calls: list[str] = []
        self.created: list[RequestRecord] = []
        self.before: dict[str, RequestRecord] = {}
        """Edge name -> the record just before the last transition taking that edge."""
        self._inside = False

    def _record(self, call: str) -> None:
        if not self._inside:
            self.calls.append(call)

    async def transition(
        self, request_id: str, edge: Edge, *, epoch: int, fields: Mapping[str, Any] | None = None
    ) -> int:
        self._record(f"transition {edge.wire}")
        if (record := await super().get(request_id)) is not None:
            self.before[edge.wire] = record
        return await super().transition(request_id, edge, epoch=epoch, fields=fields)

    async def end(
        self,
        request_id: str,
        edge: Edge,
        *,
        epoch: int,
        tenant: str,
        cost: Mapping[str, Any],
        fields: Mapping[str, Any] | None = None,
    ) -> RequestRecord:
        self._record(f"end {edge.wire}")
        self._inside = True
        try:
            return await super().end(
                request_id, edge, epoch=epoch, tenant=tenant, cost=cost, fields=fields
            )
        finally:
            self._inside = False

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        taken = sorted(e.wire for e in (edges or {}).values())
        self._record("append" + "".join(f" +{w}" for w in taken))
        return await super().append_many(items, edges=edges)

    async def add_tenant_cost(self, tenant: str, cost: Mapping[str, Any]) -> None:
        self._record("add_tenant_cost")
        await super().add_tenant_cost(tenant, cost)

    async def create(self, record: RequestRecord, tenant_limit: int = 0) -> RequestRecord | None:
        self._record("create")
        self.created.append(record)
        return await super().create(record, tenant_limit)

    async def get(self, request_id: str) -> RequestRecord | None:
        self._record("get")
        return await super().get(request_id)


def test_a_disaggregated_request_costs_three_store_calls_besides_its_journal() -> None:
    # The fixed cost per request (issue 21): the record is created placed (prefilling, its
    # workers named: `PREFILL` taken with the creation), then KV_SENT, then KV_ADOPTED
    # taken by the first chunk's journal write (not a call of its own), and the end — its
    # transition, indexes, the tenant's cost and the final record — as ONE `end` call.
    async def main() -> None:
        store = _CallCountingStore()
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), FakeWorker("d0", "decode"),
                                 store=store)  # fmt: skip
        chunks = await collect(orch.generate(inp(max_tokens=6)))
        assert_contiguous(chunks, 6)
        record = chunks[-1].record
        assert record is not None
        assert (record.state, record.output_tokens, record.epoch) == (State.DONE, 6, 1)
        calls = [c for c in store.calls if c != "append"]
        assert calls == ["create", "transition kv_sent", "append +kv_adopted", "end finish"]
        created = store.created[0]
        assert (created.state, created.epoch, created.mode) == (
            State.PREFILLING, 1, "disaggregated",
        )  # fmt: skip
        assert (created.prefill_worker, created.decode_worker) == ("p0", "d0")
        assert created.placement == record.placement != ""
        assert (await store.tenant_costs())["default"]["requests"] == 1
        assert orch.ledger.booked() == {}

    run(main())


class _GatedKvSent(MemoryStore):
    """KV_SENT waits for ``gate``; ``in_flight`` is set while it waits."""

    def __init__(self) -> None:
        super().__init__(StoreSettings(url="memory://", outage_s=2.0))
        self.gate = asyncio.Event()
        self.in_flight = asyncio.Event()

    async def transition(
        self, request_id: str, edge: Edge, *, epoch: int, fields: Mapping[str, Any] | None = None
    ) -> int:
        if edge is Edge.KV_SENT:
            self.in_flight.set()
            await self.gate.wait()
        return await super().transition(request_id, edge, epoch=epoch, fields=fields)


async def _decoding_while_kv_sent_waits(
    d0: FakeWorker,
) -> tuple[Orchestrator, _GatedKvSent, list[OutChunk], asyncio.Task[None]]:
    """Request ``r1`` started on ``d0``, held where its decode call is open and KV_SENT
    waits for the store's gate: the orchestrator, the store, the chunks the client has
    received and the task receiving them."""
    store = _GatedKvSent()
    orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, store=store)
    chunks: list[OutChunk] = []

    async def consume() -> None:
        async for chunk in orch.generate(inp()):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    await store.in_flight.wait()
    await eventually(lambda: _true(d0.decoded("r1", 1) == 1))
    return orch, store, chunks, task


def test_kv_sent_is_recorded_while_the_decode_stream_opens() -> None:
    # A round trip off the first token (issue 21): the decode worker is asked to adopt
    # the KV while KV_SENT is being written, and no token moves (nor KV_ADOPTED is taken)
    # before that write is done.
    async def main() -> None:
        _, store, chunks, task = await _decoding_while_kv_sent_waits(FakeWorker("d0", "decode"))
        await asyncio.sleep(0.05)
        assert [c for c in chunks if c.token_ids] == []
        record = await store.get("r1")
        assert record is not None
        assert record.state is State.PREFILLING
        store.gate.set()
        await task
        assert_contiguous(chunks, 6)

    run(main())


def test_a_kv_sent_refused_while_the_decode_stream_opens_ends_the_attempt() -> None:
    # The request was cancelled elsewhere while KV_SENT was in flight: the write is
    # refused, the decode stream (already asked for) is closed and its KV released, no
    # token reaches the client, and the request ends as the cancel left it.
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.2)
        orch, store, chunks, task = await _decoding_while_kv_sent_waits(d0)
        assert await orch.cancel("r1") is State.CANCELLED
        store.gate.set()
        await task
        assert [t for c in chunks for t in c.token_ids] == []
        assert chunks[-1].finish_reason == "cancelled"
        assert ("r1", 1) in d0.released
        record = await store.get("r1")
        assert record is not None
        assert record.state is State.CANCELLED
        assert orch.ledger.booked() == {}

    run(main())


def test_the_prefilling_phase_is_in_the_store_while_the_prefill_runs() -> None:
    # The chaos tool's phase triggers watch the record: created placed, it says
    # prefilling (and which workers) from its creation until KV_SENT moves it on.
    async def main() -> None:
        store = _CallCountingStore()
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), FakeWorker("d0", "decode"),
                                 store=store)  # fmt: skip
        assert_contiguous(await collect(orch.generate(inp())), 6)
        during = store.before["kv_sent"]
        assert (during.state, during.prefill_worker, during.decode_worker) == (
            State.PREFILLING, "p0", "d0",
        )  # fmt: skip

    run(main())


def test_an_aggregated_request_is_created_placed_too() -> None:
    async def main() -> None:
        store = _CallCountingStore()
        orch, _, _ = await setup(FakeWorker("d0", "decode"), store=store)
        assert_contiguous(await collect(orch.generate(inp())), 6)
        assert [c for c in store.calls if c != "append"] == ["create", "end finish"]
        created = store.created[0]
        assert (created.state, created.mode, created.decode_worker) == (
            State.DECODING, "aggregated", "d0",
        )  # fmt: skip
        assert orch.ledger.booked() == {}

    run(main())


def test_a_failover_takes_the_placement_edge_as_a_transition() -> None:
    # Only the first attempt is created placed: the next one (epoch 2) moves the request
    # out of queued by its own transition.
    async def main() -> None:
        store = _CallCountingStore()
        d0 = FakeWorker("d0", "decode", fail_after=3)
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, FakeWorker("d1", "decode"),
                                 store=store)  # fmt: skip
        assert_contiguous(await collect(orch.generate(inp(max_tokens=8))), 8)
        calls = [c for c in store.calls if c not in {"append", "get"}]
        assert calls == [
            "create", "transition kv_sent", "append +kv_adopted", "transition requeue",
            "transition prefill", "transition kv_sent", "append +kv_adopted", "end finish",
        ]  # fmt: skip
        record = await orch.get("r1")
        assert (record.state, record.epoch, record.decode_worker) == (State.DONE, 2, "d1")
        assert orch.ledger.booked() == {}

    run(main())


def test_a_request_not_placeable_at_creation_is_created_queued_and_placed_by_its_drive() -> None:
    # No decode pool and no fallback: nothing to book; the record is created queued and
    # the drive's attempts (which fail: nothing placeable) end it exactly once.
    async def main() -> None:
        store = _CallCountingStore()
        settings = replace(FAST, fallback="fail", max_attempts=2)
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), settings=settings, store=store)
        with pytest.raises(errors.UnavailableError):
            await collect(orch.generate(inp()))
        assert store.created[0].state is State.QUEUED
        assert [c for c in store.calls if c == "end fail"] == ["end fail"]
        assert (await orch.get("r1")).state is State.FAILED
        assert orch.ledger.booked() == {}

    run(main())


def test_a_decode_stream_opening_with_an_empty_chunk_adopts_with_its_first_token() -> None:
    # The adoption rides with the first *journalled* chunk: a keep-alive before it (no
    # token, nothing journalled) leaves it for the next write.
    async def main() -> None:
        store = _CallCountingStore()
        d0 = FakeWorker("d0", "decode", empty_first=True)
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, store=store)
        chunks = await collect(orch.generate(inp(max_tokens=6)))
        assert_contiguous(chunks, 6)
        record = chunks[-1].record
        assert record is not None
        assert record.state is State.DONE
        assert "append +kv_adopted" in store.calls
        assert "transition kv_adopted" not in store.calls

    run(main())


def test_a_resubmission_follows_and_a_different_body_is_refused() -> None:
    async def main() -> None:
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), FakeWorker("d0", "decode"))
        first = await collect(orch.generate(inp()))
        again = await collect(orch.generate(inp()))
        assert [c.token_ids for c in again] == [c.token_ids for c in first]
        with pytest.raises(errors.ConflictError):
            await collect(orch.generate(replace(inp(), max_tokens=7)))
        # Each call booked a placement before it knew the id was taken: given back.
        assert orch.ledger.booked() == {}

    run(main())


# ------------------------------------------------------------------------- failover


def test_decode_worker_dying_mid_stream_fails_over_without_gap_or_duplicate() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", fail_after=3)
        d1 = FakeWorker("d1", "decode")
        orch, _store, metrics = await setup(FakeWorker("p0", "prefill"), d0, d1)
        chunks = await collect(orch.generate(inp(max_tokens=8)))
        assert_contiguous(chunks, 8)
        record = await orch.get("r1")
        assert record.state is State.DONE
        assert record.epoch == 2
        assert record.decode_worker == "d1"
        assert d0.decoded("r1", 1) == 1
        assert d1.decoded("r1", 2) == 1
        assert metric(metrics, 'pdorch_failovers_total{cause="decode"} 1.0')
        assert orch.ledger.breakers.state("d0@d0:1", 0.0) is BreakerState.OPEN

    run(main())


def test_log_probabilities_survive_a_failover_and_a_resubmission_replays_them() -> None:
    """Issue 17 defect 13: each token keeps the log probability it was streamed with (the
    prefill's first one included), the prompt's come once, a failover's re-prefill asks no
    prompt log probabilities again, and a client attaching again (from the journal) gets
    exactly what the first stream carried."""

    async def main() -> None:
        p0 = FakeWorker("p0", "prefill")
        d0 = FakeWorker("d0", "decode", fail_after=3)
        d1 = FakeWorker("d1", "decode")
        orch, _store, _ = await setup(p0, d0, d1)
        asked = replace(inp(max_tokens=8), sampling=SamplingParams(logprobs=1, prompt_logprobs=0))
        chunks = await collect(orch.generate(asked))
        assert_contiguous(chunks, 8)
        scores = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token_id for lp in scores] == [token(i) for i in range(8)]
        assert [lp.logprob for lp in scores] == [logprob(i).logprob for i in range(8)]
        prompt = [lp for c in chunks for lp in c.prompt_logprobs]
        assert [lp.token_id for lp in prompt] == [1, 2, 3]
        assert (await orch.get("r1")).epoch == 2  # it did fail over
        assert [s.HasField("prompt_logprobs") for s in p0.samplings] == [True, False]
        again = await collect(orch.generate(asked))
        assert [lp for c in again for lp in c.logprobs] == scores
        assert [lp for c in again for lp in c.prompt_logprobs] == prompt
        resumed = await collect(orch.generate(replace(asked, resume_from=5)))
        assert [lp for c in resumed for lp in c.logprobs] == scores[5:]

    run(main())


def test_a_half_open_workers_probe_is_over_at_its_first_token() -> None:
    """Issue 18, defect 2: a half-open breaker's probe was the whole stream, and the worker
    was held back from every other placement until it ended."""

    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.05)
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0)
        breakers = orch.ledger.breakers
        breakers.failure("d0@d0:1", time.monotonic() - 10)  # failed a while ago: half-open
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in orch.generate(inp(max_tokens=20)):
                got.append(chunk)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 1))
        assert breakers.blocked(time.monotonic()) == set()  # closed at the first token
        assert not task.done()  # while the probe's stream goes on
        await task
        assert_contiguous(got, 20)

    run(main())


def test_a_decode_worker_whose_heartbeat_stops_is_failed_over() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", hang_after=2)
        orch, store, metrics = await setup(
            FakeWorker("p0", "prefill"), d0, FakeWorker("d1", "decode")
        )
        task = asyncio.create_task(collect(orch.generate(inp(max_tokens=6))))

        async def hung() -> bool:
            record = await store.get("r1")
            return record is not None and record.output_tokens >= 2

        await eventually(hung)
        await store.deregister("d0")  # its heartbeat key expired
        chunks = await task
        assert_contiguous(chunks, 6)
        assert metric(metrics, 'pdorch_failovers_total{cause="heartbeat"} 1.0')
        assert d0.cancelled == 1  # the stream was dropped, not left open

    run(main())


def test_a_silent_stream_is_failed_over() -> None:
    async def main() -> None:
        settings = replace(FAST, token_timeout_s=0.05)
        d0 = FakeWorker("d0", "decode", hang_after=1)
        orch, _, metrics = await setup(
            FakeWorker("p0", "prefill"), d0, FakeWorker("d1", "decode"), settings=settings
        )
        assert_contiguous(await collect(orch.generate(inp())), 6)
        assert metric(metrics, 'pdorch_failovers_total{cause="silence"} 1.0')

    run(main())


def test_a_prefill_failure_blamed_on_the_kv_target_avoids_the_decode_worker() -> None:
    async def main() -> None:
        p0 = FakeWorker("p0", "prefill", prefill_error=grpc.StatusCode.UNAVAILABLE)
        p0.blame_kv_target = True
        d0, d1 = FakeWorker("d0", "decode"), FakeWorker("d1", "decode")
        orch, _, metrics = await setup(p0, d0, d1)

        task = asyncio.create_task(collect(orch.generate(inp())))
        await eventually(lambda: _true(bool(p0.calls)))
        p0.prefill_error = None  # only the first prefill fails
        chunks = await task
        assert_contiguous(chunks, 6)
        record = await orch.get("r1")
        # The prefill worker reported it; the KV's receiver was at fault: d0 is avoided,
        # p0 prefills again, and d0 is told to drop KV it may hold for the failed epoch.
        assert (record.prefill_worker, record.decode_worker, record.epoch) == ("p0", "d1", 2)
        assert d0.released == [("r1", 1)]
        assert d1.decoded("r1", 2) == 1
        assert metric(metrics, 'pdorch_failovers_total{cause="prefill"} 1.0')

    run(main())


async def _true(value: bool) -> bool:
    return value


def test_a_non_retryable_worker_error_fails_the_request_at_once() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", fail_after=1, fail_code=grpc.StatusCode.FAILED_PRECONDITION)
        d1 = FakeWorker("d1", "decode")
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, d1)
        with pytest.raises(errors.WorkerError):
            await collect(orch.generate(inp()))
        record = await orch.get("r1")
        assert record.state is State.FAILED
        assert "FAILED_PRECONDITION" in record.error
        assert d1.calls == []  # not retried

    run(main())


def test_failover_gives_up_after_max_attempts() -> None:
    """Decode workers that fail before their first token: each attempt relays only the
    prefill's token, no progress; the request fails after ``max_attempts`` of them."""

    async def main() -> None:
        settings = replace(FAST, max_attempts=2, retry_max_s=0.0)  # no span to outlast
        workers = [FakeWorker(f"d{i}", "decode", fail_after=0) for i in range(3)]
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), *workers, settings=settings)
        with pytest.raises(errors.WorkerError):
            await collect(orch.generate(inp()))
        record = await orch.get("r1")
        assert record.state is State.FAILED
        assert record.epoch == 2
        assert workers[2].calls == []

    run(main())


def test_failed_attempts_in_a_row_end_a_request_only_once_they_span_the_window() -> None:
    """``max_attempts`` failed attempts in a row within a blink do not end the request: the
    run must also last ``STREAK_SPAN`` × ``retry_max_s`` (a fault on every link for a
    moment is outlasted); the attempts in all still bound it."""

    async def main() -> None:
        settings = replace(FAST, max_attempts=2, retry_initial_s=0.0, retry_max_s=0.2)
        workers = [FakeWorker(f"d{i}", "decode", fail_after=0) for i in range(12)]
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), *workers, settings=settings)
        started = time.monotonic()
        with pytest.raises(errors.WorkerError):
            await collect(orch.generate(inp()))
        assert time.monotonic() - started >= STREAK_SPAN * settings.retry_max_s
        record = await orch.get("r1")
        assert record.state is State.FAILED
        assert 2 < record.epoch <= ATTEMPTS_IN_ALL * 2

    run(main())


def test_attempts_that_move_the_request_on_do_not_spend_the_budget() -> None:
    """Four decode workers each relay three tokens, then break (a link fault hitting every
    worker in turn): with ``max_attempts=2`` the request still completes on the fifth,
    contiguous, since every failed attempt made progress."""

    async def main() -> None:
        settings = replace(FAST, max_attempts=2)
        breaking = [FakeWorker(f"d{i}", "decode", fail_after=3) for i in range(4)]
        healthy = FakeWorker("d9", "decode")
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), *breaking, healthy, settings=settings)
        assert_contiguous(await collect(orch.generate(inp(max_tokens=30))), 30)
        record = await orch.get("r1")
        assert (record.state, record.epoch, record.decode_worker) == (State.DONE, 5, "d9")

    run(main())


def test_a_request_every_worker_failed_tries_them_again() -> None:
    """Every worker breaks after a few tokens (a fault on every link at once): once each
    has failed the request it is placed on them again rather than failed with "no workers
    available", and completes, contiguous, moving on at every attempt."""

    async def main() -> None:
        settings = replace(FAST, max_attempts=2)
        workers = [
            FakeWorker("p0", "prefill", fail_after=3),
            FakeWorker("d0", "decode", fail_after=3),
            FakeWorker("d1", "decode", fail_after=3),
        ]
        orch, _, _ = await setup(*workers, settings=settings)
        assert_contiguous(await collect(orch.generate(inp(max_tokens=24))), 24)
        record = await orch.get("r1")
        assert record.state is State.DONE
        assert record.epoch > len(workers)  # past the point where all had failed it

    run(main())


def test_attempts_that_move_the_request_on_are_bounded_in_all() -> None:
    """Every attempt makes progress and then breaks: the request fails after
    ``ATTEMPTS_IN_ALL`` × ``max_attempts`` attempts, not at its last token."""

    async def main() -> None:
        settings = replace(FAST, max_attempts=2)
        breaking = [FakeWorker(f"d{i}", "decode", fail_after=2) for i in range(12)]
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), *breaking, settings=settings)
        with pytest.raises(errors.WorkerError):
            await collect(orch.generate(inp(max_tokens=100)))
        record = await orch.get("r1")
        assert record.state is State.FAILED
        assert record.epoch == ATTEMPTS_IN_ALL * 2
        assert sum(1 for w in breaking if w.calls) == ATTEMPTS_IN_ALL * 2

    run(main())


def test_aggregated_when_the_prefill_pool_is_down() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", fail_after=2)
        d1 = FakeWorker("d1", "decode")
        orch, _, metrics = await setup(d0, d1)
        assert_contiguous(await collect(orch.generate(inp())), 6)
        record = await orch.get("r1")
        assert (record.mode, record.decode_worker, record.epoch) == ("aggregated", "d1", 2)
        assert metric(metrics, 'pdorch_failovers_total{cause="generate"} 1.0')

    run(main())


# ----------------------------------------------------------------- relay and journal


def test_tokens_keep_flowing_while_the_store_is_down_and_are_journalled_after() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        orch, store, _ = await setup(FakeWorker("p0", "prefill"), d0)
        got: list[OutChunk] = []
        during = 0

        async def client() -> None:
            nonlocal during
            async for chunk in orch.generate(inp(max_tokens=12)):
                got.append(chunk)
                if not store.available:
                    during += 1

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 3))
        store.available = False
        await asyncio.sleep(0.05)
        store.available = True
        await task
        assert during > 0  # the client was served while nothing could be journalled
        assert_contiguous(got, 12)
        journal = await store.journal("r1")
        assert [t for e in journal for t in e.token_ids] == [token(i) for i in range(12)]
        assert (await orch.get("r1")).state is State.DONE

    run(main())


def test_a_failover_during_a_store_outage_waits_it_out() -> None:
    """Issue 18, defect 3: a decode worker failed while Redis restarted; the failover loop's
    4 attempts with backoff (milliseconds here, under half a second by default) were spent
    on the outage and the request failed. Its store calls now wait the outage out."""

    async def main() -> None:
        d0 = FakeWorker("d0", "decode", fail_after=3, delay_s=0.05)
        d1 = FakeWorker("d1", "decode")
        orch, store, _ = await setup(FakeWorker("p0", "prefill"), d0, d1)
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in orch.generate(inp(max_tokens=8)):
                got.append(chunk)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 1))
        store.available = False  # Redis restarts; d0 fails two chunks later
        await eventually(lambda: _true(d0.cancelled > 0))
        await asyncio.sleep(0.5)  # the outage goes on (its length, not a wait for a state)
        store.available = True
        await task
        assert_contiguous(got, 8)
        record = await orch.get("r1")
        assert (record.state, record.epoch, record.decode_worker) == (State.DONE, 2, "d1")

    run(main())


def test_a_store_outage_past_its_window_fails_the_request_with_a_store_error() -> None:
    """Past ``outage_s`` the request fails with an error that says so — once: the failover
    loop does not spend its attempts waiting the window out again."""

    async def main() -> None:
        d0 = FakeWorker("d0", "decode", fail_after=3, delay_s=0.05)
        store = MemoryStore(StoreSettings(url="memory://", outage_s=0.5))
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, FakeWorker("d1", "decode"),
                                 store=store)  # fmt: skip
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in orch.generate(inp(max_tokens=8)):
                got.append(chunk)
                if len(got) == 1:
                    store.available = False  # and it stays down

        started = asyncio.get_running_loop().time()
        with pytest.raises(errors.StoreUnavailableError, match=r"outage window of 0\.5 s"):
            await client()
        waited = asyncio.get_running_loop().time() - started
        # One window for the failover, one to record the end (1 s), not one per attempt
        # (4 attempts and the end: 2.5 s).
        assert waited < 2.0
        store.available = True
        record = await orch.get("r1")
        assert record.epoch == 1  # the failover never happened: the store was away

    run(main())


class _BuggyStore(MemoryStore):
    """A store whose journal append fails with a foreign exception (a bug, not an outage)."""

    async def append(self, request_id: str, epoch: int, entry: JournalEntry) -> int:
        raise RuntimeError("WRONGTYPE at 10.0.0.3:6379")

    async def append_many(
        self,
        items: Sequence[tuple[str, int, JournalEntry]],
        *,
        edges: Mapping[int, Edge] | None = None,
    ) -> list[int | errors.PdorchError]:
        raise RuntimeError("WRONGTYPE at 10.0.0.3:6379")


def test_a_bugs_text_never_reaches_the_client(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), FakeWorker("d0", "decode"),
                                 store=_BuggyStore())  # fmt: skip
        with pytest.raises(errors.UnavailableError) as failed:
            await collect(orch.generate(inp()))
        assert str(failed.value) == "request r1 failed: internal error"

    run(main())
    assert "WRONGTYPE at 10.0.0.3:6379" in caplog.text  # the operator's log has it


# ------------------------------------------------------------------- cancel, detach


def test_cancel_stops_the_run_and_its_worker_stream() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        orch, _store, _ = await setup(FakeWorker("p0", "prefill"), d0)
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in orch.generate(inp(max_tokens=200)):
                got.append(chunk)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 3))
        assert await orch.cancel("r1") is State.CANCELLED
        await task
        assert got[-1].finish_reason == "cancelled"
        assert (await orch.get("r1")).state is State.CANCELLED
        assert d0.cancelled == 1

    run(main())


def test_a_request_a_client_cancels_is_still_priced_and_counted_once() -> None:
    """The client's Cancel takes the terminal transition before the run can end it: the
    run's work is priced all the same — the record's cost, the tenant's totals — and the
    request counted cancelled, once (a QA pass: neither happened)."""

    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        orch, store, metrics = await setup(FakeWorker("p0", "prefill"), d0)
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in orch.generate(inp(max_tokens=200)):
                got.append(chunk)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 3))
        assert await orch.cancel("r1") is State.CANCELLED
        await task
        line = 'pdorch_requests_total{reason="cancelled",state="cancelled"} 1.0'
        await eventually(lambda: _true(metric(metrics, line)))
        record = await store.get("r1")
        assert record is not None
        assert record.state is State.CANCELLED
        assert record.cost.get("decode_gpu_s", 0) > 0  # the decode it got is priced
        totals = (await store.tenant_costs())["default"]
        assert totals["requests"] == 1
        # asked again (another replica, a retry): nothing more
        assert not await store.settle(
            "r1", State.CANCELLED, tenant="default", cost=record.cost, cost_json='{"usd": 1}'
        )
        assert (await store.tenant_costs())["default"]["requests"] == 1

    run(main())


def test_a_detached_request_is_cancelled_after_the_grace() -> None:
    async def main() -> None:
        settings = replace(FAST, detach_grace_s=0.05)
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        orch, store, _ = await setup(FakeWorker("p0", "prefill"), d0, settings=settings)
        stream = orch.generate(inp(max_tokens=500))
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.index >= 2:
                    break  # the client goes away
        await eventually(lambda: state_is(store, "r1", State.CANCELLED))
        await eventually(lambda: _true(d0.cancelled == 1))

    run(main())


def test_a_detached_request_with_a_follower_runs_to_its_end() -> None:
    async def main() -> None:
        settings = replace(FAST, detach_grace_s=0.05)
        d0 = FakeWorker("d0", "decode", delay_s=0.005)
        orch, _store, _ = await setup(FakeWorker("p0", "prefill"), d0, settings=settings)
        stream = orch.generate(inp(max_tokens=40))
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.index >= 2:
                    break
        # The client reconnects (here: through follow, as a resume on any replica does).
        chunks = await collect(orch.follow("r1", 0))
        assert_contiguous(chunks, 40)
        assert (await orch.get("r1")).state is State.DONE

    run(main())


# --------------------------------------------------------- ownership: leases, takeover


def test_a_request_whose_owner_died_is_taken_over_from_its_journal() -> None:
    async def main() -> None:
        clock = ManualClock()
        store = MemoryStore(StoreSettings(url="memory://", lease_ttl_s=3.0), clock=clock)
        spec = RequestSpec("r1", (1, 2, 3), 8)
        await store.create(spec.record("dead"))
        await store.transition("r1", Edge.AGGREGATE, epoch=1)
        for i in range(3):
            await store.append("r1", 1, JournalEntry(i, (token(i),), f"<{i}>"))
        d0 = FakeWorker("d0", "decode")
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, store=store, owner="b")
        await orch.start()
        try:
            clock.advance(3.5)  # the dead owner's lease lapses
            await eventually(lambda: state_is(store, "r1", State.DONE))
        finally:
            await orch.stop()
        record = await orch.get("r1")
        assert (record.epoch, record.owner) == (2, "b")
        journal = await store.journal("r1")
        assert [t for e in journal for t in e.token_ids] == [token(i) for i in range(8)]
        assert d0.decoded("r1", 2) == 1

    run(main())


def test_kv_held_for_a_request_taken_over_is_released_at_once() -> None:
    """Issue 18: the owner died between prefill and decode; its decode worker held the KV
    for the old epoch until its 30 s hold lease ran out. The new owner releases it."""

    async def main() -> None:
        clock = ManualClock()
        store = MemoryStore(StoreSettings(url="memory://", lease_ttl_s=3.0), clock=clock)
        spec = RequestSpec("r1", (1, 2, 3), 6)
        await store.create(spec.record("dead"))
        placed = {"mode": "disaggregated", "prefill_worker": "p0", "decode_worker": "d0"}
        await store.transition("r1", Edge.PREFILL, epoch=1, fields=placed)
        await store.transition("r1", Edge.KV_SENT, epoch=1)  # then the owner died
        d0 = FakeWorker("d0", "decode")
        orch, _, _ = await setup(FakeWorker("p0", "prefill"), d0, store=store, owner="b")
        await orch.start()
        try:
            clock.advance(3.5)  # the dead owner's lease lapses
            await eventually(lambda: _true(("r1", 1) in d0.released))
            await eventually(lambda: state_is(store, "r1", State.DONE))
        finally:
            await orch.stop()
        assert (await orch.get("r1")).epoch == 2
        assert d0.decoded("r1", 1) == 0  # the old epoch's KV was never adopted

    run(main())


def test_a_client_whose_request_a_peer_took_over_follows_the_new_owner() -> None:
    async def main() -> None:
        clock = ManualClock()
        # A long TTL: replica a refreshes every ttl/3 s of real time, i.e. never in this test.
        store_a = MemoryStore(StoreSettings(url="memory://", lease_ttl_s=30.0), clock=clock)
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        p0 = FakeWorker("p0", "prefill")
        a, _, _ = await setup(p0, d0, store=store_a, owner="a")
        b = Orchestrator(store_a.peer(), FakeFleet(p0, d0).as_clients(), FAST, "b")
        got: list[OutChunk] = []

        async def client() -> None:
            async for chunk in a.generate(inp(max_tokens=30)):
                got.append(chunk)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 3))
        await b.start()
        try:
            clock.advance(31)  # replica a stalled: its lease lapsed; b takes the request over
            await task
        finally:
            await b.stop()
            await a.stop()
        assert_contiguous(got, 30)
        record = await b.get("r1")
        assert (record.state, record.owner, record.epoch) == (State.DONE, "b", 2)

    run(main())


def test_the_deadline_reaper_fails_a_request_stuck_in_its_state() -> None:
    async def main() -> None:
        clock = ManualClock()
        store = MemoryStore(StoreSettings(url="memory://"), clock=clock)
        await store.create(RequestSpec("r1", (1, 2, 3), 8).record("a"))
        await store.transition("r1", Edge.PREFILL, epoch=1)
        settings = replace(FAST, deadline_scan_s=0.0, deadlines=StateDeadlines(prefilling_s=5.0))
        orch, _, _ = await setup(store=store, settings=settings, owner="reaper")
        # The owner keeps its lease (it is alive), so only the deadline can end the request.
        await store.refresh_lease("r1", "a")
        await orch.start()
        try:
            clock.advance(6.0)
            await store.refresh_lease("r1", "a")
            await eventually(lambda: state_is(store, "r1", State.FAILED))
        finally:
            await orch.stop()
        record: RequestRecord = await orch.get("r1")
        assert "prefilling" in record.error

    run(main())


def test_a_client_of_a_request_the_reaper_failed_is_told_it_failed_not_cancelled() -> None:
    """The reaper fails a request driven here (its decode stream silent past the decoding
    deadline): the drive is stopped, and its client gets the failure, not an OK
    "cancelled" end."""

    async def main() -> None:
        clock = ManualClock()
        store = MemoryStore(StoreSettings(url="memory://"), clock=clock)
        deadlines = StateDeadlines(decoding_s=5.0)
        settings = replace(FAST, deadline_scan_s=0.0, deadlines=deadlines, token_timeout_s=60.0)
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", hang_after=1)
        orch, _, _ = await setup(p0, d0, store=store, settings=settings)
        await orch.start()
        got: list[OutChunk | BaseException] = []

        async def client() -> None:
            try:
                async for chunk in orch.generate(inp(max_tokens=8)):
                    got.append(chunk)
            except errors.PdorchError as exc:
                got.append(exc)

        task = asyncio.create_task(client())
        try:
            await eventually(lambda: state_is(store, "r1", State.DECODING))
            await eventually(lambda: _true(len(got) >= 1))
            clock.advance(6.0)
            await eventually(lambda: state_is(store, "r1", State.FAILED))
            await asyncio.wait_for(task, 5)
        finally:
            await orch.stop()
        assert isinstance(got[-1], errors.RequestFailedError), got[-1]
        assert "decoding" in str(got[-1])

    run(main())


def test_stop_hands_running_requests_off_to_a_peer() -> None:
    async def main() -> None:
        d0 = FakeWorker("d0", "decode", delay_s=0.01)
        p0 = FakeWorker("p0", "prefill")
        a, store, _ = await setup(p0, d0)
        got: list[OutChunk | BaseException] = []

        async def client() -> None:
            try:
                async for chunk in a.generate(inp(max_tokens=100)):
                    got.append(chunk)
            except errors.UnavailableError as exc:
                got.append(exc)

        task = asyncio.create_task(client())
        await eventually(lambda: _true(len(got) >= 2))
        await a.stop()
        await task
        assert isinstance(got[-1], errors.UnavailableError)  # resume elsewhere
        assert await store.lease_holders(["r1"]) == [None]  # a peer may take it at once
        record = await store.get("r1")
        assert record is not None
        assert not record.state.terminal

    run(main())
