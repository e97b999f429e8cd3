"""A worker process: prefill, decode and aggregated generation behind gRPC.

Every worker serves all three services (any worker can run a request aggregated, the
reference and the fallback); its *role* decides which pool it heartbeats into. What runs the
model is an `EngineHost` (`host`): the reference engine on one thread with pdorch's KV
sender/receiver (`reference_host`), or vLLM's async engine (`vllm.engine`). The servicers
here validate a call, delegate it to the host, coalesce its token stream to the window the
request asks (`coalesce`) and count what it produced; the worker owns
the gRPC server, heartbeats and drain. ``DecodeMany`` runs many decode streams on one call
(`mux`), each as its own ``Decode`` would; ``CallMany`` many ``Tokenize`` and ``Prefill``
calls (`calls`), each as its unary call would. An undecodable request (a string field that is not
UTF-8) is answered INVALID_ARGUMENT with one log line (`api.undecodable`), as the
orchestrator's own server does. With TLS credentials the gRPC port is mutual TLS and only
orchestrator identities are served (`api.peers.RequirePeer`): a client's or another
worker's certificate gets PERMISSION_DENIED, a certificate from another CA (or none) fails
the handshake.

Heartbeats go through a callback the composition root provides (workers never import the
store): ``publish(WorkerInfo)`` every ``heartbeat_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio  # the asyncio servicer (no stubs)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.aio import cancel_and_wait
from orchestrator.api import worker_pb2, worker_pb2_grpc
from orchestrator.api.many import served
from orchestrator.api.peers import RequirePeer
from orchestrator.api.tls import Tls
from orchestrator.api.undecodable import RefuseUndecodable, Undecodable
from orchestrator.core.idents import shown
from orchestrator.core.peers import Surface
from orchestrator.core.records import WorkerInfo
from orchestrator.workers.batcher import EngineRunner
from orchestrator.workers.calls import CallMany, Unary
from orchestrator.workers.coalesce import coalesced, window_of
from orchestrator.workers.engine import Engine
from orchestrator.workers.host import Context, EngineHost
from orchestrator.workers.metrics import WorkerMetrics
from orchestrator.workers.mux import DecodeMany, Many
from orchestrator.workers.reference_host import ReferenceHost
from transport.receiver import KvReceiver
from transport.sender import KvSender, split_address

__all__ = ["Publish", "Worker", "WorkerSettings"]

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
    """The reference engine's KV budget (a hosted engine reports its own block pool)."""
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
        engine: Engine | EngineHost,
        settings: WorkerSettings,
        publish: Publish,
        *,
        sender: KvSender | None = None,
        receiver: KvReceiver | None = None,
        metrics: WorkerMetrics | None = None,
        runner: EngineRunner | None = None,
        tls: Tls | None = None,
    ) -> None:
        """``engine``: an `EngineHost`, or an `Engine` to run in a `ReferenceHost` with
        ``sender``/``receiver``/``runner`` (which a host brings itself). ``tls``: the
        worker's credentials; it then serves mutual TLS and takes calls from orchestrator
        identities only (`api.peers`); without, plaintext from anyone."""
        self.host = (
            engine
            if isinstance(engine, EngineHost)
            else ReferenceHost(
                engine,
                kv_capacity_bytes=settings.kv_capacity_bytes,
                max_batch=settings.max_batch,
                sender=sender,
                receiver=receiver,
                metrics=metrics,
                runner=runner,
            )
        )
        self.metrics = metrics
        self.tls = tls
        self.settings = settings
        self.worker_id = settings.worker_id or f"{settings.role}-{uuid.uuid4().hex[:8]}"
        self._publish = publish
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._heartbeat: asyncio.Task[None] | None = None
        self._calls: set[Many[Any, Any, Any]] = set()
        """The open ``DecodeMany`` and ``CallMany`` calls (drained on stop)."""
        self._draining = False
        self.address = ""
        self.kv_address = ""

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        self.kv_address = await self.host.start(self.settings.host, self.settings.kv_port)
        interceptors: list[Any] = [RequirePeer(Surface.WORKER_API)] if self.tls else []
        server = grpc.aio.server(interceptors=[*interceptors, RefuseUndecodable()])
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(self), server)
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(self), server)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(_General(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        listen = f"{self.settings.host}:{self.settings.port}"
        if self.tls is None:
            port = server.add_insecure_port(listen)
        else:  # mutual TLS: a caller without a certificate the CA signed fails the handshake
            credentials = self.tls.server_credentials(require_client_cert=True)
            port = server.add_secure_port(listen, credentials)
        await server.start()
        self._server = server
        self.address = f"{self.settings.host}:{port}"
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._publish(self.info())
        self._heartbeat = asyncio.create_task(self._beat(), name="pdorch-heartbeat")
        log.info("worker %s (%s) serving on %s", self.worker_id, self.settings.role, self.address)
        return self.address

    async def tokenize(
        self, request: worker_pb2.TokenizeRequest, context: Context
    ) -> worker_pb2.TokenizeResponse:
        """``Tokenize``'s body (its own call, or one on a ``CallMany``)."""
        if request.WhichOneof("input") == "chat":
            messages = [(m.role, m.content) for m in request.chat.messages]
            ids = await self.host.chat_tokens(messages)
        else:
            ids = await self.host.tokenize(request.text)
        return worker_pb2.TokenizeResponse(ids=ids)

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        """``Prefill``'s body (its own call, or one on a ``CallMany``)."""
        problem = (
            _check_tokens(self, list(request.token_ids), "token_ids")
            or _check_index(self, request.first_index)
            or _check_target(request.kv_target)
        )
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        return await self.host.prefill(request, context)

    async def _serve_many(
        self,
        method: str,
        many: Many[Any, Any, Any],
        commands: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[Any]:
        """A ``DecodeMany`` or ``CallMany`` call's batches; drained with the worker."""
        self._calls.add(many)
        if self._draining:  # stopping since the call arrived
            many.drain()
        try:
            async for batch in served(method, many, commands, context):
                yield batch
        finally:
            self._calls.discard(many)

    def _count(self, chunk: worker_pb2.TokenChunk) -> worker_pb2.TokenChunk:
        if self.metrics is not None:
            self.metrics.tokens.inc(len(chunk.token_ids))
            self.metrics.compute_seconds.inc(chunk.compute_ms / 1000)
        return chunk

    def active_sequences(self) -> int:
        return self.host.active()

    def kv_used(self) -> int:
        """KV held: decoding sequences plus received KV not yet claimed."""
        return self.host.kv_used()

    def info(self) -> WorkerInfo:
        m = self.host.info
        blocks, free_blocks = self.host.kv_blocks()
        block_size, prefix = self.host.kv_prefix()
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.settings.role,
            address=self.settings.advertise or self.address,
            kv_address=(self.settings.kv_advertise or self.kv_address) if self.kv_address else "",
            transport=self.host.transport,
            model=m.name,
            fingerprint=m.fingerprint,
            max_context=m.max_context,
            vocab_size=m.vocab_size,
            kv_bytes_per_token=m.kv_bytes_per_token(),
            kv_capacity_bytes=self.host.kv_capacity(),
            kv_used_bytes=self.host.kv_used(),
            active=self.host.active(),
            gpu_kind=self.settings.gpu_kind,
            kv_dtype=m.kv_dtype.name.lower() if m.kv_convertible else "",
            kv_blocks=blocks,
            kv_free_blocks=free_blocks,
            kv_block_size=block_size,
            kv_prefix=prefix,
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
        self._draining = True
        for call in self._calls:  # long-lived: each ends once its streams have
            call.drain()
        if self._server is not None:
            await self._server.stop(self.settings.drain_grace_s)
        await self.host.close()


def _check_index(worker: Worker, first_index: int) -> str | None:
    """An output index is a count of tokens generated: within the model's context."""
    if first_index >= worker.host.info.max_context:
        limit = worker.host.info.max_context
        return f"first_index: {first_index} is beyond the context of {limit}"
    return None


def _check_target(kv_target: str) -> str | None:
    """Where a prefill sends its KV: a receiver's host:port (empty: refused by the host)."""
    if not kv_target:
        return None
    try:
        _, port = split_address(kv_target)
    except ValueError:
        port = 0
    if not 0 < port < 1 << 16:
        return f"kv_target: {shown(kv_target)} is not host:port"
    return None


def _check_tokens(worker: Worker, ids: list[int], field: str) -> str | None:
    info = worker.host.info
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
        return await self.w.prefill(request, context)


class _Decode(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        chunks = coalesced(self.w.host.decode(request, context), window_of(request.flush_ms))
        async for chunk in chunks:
            yield self.w._count(chunk)

    async def DecodeMany(
        self,
        request_iterator: AsyncIterator[worker_pb2.DecodeCommand | Undecodable],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.DecodeBatch]:
        many = DecodeMany(self.w.host.decode, self.w._count)
        method = "/pdorch.v1.DecodeService/DecodeMany"
        async for batch in self.w._serve_many(method, many, request_iterator, context):
            yield batch

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(released=await self.w.host.release(request))


class _General(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Generate(
        self, request: worker_pb2.AggregatedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        problem = _check_tokens(self.w, list(request.token_ids), "token_ids") or _check_index(
            self.w, request.first_index
        )
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        chunks = coalesced(self.w.host.generate(request, context), window_of(request.flush_ms))
        async for chunk in chunks:
            yield self.w._count(chunk)

    async def Tokenize(
        self, request: worker_pb2.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.TokenizeResponse:
        return await self.w.tokenize(request, context)

    async def CallMany(
        self,
        request_iterator: AsyncIterator[worker_pb2.CallCommands | Undecodable],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.CallBatch]:
        many = CallMany(Unary(self.w.tokenize, self.w.prefill))
        method = "/pdorch.v1.WorkerService/CallMany"
        async for batch in self.w._serve_many(method, many, request_iterator, context):
            yield batch
