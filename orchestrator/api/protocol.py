"""What workers and the orchestrator agree on beyond the generated messages.

The `.proto` files say what a call carries; this module says how a failed worker call is
read: the status code a transport failure becomes (set by a worker), which codes are worth
retrying on another worker (read by the orchestrator), and the trailing metadata that names
the KV's receiver as the one that failed. Both sides import these names, so they cannot drift.
"""

from __future__ import annotations

import grpc

from transport import errors as terr

ACCEPTED_KEY = "pdorch-accepted"
"""Initial metadata a ``GenerateMany`` call is answered with as soon as the orchestrator
accepted it (credential, tenant): its client writes its first command only then. A command
written while the call is refused makes grpc.aio's client report INTERNAL instead of the
refusal (grpc/grpc#36066); a refused call has no initial metadata but its status's."""
BLAME_KEY = "pdorch-blame"
"""Trailing metadata on a failed Prefill saying which side of the KV transfer failed."""
BLAME_KV_TARGET = "kv-target"
"""`BLAME_KEY`'s value when the KV's receiver (the decode worker) failed — gone, stalled or
full — rather than the prefill worker that reports it."""

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)
"""Status codes of a worker call that another worker (or a later try) may not repeat."""

STREAM_REMOVED = "Stream removed"
"""How gRPC core words a call whose connection its transport tore down under it. Over TLS a
corrupted record (a link fault: `TSI_DATA_CORRUPTED`, "Unwrap failed") ends the call with
status UNKNOWN and these details, where a plaintext link's reset says UNAVAILABLE. A worker
never answers so (its handlers' failures say "Unexpected <exception>"), so this one
wording, and no other message, counts as a broken link."""


def link_broke(code: grpc.StatusCode, details: str | None) -> bool:
    """Whether a worker call's status is gRPC core's for a connection torn down under it
    (`STREAM_REMOVED`): a link fault, retryable as UNAVAILABLE is."""
    return code == grpc.StatusCode.UNKNOWN and (details or "").startswith(STREAM_REMOVED)


_TARGET_FAULTS = (
    terr.PeerLostError,
    terr.TransferTimeoutError,
    terr.BudgetExceededError,
    terr.PeerRejectedError,  # the KV link's TLS identity check: avoid that decode worker
)

_TRANSPORT_STATUS: tuple[tuple[type[terr.TransportError], grpc.StatusCode], ...] = (
    (terr.StaleEpochError, grpc.StatusCode.ABORTED),
    (terr.WireFormatError, grpc.StatusCode.DATA_LOSS),
    (terr.TransferTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)
"""First match wins (StaleEpochError is a WireFormatError); anything else is UNAVAILABLE.
Every code here is in `RETRYABLE_CODES`: a failed KV transfer is re-prefilled elsewhere."""


def transport_status(exc: terr.TransportError) -> grpc.StatusCode:
    """The status a worker aborts a call with when moving the KV failed with ``exc``."""
    for cls, code in _TRANSPORT_STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.UNAVAILABLE


def blames_kv_target(exc: terr.TransportError) -> bool:
    """Whether ``exc`` is the receiving end's fault (the decode worker is the one to avoid)."""
    return isinstance(exc, _TARGET_FAULTS)


REFUSABLE_FIELDS = frozenset(
    {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "logprobs"}
    | {"prompt_logprobs"}
)
"""Request parameters a worker's engine may refuse (INVALID_ARGUMENT) although pdorch
accepts them: the orchestrator then names the parameter to its client (`refusal`)."""


def refusal(field: str, message: str) -> str:
    """The details of a worker's INVALID_ARGUMENT refusing ``field`` (one of
    `REFUSABLE_FIELDS`): ``"<field>: <message>"``, which the orchestrator reads back."""
    assert field in REFUSABLE_FIELDS, field
    return f"{field}: {message}"
