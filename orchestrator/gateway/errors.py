"""Errors as the gateway answers them, and the one table from orchestrator errors to HTTP.

Every error leaves the gateway as an `ApiError`: an HTTP status and the OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` — the official client raises its
``BadRequestError`` for 400, ``AuthenticationError`` 401, ``NotFoundError`` 404,
``ConflictError`` 409, ``RateLimitError`` 429 and ``InternalServerError`` for 5xx, and
retries 429 after ``Retry-After`` (sent too with a 503 for a request store that is away).
Orchestrator errors (`orchestrator.errors`) are translated
here, by `api_error_for`, and nowhere else; the gateway's own (auth, unknown model,
unsupported parameters) are raised as `ApiError` directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator import errors

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """An HTTP error in the OpenAI shape. ``kind`` is the object's ``type``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.retry_after_s is not None:
            # Whole seconds (RFC 9110 delay-seconds), never 0: "retry at once" invites a stampede.
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out


# First match wins: subclasses come before their bases.
_TABLE: tuple[tuple[type[errors.PdorchError], int, str, str], ...] = (
    (errors.InvalidRequestError, 400, INVALID, "invalid_value"),
    (errors.ConflictError, 409, INVALID, "request_id_conflict"),
    (errors.NotFoundError, 404, INVALID, "request_not_found"),
    (errors.UnauthenticatedError, 401, INVALID, "invalid_api_key"),
    (errors.PermissionDeniedError, 403, INVALID, "tenant_not_allowed"),
    (errors.OverloadedError, 429, "rate_limit_error", "overloaded"),
    (errors.UnavailableError, 503, SERVER, "unavailable"),
    (errors.DeadlineExceededError, 504, SERVER, "deadline_exceeded"),
    (errors.RequestEndedError, 409, INVALID, "request_ended"),
    (errors.InvalidTransitionError, 409, INVALID, "conflict"),
    (errors.StaleEpochError, 503, SERVER, "unavailable"),
    (errors.WorkerError, 503, SERVER, "worker_error"),
    (errors.RequestFailedError, 500, SERVER, "request_failed"),
)


def api_error_for(exc: errors.PdorchError, params: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP answer to an orchestrator error. ``params`` renames the orchestrator's field
    names to the request's (``prompt`` is ``messages`` in a chat call)."""
    status, kind, code = next(
        ((s, k, c) for cls, s, k, c in _TABLE if isinstance(exc, cls)),
        (500, SERVER, "internal_error"),
    )
    param = None
    if isinstance(exc, errors.InvalidRequestError):
        param = (params or {}).get(exc.field, exc.field)
    retryable = errors.OverloadedError | errors.StoreUnavailableError
    retry_after = exc.retry_after_s if isinstance(exc, retryable) else None
    return ApiError(status, str(exc), kind=kind, param=param, code=code, retry_after_s=retry_after)


def cancelled(request_id: str) -> ApiError:
    """The request ended cancelled (through the API, or by another client of the same id)."""
    return ApiError(
        409, f"request {request_id!r} was cancelled", kind=INVALID, code="request_cancelled"
    )
