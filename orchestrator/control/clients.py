"""gRPC channels to workers (mutual TLS when given credentials), reused per address, and
translation of worker call errors."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from orchestrator import errors
from orchestrator.api import worker_pb2_grpc
from orchestrator.api.protocol import (
    BLAME_KEY,
    BLAME_KV_TARGET,
    REFUSABLE_FIELDS,
    RETRYABLE_CODES,
    link_broke,
)
from orchestrator.api.tls import Tls, secure_channel
from orchestrator.control.calls import CallMux
from orchestrator.control.mux import DecodeMux
from orchestrator.core.peers import WORKER_SERVER_NAME

CONNECT_ATTEMPT_MS = 5000
"""The least time a connection attempt to a worker is given (TCP, TLS handshake, HTTP/2
SETTINGS) — gRPC's ``grpc.min_reconnect_backoff_ms`` is that, not a backoff (its minimum
connect timeout, 20 s by default). At 100 ms, fresh connections failed under load: in CI
a burst of 200 requests found the first connection to each of ten prefill workers timed
out "before receiving SETTINGS frame", and every request fell back to aggregated."""

RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
)
"""A worker's channel whose connection broke tries again after 100 ms, backing off to 2 s
(gRPC's defaults: 1 s, then up to 2 minutes). Until it does, every call on it fails at
once ("failed to connect to all addresses"), and a request's failover attempts (50 ms
doubling) would all be spent within that second. Each attempt is given
`CONNECT_ATTEMPT_MS`."""


class WorkerStubs:
    def __init__(self, address: str, tls: Tls | None = None) -> None:
        self.channel = (
            grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
            if tls is None
            else secure_channel(address, tls, WORKER_SERVER_NAME, options=RECONNECT_OPTIONS)
        )
        self.prefill = worker_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = worker_pb2_grpc.DecodeServiceStub(self.channel)
        self.general = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.mux = DecodeMux(self.decode)
        """The decode streams this replica runs there, on one ``DecodeMany`` call."""
        self.calls = CallMux(self.general)
        """The ``Tokenize`` and ``Prefill`` calls it makes there, on one ``CallMany`` call."""


class WorkerClients:
    """``tls``: the orchestrator's credentials; every worker is then dialled over mutual
    TLS and checked to be a worker (`core.peers.WORKER_SERVER_NAME`)."""

    def __init__(self, tls: Tls | None = None) -> None:
        self._stubs: dict[str, WorkerStubs] = {}
        self.tls = tls

    def get(self, address: str) -> WorkerStubs:
        stubs = self._stubs.get(address)
        if stubs is None:
            stubs = self._stubs[address] = WorkerStubs(address, self.tls)
        return stubs

    async def close(self) -> None:
        for stubs in self._stubs.values():
            await stubs.mux.close()
            await stubs.calls.close()
            await stubs.channel.close(None)
        self._stubs.clear()


@contextlib.asynccontextmanager
async def translated(worker: str, what: str, kv_target: str = "") -> AsyncIterator[None]:
    """Map a worker call's gRPC error to WorkerError (or InvalidRequestError).

    A prefill worker marks a failure of the KV's *receiver* (trailing metadata
    ``pdorch-blame: kv-target``); the error then names ``kv_target`` — the decode worker —
    so that failover avoids the worker that actually failed. ``what`` is the error's phase."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            details = exc.details() or "rejected"
            named, _, rest = details.partition(": ")
            if named in REFUSABLE_FIELDS and rest:  # a worker refusing one parameter
                raise errors.InvalidRequestError(named, rest) from exc
            raise errors.InvalidRequestError("prompt", details) from exc
        blamed = worker
        # grpc.aio.Metadata at run time: (key, value) pairs (the stubs say otherwise)
        metadata: Any = exc.trailing_metadata() or ()
        if kv_target and (BLAME_KEY, BLAME_KV_TARGET) in [tuple(m) for m in metadata]:
            blamed = kv_target
        raise errors.WorkerError(
            blamed,
            f"{what}: {code.name}: {exc.details()}",
            retryable=code in RETRYABLE_CODES or link_broke(code, exc.details()),
            phase=what,
        ) from exc
