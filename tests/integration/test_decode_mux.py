"""Many decode streams on one call (``DecodeMany``): the orchestrator's `control.mux` against
a real worker's gRPC server (`workers.server`, `workers.mux`) over loopback, the host a
scripted one so each stream's tokens, failure and cancellation are known.

What it must keep: a stream reads exactly as its own ``Decode`` call would (tokens, end,
errors with their code, details and trailing metadata), the streams share messages, a
failure or a cancel touches one stream only, the call failing fails every stream the way a
``Decode`` call fails, a draining worker finishes its streams and refuses new ones, and a
worker without ``DecodeMany`` is read with ``Decode`` calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import common_pb2, worker_pb2, worker_pb2_grpc
from orchestrator.api.protocol import BLAME_KEY, BLAME_KV_TARGET
from orchestrator.control.clients import WorkerClients, translated
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.mux import DecodeMux, MuxStream, Unsupported, call_failed
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo
from orchestrator.workers.engine import ModelInfo
from orchestrator.workers.host import Context, EngineHost
from orchestrator.workers.server import Worker, WorkerSettings
from transport.wire import DType

LIMIT_S = 30.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class ScriptHost(EngineHost):
    """Decodes ``max_tokens - generated`` one-token chunks ``step_s`` apart (token i at
    index i), then a finish chunk. A request id starting with ``stale`` is refused as a
    stale epoch; one starting with ``blamed`` fails naming the KV's sender."""

    info = ModelInfo(
        name="script", fingerprint="script", n_layers=1, kv_heads=1, head_dim=1,
        vocab_size=1000, max_context=4096, eos_token_ids=(), kv_dtype=DType.FLOAT32,
    )  # fmt: skip
    transport = "tcp"

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def start(self, host: str, kv_port: int) -> str:
        return ""

    async def close(self) -> None:
        return None

    def active(self) -> int:
        return 0

    def kv_used(self) -> int:
        return 0

    def kv_capacity(self) -> int:
        return 1 << 20

    async def tokenize(self, text: str) -> list[int]:
        return [1]

    async def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return [1]

    def generate(
        self, request: worker_pb2.AggregatedRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        raise NotImplementedError

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        raise NotImplementedError

    async def release(self, request: worker_pb2.ReleaseRequest) -> bool:
        return False

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        rid = request.request_id
        self.started.append(rid)
        if rid.startswith("stale"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rid}: stale epoch")
        if rid.startswith("blamed"):
            context.set_trailing_metadata(((BLAME_KEY, BLAME_KV_TARGET),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{rid}: KV sender lost")
        try:
            for index in range(request.generated, request.max_tokens):
                await asyncio.sleep(self.step_s)
                yield worker_pb2.TokenChunk(index=index, token_ids=[index])
            yield worker_pb2.TokenChunk(
                index=request.max_tokens, finish_reason=common_pb2.FINISH_REASON_LENGTH
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


def ask(rid: str, max_tokens: int, flush_ms: float = 50.0) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, epoch=1, generated=1, max_tokens=max_tokens, flush_ms=flush_ms
    )


def info_of(worker_id: str, address: str) -> WorkerInfo:
    m = ScriptHost.info
    return WorkerInfo(
        worker_id=worker_id, role="decode", address=address, kv_address="", transport="tcp",
        model=m.name, fingerprint=m.fingerprint, max_context=m.max_context,
        vocab_size=m.vocab_size, kv_bytes_per_token=4, kv_capacity_bytes=1 << 20,
    )  # fmt: skip


async def publish(_info: WorkerInfo) -> None:
    return None


async def serving(host: ScriptHost, **settings: Any) -> Worker:
    worker = Worker(host, WorkerSettings(role="decode", **settings), publish)
    await worker.start()
    return worker


async def tokens(stream: Any) -> list[int]:
    """The stream's token ids, checking that its chunks are contiguous and end finished."""
    ids: list[int] = []
    last: worker_pb2.TokenChunk | None = None
    async for chunk in stream:
        if ids or chunk.token_ids:
            assert chunk.index == (ids[0] if ids else chunk.index) + len(ids)
        ids += chunk.token_ids
        last = chunk
    assert last is not None
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return ids


async def failure(stream: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stream:
            pass
    return caught.value


def test_streams_on_one_call_read_their_own_tokens_in_shared_messages() -> None:
    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.01))
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(channel))
                streams = [mux.open(ask(f"r{i}", max_tokens=40)) for i in range(5)]
                results = await asyncio.gather(*(tokens(s) for s in streams))
                assert results == [list(range(1, 40))] * 5  # each all of its own, in order
                chunks = await asyncio.gather(
                    *(tokens(mux.open(ask(f"s{i}", max_tokens=40))) for i in range(5))
                )
                assert chunks == [list(range(1, 40))] * 5
                # ~0.4 s of tokens in 50 ms windows: ~9 messages a stream each alone; the
                # windows aligned, one message carries every stream's chunk.
                assert mux.batches < 2 * 5 * 9 * 0.5, mux.batches
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_one_streams_failure_is_its_own_and_reads_as_its_decode_call_would() -> None:
    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.01))
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                stub = worker_pb2_grpc.DecodeServiceStub(channel)
                mux = DecodeMux(stub)
                good = mux.open(ask("good", max_tokens=30))
                stale = mux.open(ask("stale-1", max_tokens=30))
                blamed = mux.open(ask("blamed-1", max_tokens=30))
                for shared, rid in ((stale, "stale-1"), (blamed, "blamed-1")):
                    got = await failure(shared)
                    alone = await failure(stub.Decode(ask(rid, max_tokens=30)))
                    assert (got.code(), got.details()) == (alone.code(), alone.details())
                    assert got.trailing_metadata() == alone.trailing_metadata()
                    with pytest.raises(errors.WorkerError) as as_failover_sees:
                        async with translated("w", "decode", kv_target="sender"):
                            raise got
                    with pytest.raises(errors.WorkerError) as as_before:
                        async with translated("w", "decode", kv_target="sender"):
                            raise alone
                    assert str(as_failover_sees.value) == str(as_before.value)
                    seen, before = as_failover_sees.value, as_before.value
                    assert (seen.worker, seen.phase) == (before.worker, before.phase)
                    assert seen.retryable_instance == before.retryable_instance
                assert as_failover_sees.value.worker == "sender"  # the blame crossed too
                assert await tokens(good) == list(range(1, 30))  # untouched by the others
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_closing_a_stream_cancels_its_decode_and_no_other() -> None:
    async def main() -> None:
        host = ScriptHost(step_s=0.01)
        worker = await serving(host)
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(channel))
                leaving = mux.open(ask("leaving", max_tokens=1000))
                staying = mux.open(ask("staying", max_tokens=60))
                seen = 0
                async for chunk in leaving:
                    seen += len(chunk.token_ids)
                    if seen >= 3:
                        break
                leaving.close()
                assert await tokens(staying) == list(range(1, 60))
                deadline = time.monotonic() + 5
                while "leaving" not in host.cancelled:
                    assert time.monotonic() < deadline, "the worker kept decoding"
                    await asyncio.sleep(0.01)  # the cancel crosses the call
                assert host.cancelled == ["leaving"]
                await mux.close()
        finally:
            await worker.stop()

    run(main())


def test_the_call_failing_fails_every_stream_as_it_fails_a_decode_call() -> None:
    """The worker's server gone mid-stream (stopped without grace, its calls cut): every
    stream on the shared call fails with the code a ``Decode`` call open beside them gets,
    so failover retries them alike."""

    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.02))
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.DecodeServiceStub(channel)
            mux = DecodeMux(stub)
            shared = [mux.open(ask(f"r{i}", max_tokens=1000)) for i in range(3)]
            alone = stub.Decode(ask("alone", max_tokens=1000))
            for stream in [*shared, alone]:
                await anext(aiter(stream))  # every stream is running
            assert worker._server is not None
            await worker._server.stop(None)
            baseline = await failure(alone)
            for stream in shared:
                got = await failure(stream)
                assert got.code() == baseline.code(), (got, baseline)
            with pytest.raises(errors.WorkerError) as caught:
                async with translated("w", "decode"):
                    raise got
            assert caught.value.retryable_instance  # failed over, not failed
            await mux.close()
        await worker.host.close()

    run(main())


def test_a_draining_worker_finishes_its_streams_and_refuses_new_ones() -> None:
    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.01), drain_grace_s=20.0)
        async with grpc.aio.insecure_channel(worker.address) as channel:
            mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(channel))
            running = mux.open(ask("running", max_tokens=80))
            await anext(aiter(running))
            started = time.monotonic()
            stopping = asyncio.create_task(worker.stop())
            deadline = time.monotonic() + 10
            while not worker._draining:  # the stop reaches the drain (a condition, not an event)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            refused = await failure(mux.open(ask("late", max_tokens=10)))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.details() or "")
            rest = await tokens(running)
            assert rest[-1] == 79  # ran to its end
            await stopping
            assert time.monotonic() - started < 10  # not the whole grace: the call ended
            await mux.close()

    run(main())


class _OldDecode(worker_pb2_grpc.DecodeServiceServicer):
    """A worker of an earlier version: ``Decode`` only (``DecodeMany`` is UNIMPLEMENTED)."""

    def __init__(self, host: ScriptHost) -> None:
        self.host = host

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        async for chunk in self.host.decode(request, context):
            yield chunk


def test_a_worker_without_decode_many_is_read_with_a_decode_call_per_stream() -> None:
    async def main() -> None:
        host = ScriptHost(step_s=0.005)
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(_OldDecode(host), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        clients = WorkerClients()

        async def alive(_worker: WorkerInfo) -> bool:
            return True

        legs = WorkerLegs(clients, ControlSettings(), alive)
        try:
            old = info_of("old", f"127.0.0.1:{port}")
            for n in range(2):  # the second goes straight to Decode
                stream = legs.decode(old, ask(f"r{n}", max_tokens=20), lambda: None)
                assert await tokens(stream) == list(range(1, 20))
            assert host.started == ["r0", "r1"]  # each decoded once: no stream was lost
            assert not clients.get(old.address).mux.supported
        finally:
            await clients.close()
            await server.stop(None)

    run(main())


def test_a_stream_is_the_same_whether_shared_or_alone() -> None:
    """The leg reads a request's stream through the mux by default; with ``decode_mux`` off
    through its own call: same tokens."""

    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.005))
        clients = WorkerClients()

        async def alive(_worker: WorkerInfo) -> bool:
            return True

        try:
            info = info_of("w", worker.address)
            for shared in (True, False):
                legs = WorkerLegs(clients, ControlSettings(decode_mux=shared), alive)
                stream = legs.decode(info, ask(f"r-{shared}", max_tokens=25), lambda: None)
                assert await tokens(stream) == list(range(1, 25))
            assert clients.get(worker.address).mux.batches > 0  # the shared one was shared
        finally:
            await clients.close()
            await worker.stop()

    run(main())


def test_a_stream_started_before_the_call_failed_is_not_read_as_ended() -> None:
    """A stream whose events never came (the call cut before its start was read) fails; it
    does not end quietly as if it had finished."""

    async def main() -> None:
        worker = await serving(ScriptHost(step_s=0.01))
        async with grpc.aio.insecure_channel(worker.address) as channel:
            mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(channel))
            stream: MuxStream = mux.open(ask("never", max_tokens=1000))
            await mux.close()
            err = await failure(stream)
            assert err.code() == grpc.StatusCode.CANCELLED
        await worker.stop()

    run(main())


def test_a_call_failure_is_always_one_failover_retries() -> None:
    """A call-level failure says nothing of the requests on it (the worker or the link
    failed): a code failover would not retry — an INTERNAL from gRPC's core, as a worker of
    this version answered before its guard knew bidirectional calls — moves them instead."""

    def fails(code: grpc.StatusCode, details: str = "x") -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    internal = call_failed(fails(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert isinstance(internal, grpc.aio.AioRpcError)
    assert internal.code() == grpc.StatusCode.UNAVAILABLE
    assert "INTERNAL: Internal error from Core" in (internal.details() or "")
    unavailable = fails(grpc.StatusCode.UNAVAILABLE)
    assert call_failed(unavailable) is unavailable
    assert isinstance(call_failed(fails(grpc.StatusCode.UNIMPLEMENTED)), Unsupported)


def test_a_silent_call_is_closed_when_a_stream_on_it_is_given_up_for_silence() -> None:
    """A stream given up for silence (`legs`) asks the mux whether its call brought nothing
    either: then every stream on it is failed (retryable) and the next stream gets a new
    call, rather than wait out the same silence on a wedged one."""

    async def main() -> None:
        worker = await serving(ScriptHost(step_s=30.0))  # silent streams
        async with grpc.aio.insecure_channel(worker.address) as channel:
            mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(channel))
            quiet = [mux.open(ask(f"q{i}", max_tokens=5)) for i in range(2)]
            await mux.stalled(60.0)  # not silent that long: kept
            assert mux._call is not None
            await mux.stalled(0.0)
            for stream in quiet:
                err = await failure(stream)
                with pytest.raises(errors.WorkerError) as caught:
                    async with translated("w", "decode"):
                        raise err
                assert caught.value.retryable_instance
            closed = mux.open(ask("next", max_tokens=5))
            assert mux._call is not None  # a new call
            closed.close()
            with pytest.raises(asyncio.CancelledError):  # a read after close: as a call's
                await anext(aiter(closed))
            await mux.close()
        await worker.stop()

    run(main())
