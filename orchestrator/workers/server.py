"""A worker process: prefill, decode and aggregated generation behind gRPC.

Every worker serves all three services (any worker can run a request aggregated, the
reference and the fallback); its *role* decides which pool it heartbeats into. A decode
worker also runs a KV receiver; a prefill worker a KV sender. The engine runs on one
thread; decode steps of all active sequences are interleaved by the `DecodeBatcher`.

Heartbeats go through a callback the composition root provides (workers never import the
store): ``publish(WorkerInfo)`` every ``heartbeat_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio  # the asyncio servicer (no stubs)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.aio import cancel_and_wait
from orchestrator.api import common_pb2, convert, worker_pb2, worker_pb2_grpc
from orchestrator.api.protocol import (
    BLAME_KEY,
    BLAME_KV_TARGET,
    blames_kv_target,
    transport_status,
)
from orchestrator.core.records import WorkerInfo
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.batcher import DecodeBatcher, EngineRunner, Sequence
from orchestrator.workers.engine import DecodeState, Engine
from orchestrator.workers.metrics import WorkerMetrics
from orchestrator.workers.text import TextDeltas
from transport import errors as terr
from transport import kvcodec, wire
from transport.receiver import KvReceiver
from transport.sender import KvSender

log = logging.getLogger(__name__)

Publish = Callable[[WorkerInfo], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: str = "decode"
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int = 0
    worker_id: str = ""
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    """A worker silent this long drops out of placement."""
    kv_capacity_bytes: int = 2 << 30
    max_batch: int = 16
    max_tokens_limit: int = 4096
    gpu_kind: str = "cpu"
    drain_grace_s: float = 10.0
    advertise: str = ""
    """host:port others use to reach the gRPC port, when not the listening one (a proxy, a
    Service); empty: the listening address."""
    kv_advertise: str = ""
    """The same for the KV receiver (decode workers)."""


class Worker:
    def __init__(
        self,
        engine: Engine,
        settings: WorkerSettings,
        publish: Publish,
        *,
        sender: KvSender | None = None,
        receiver: KvReceiver | None = None,
        metrics: WorkerMetrics | None = None,
        runner: EngineRunner | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.settings = settings
        self.worker_id = settings.worker_id or f"{settings.role}-{uuid.uuid4().hex[:8]}"
        self._publish = publish
        self._sender = sender
        self._receiver = receiver
        self._runner = runner if runner is not None else EngineRunner(engine)
        """Where engine calls run: the engine thread; a simulated engine's own runner."""
        self._batcher = DecodeBatcher(self._runner, settings.max_batch)
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._heartbeat: asyncio.Task[None] | None = None
        self._kv_used = 0
        self.address = ""
        self.kv_address = ""

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        if self._receiver is not None:
            self.kv_address = await self._receiver.start(self.settings.host, self.settings.kv_port)
        if self._sender is not None:
            await self._sender.start()
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(self), server)
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(self), server)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(_General(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        await server.start()
        self._server = server
        self.address = f"{self.settings.host}:{port}"
        self._batcher.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._publish(self.info())
        self._heartbeat = asyncio.create_task(self._beat(), name="pdorch-heartbeat")
        log.info("worker %s (%s) serving on %s", self.worker_id, self.settings.role, self.address)
        return self.address

    def _count(self, chunk: worker_pb2.TokenChunk) -> worker_pb2.TokenChunk:
        if self.metrics is not None:
            self.metrics.tokens.inc(len(chunk.token_ids))
            self.metrics.compute_seconds.inc(chunk.compute_ms / 1000)
        return chunk

    def active_sequences(self) -> int:
        return self._batcher.active

    def kv_used(self) -> int:
        """KV held: decoding sequences plus received KV not yet claimed."""
        return self._kv_used + (self._receiver.inbox.bytes_in_use if self._receiver else 0)

    def info(self) -> WorkerInfo:
        m = self.engine.info
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.settings.role,
            address=self.settings.advertise or self.address,
            kv_address=(self.settings.kv_advertise or self.kv_address) if self.kv_address else "",
            transport=self._receiver.backend if self._receiver else "",
            model=m.name,
            fingerprint=m.fingerprint,
            max_context=m.max_context,
            vocab_size=m.vocab_size,
            kv_bytes_per_token=m.kv_bytes_per_token(),
            kv_capacity_bytes=self.settings.kv_capacity_bytes,
            kv_used_bytes=self.kv_used(),
            active=self._batcher.active,
            gpu_kind=self.settings.gpu_kind,
            kv_dtype=m.kv_dtype.name.lower() if m.kv_convertible else "",
        )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._publish(self.info())
            except Exception as exc:  # noqa: BLE001 - a missed beat must not kill the worker
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        """Drain: stop heartbeating, finish in-flight calls within the grace, then close."""
        if self._heartbeat is not None:
            await cancel_and_wait(self._heartbeat)  # publishing to Redis: one cancel can be lost
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.settings.drain_grace_s)
        await self._batcher.close()
        if self._sender is not None:
            await self._sender.close()
        if self._receiver is not None:
            await self._receiver.close()
        self._runner.shutdown()

    # ------------------------------------------------------------------------- decoding

    async def stream(
        self,
        request_id: str,
        state: DecodeState,
        max_tokens: int,
        prompt_tokens: int,
        context: grpc.aio.ServicerContext[Any, Any],
        compute_s: float = 0.0,
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Emit the token already sampled (index generated-1), then decode to the end.

        Each chunk carries the engine time spent on the request since the previous one
        (``compute_s``: what this worker spent before decoding, e.g. the prefill)."""
        eos = set(self.engine.info.eos_token_ids)
        output = list(state.token_ids[prompt_tokens:])
        last = output[-1]
        text = TextDeltas(self.engine.detokenize, output[:-1])
        index = state.generated - 1
        first_ms = compute_s * 1000
        if last in eos:
            yield worker_pb2.TokenChunk(
                index=index, finish_reason=common_pb2.FINISH_REASON_EOS, compute_ms=first_ms
            )
            return
        yield worker_pb2.TokenChunk(
            index=index, token_ids=[last], text=text.push([last]), compute_ms=first_ms
        )
        if state.generated >= max_tokens:
            yield worker_pb2.TokenChunk(
                index=state.generated,
                text=text.flush(),
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
            )
            return
        seq = Sequence(request_id, state)
        self._batcher.add(seq)
        reported = 0.0

        def spent() -> float:
            nonlocal reported
            delta, reported = seq.compute_s - reported, seq.compute_s
            return delta * 1000

        try:
            while True:
                got = await seq.tokens.get()
                batch = [got]
                while not seq.tokens.empty():  # coalesce what is already there
                    batch.append(seq.tokens.get_nowait())
                ids: list[int] = []
                finish = common_pb2.FINISH_REASON_UNSPECIFIED
                for item in batch:
                    if isinstance(item, BaseException):
                        await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
                    assert isinstance(item, int)
                    if item in eos:
                        finish = common_pb2.FINISH_REASON_EOS
                        break
                    ids.append(item)
                    if index + 1 + len(ids) >= max_tokens:
                        finish = common_pb2.FINISH_REASON_LENGTH
                        break
                if ids:
                    delta = text.push(ids)
                    yield worker_pb2.TokenChunk(
                        index=index + 1, token_ids=ids, text=delta, compute_ms=spent()
                    )
                    index += len(ids)
                if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
                    yield worker_pb2.TokenChunk(
                        index=index + 1,
                        text=text.flush(),
                        finish_reason=finish,
                        compute_ms=spent(),
                    )
                    return
        finally:
            self._batcher.remove(seq)
            self._kv_used = max(0, self._kv_used - self.engine.kv_bytes(state))

    async def start_state(
        self,
        kv: wire.KvCache | list[tuple[Any, Any]],
        token_ids: list[int],
        last: int,
        generated: int,
        sampling: SamplingParams,
    ) -> DecodeState:
        layers = kv.layers if isinstance(kv, wire.KvCache) else kv
        state = await self._runner.call(
            self.engine.start_decode, list(layers), token_ids, last, generated, sampling
        )
        if isinstance(kv, wire.KvCache):
            kv.release()
        self._kv_used += self.engine.kv_bytes(state)
        return state


def _check_tokens(worker: Worker, ids: list[int], field: str) -> str | None:
    info = worker.engine.info
    if not ids:
        return f"{field}: empty"
    if len(ids) >= info.max_context:
        return f"{field}: {len(ids)} tokens exceed the context of {info.max_context}"
    if any(i >= info.vocab_size for i in ids):
        return f"{field}: token id beyond the vocabulary of {info.vocab_size}"
    return None


class _Prefill(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.PrefillResponse:
        w = self.w
        ids = list(request.token_ids)
        if (problem := _check_tokens(w, ids, "token_ids")) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if not request.kv_target or w._sender is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no KV target or sender")
        assert w._sender is not None
        sampling = convert.sampling_from_pb(request.sampling)
        started = time.perf_counter()
        result = await w._runner.call(
            w.engine.prefill, ids, sampling, int(request.first_index), None
        )
        prefill_ms = (time.perf_counter() - started) * 1000
        info = w.engine.info
        try:
            wire_dtype = convert.kv_dtype_from_pb(request.kv_dtype) or info.kv_dtype
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown kv_dtype")
        if wire_dtype is not info.kv_dtype and not info.kv_convertible:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this engine's KV cannot be converted"
            )
        sent = time.perf_counter()
        try:
            layers = await _to_wire(result.kv, info.kv_dtype, wire_dtype)
        except kvcodec.KvCodecError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV conversion: {exc}")
        header = kvcodec.wire_header(
            request.request_id, int(request.epoch), info.fingerprint, layers, wire_dtype
        )
        try:
            async with await w._sender.open(request.kv_target, header) as transfer:
                for i, layer in enumerate(layers):
                    await transfer.send_layer(i, layer.k, layer.v, layer.scales)
                await transfer.finish()
        except terr.TransportError as exc:
            log.warning(
                "KV transfer of %s to %s failed: %s", request.request_id, request.kv_target, exc
            )
            if blames_kv_target(exc):  # the receiving end is the one to avoid
                context.set_trailing_metadata(((BLAME_KEY, BLAME_KV_TARGET),))
            await context.abort(transport_status(exc), f"KV transfer failed: {exc}")
        transfer_s = time.perf_counter() - sent
        if w.metrics is not None:
            w.metrics.prefill_seconds.observe(prefill_ms / 1000)
            w.metrics.compute_seconds.inc(prefill_ms / 1000)
            w.metrics.transfer_seconds.inc(transfer_s)
            w.metrics.kv_sent_bytes.inc(header.payload_bytes)
        return worker_pb2.PrefillResponse(
            first_token=result.first_token,
            kv_bytes=header.payload_bytes,
            prefill_ms=prefill_ms,
            transfer_ms=transfer_s * 1000,
            kv_dtype=convert.kv_dtype_to_pb(wire_dtype),
        )


async def _to_wire(
    kv: list[tuple[Any, Any]], source: wire.DType, target: wire.DType
) -> list[kvcodec.EncodedLayer]:
    """The prefill's KV in the negotiated wire dtype (converted in a thread: it is numpy work
    proportional to the KV's size); as is, without a copy, when no conversion is asked."""
    if target is source:
        return [kvcodec.EncodedLayer(k, v) for k, v in kv]
    return await asyncio.to_thread(
        lambda: [kvcodec.encode_layer(k, v, source, target) for k, v in kv]
    )


class _Decode(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        w = self.w
        if w._receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
        assert w._receiver is not None
        rid, epoch = request.request_id, int(request.epoch)
        try:
            kv = await w._receiver.take(rid, epoch, request.kv_timeout_s or 30.0)
        except terr.TransportError as exc:
            await context.abort(transport_status(exc), f"no usable KV for {rid}: {exc}")
        ids = list(request.token_ids)
        if kv.header.token_count != len(ids):
            kv.release()
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV covers {kv.header.token_count} tokens, request has {len(ids)}",
            )
        started = time.perf_counter()
        adopt: wire.KvCache | list[tuple[Any, Any]] = kv
        compute = w.engine.info.kv_dtype
        if kv.header.dtype is not compute or kv.header.scales is not wire.ScaleLayout.NONE:
            try:  # back to the dtype this engine computes in (`transport.kvcodec`)
                adopt = await asyncio.to_thread(kvcodec.decode_layers, kv, compute)
            except terr.WireFormatError as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"KV of {rid}: {exc}")
            finally:
                kv.release()
        state = await w.start_state(
            adopt,
            ids,
            int(request.last_token),
            int(request.generated),
            convert.sampling_from_pb(request.sampling),
        )
        adopted_s = time.perf_counter() - started
        async for chunk in w.stream(
            rid, state, int(request.max_tokens), int(request.prompt_tokens), context, adopted_s
        ):
            yield w._count(chunk)

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ReleaseResponse:
        released = self.w._receiver.discard(request.request_id) if self.w._receiver else False
        return worker_pb2.ReleaseResponse(released=released)


class _General(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Generate(
        self, request: worker_pb2.AggregatedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        w = self.w
        ids = list(request.token_ids)
        if (problem := _check_tokens(w, ids, "token_ids")) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        sampling = convert.sampling_from_pb(request.sampling)
        first_index = int(request.first_index)
        started = time.perf_counter()
        result = await w._runner.call(w.engine.prefill, ids, sampling, first_index, None)
        state = await w.start_state(result.kv, ids, result.first_token, first_index + 1, sampling)
        async for chunk in w.stream(
            request.request_id,
            state,
            int(request.max_tokens),
            int(request.prompt_tokens),
            context,
            time.perf_counter() - started,  # the prefill, on this worker
        ):
            yield w._count(chunk)

    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.TokenizeResponse:
        engine = self.w.engine
        if request.WhichOneof("input") == "chat":
            messages = [(m.role, m.content) for m in request.chat.messages]
            ids = await self.w._runner.call(engine.chat_tokens, messages)
        else:
            ids = await self.w._runner.call(engine.tokenize, request.text)
        return worker_pb2.TokenizeResponse(ids=ids)
