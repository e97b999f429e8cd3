"""The one table from orchestrator errors to gRPC status codes."""

from __future__ import annotations

import grpc

from orchestrator import errors

_TABLE: tuple[tuple[type[errors.PdorchError], grpc.StatusCode], ...] = (
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.StaleEpochError, grpc.StatusCode.ABORTED),
    (errors.InvalidTransitionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.WorkerError, grpc.StatusCode.UNAVAILABLE),
    (errors.RequestFailedError, grpc.StatusCode.ABORTED),
)


def status_for(exc: errors.PdorchError) -> grpc.StatusCode:
    for cls, code in _TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL
