"""The operator's exceptions, under the orchestrator's root `PdorchError`.

    OperatorError                 root of this package's errors
    ├── SpecError                 the resource's spec is invalid; names the field (permanent)
    ├── ForeignObjectError        a child's name is taken by an object we don't control
    └── KubeApiError              the API refused or failed a call; ``transient`` says retry
        ├── ObjectConflictError   409: it exists already, or changed under us (retryable)
        └── KubeUnreachableError  no answer: connection refused, reset or timed out (retryable)

A 404 is not an error here: the client answers ``None`` (get) or ``False`` (delete).
kopf's own types (`TemporaryError`, `PermanentError`) appear only in `handlers`, which
translates these.
"""

from __future__ import annotations

from typing import ClassVar

from orchestrator.errors import PdorchError


class OperatorError(PdorchError):
    pass


class SpecError(OperatorError):
    """The resource's spec cannot be rendered; fixing the resource is the only cure."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ForeignObjectError(OperatorError):
    """An object with a child's name exists and is not controlled by this resource."""


class KubeApiError(OperatorError):
    """The API server answered with an error status. ``transient``: worth trying again."""

    # Statuses worth trying again: a stale write, throttling, a busy or restarting server.
    _TRANSIENT_STATUSES: ClassVar[frozenset[int]] = frozenset({409, 429, 500, 502, 503, 504})

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.transient = status in self._TRANSIENT_STATUSES


class ObjectConflictError(KubeApiError):
    """409: created concurrently by someone else, or a stale write."""


class KubeUnreachableError(KubeApiError):
    """The request got no HTTP answer at all (refused, reset, timed out)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "Unreachable", message)
        self.transient = True
