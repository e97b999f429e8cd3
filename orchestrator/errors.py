"""The orchestrator's exception tree (the transport has its own, `transport.errors`).

    PdorchError                       root; ``retryable`` says whether trying again may help
    ├── InvalidRequestError           bad input; names the field (→ INVALID_ARGUMENT)
    ├── ConflictError                 same request id, different body (→ ALREADY_EXISTS)
    ├── NotFoundError                 unknown request id, or another tenant's (→ NOT_FOUND)
    ├── UnauthenticatedError          no credential, or one no tokens file lists (→ UNAUTHENTICATED)
    ├── PermissionDeniedError         a credential claiming a tenant it may not act for
    │                                 (→ PERMISSION_DENIED)
    ├── OverloadedError               backpressure: rejected early (→ RESOURCE_EXHAUSTED)
    ├── UnavailableError              no worker / store unreachable (→ UNAVAILABLE)
    │   └── StoreUnavailableError     the request store is unreachable (an outage, not a
    │                                 refusal); after its outage window when it says so
    ├── StaleEpochError               a write from a superseded epoch (fencing)
    ├── InvalidTransitionError        a state change the state machine forbids
    │   ├── RequestEndedError         the request already ended (e.g. cancelled elsewhere)
    │   └── JournalGapError           a journal append not at the journal's end
    ├── LeaseLostError                another replica took the request over (we follow it)
    ├── WorkerError                   a worker call failed (retryable per ``retryable``)
    ├── RequestFailedError            the request already ended in failure (→ ABORTED)
    ├── DeadlineExceededError         a request ran past its deadline (→ DEADLINE_EXCEEDED)
    └── ConfigError                   bad configuration (a file, flags, a hardware table);
                                      names the field, e.g. ``traffic.rate``

gRPC status codes come from one table, `orchestrator.rpc.status`.
"""

from __future__ import annotations

from typing import ClassVar


class PdorchError(Exception):
    retryable: ClassVar[bool] = False


class InvalidRequestError(PdorchError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConflictError(PdorchError):
    """A request id reused with a different body."""


class NotFoundError(PdorchError):
    """No request with that id."""


class UnauthenticatedError(PdorchError):
    """The call carries no credential, or one the tokens file does not list (revoked)."""


class PermissionDeniedError(PdorchError):
    """An authenticated caller asked for what its credential does not allow."""


class OverloadedError(PdorchError):
    retryable = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(PdorchError):
    retryable = True


class StoreUnavailableError(UnavailableError):
    """The request store did not answer (connection refused or lost, timed out, still
    loading its data). Raised at once by calls that don't wait out an outage, and by those
    that do (`orchestrator.store.outage`) once its window has passed. A client is told to
    try again after `retry_after_s` (a primary failing over comes back in seconds)."""

    retry_after_s = 1.0


class StaleEpochError(PdorchError):
    """A write carried an epoch older than the request's current one."""


class InvalidTransitionError(PdorchError):
    """The request is not in a state that allows this transition."""


class RequestEndedError(InvalidTransitionError):
    """The request reached a terminal state (cancelled, failed) while this was running."""


class JournalGapError(InvalidTransitionError):
    """A journal append did not start where the journal ends (``journal_end``)."""

    def __init__(self, message: str, journal_end: int) -> None:
        super().__init__(message)
        self.journal_end = journal_end


class LeaseLostError(PdorchError):
    """This replica lost its lease on a request (it stalled); another one drives it now."""


class WorkerError(PdorchError):
    """A worker call failed. ``retryable`` is set per instance from the cause; ``phase``
    names what failed (a call — ``prefill``, ``decode``, ``generate``, ``tokenize`` — or
    ``heartbeat``, ``silence``, ``stream``), so failover and metrics never read the message."""

    def __init__(self, worker: str, message: str, *, retryable: bool, phase: str = "other") -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker
        self.retryable_instance = retryable
        self.phase = phase


class RequestFailedError(PdorchError):
    """The request ended in failure earlier (its record says FAILED); attaching to it again
    returns this, not the transient code of the original cause, so clients stop retrying."""


class DeadlineExceededError(PdorchError):
    """A request outlived its deadline."""


class ConfigError(PdorchError):
    """A configuration value is missing, of the wrong type or out of range.

    ``field`` is its dotted path (``gpus.H100.price_per_hour``), so a message can point at the
    line of a file or the flag to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
