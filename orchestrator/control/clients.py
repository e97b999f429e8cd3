"""gRPC channels to workers, reused per address, and translation of worker call errors."""

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
)


class WorkerStubs:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.prefill = worker_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = worker_pb2_grpc.DecodeServiceStub(self.channel)
        self.general = worker_pb2_grpc.WorkerServiceStub(self.channel)


class WorkerClients:
    def __init__(self) -> None:
        self._stubs: dict[str, WorkerStubs] = {}

    def get(self, address: str) -> WorkerStubs:
        stubs = self._stubs.get(address)
        if stubs is None:
            stubs = self._stubs[address] = WorkerStubs(address)
        return stubs

    async def close(self) -> None:
        for stubs in self._stubs.values():
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
            retryable=code in RETRYABLE_CODES,
            phase=what,
        ) from exc
