"""The transport's exception tree. Every error a caller of `transport` can see is one of these.

    TransportError                      root; ``retryable`` says whether trying again may help
    ├── WireFormatError                 bytes that are not a valid KV transfer (permanent)
    │   ├── ChecksumMismatchError       a layer's payload does not match its checksum
    │   ├── MalformedScalesError        fp8 scales that are not finite and positive
    │   ├── NonFiniteError              K/V values holding a NaN or an infinity
    │   └── HeaderRejectedError         a valid header that this receiver will not accept
    │       ├── StaleEpochError         epoch older than one already seen for the request
    │       └── PrefixMissingError      KV extending a prefix the receiver does not hold
    ├── BudgetExceededError             receiver has no room for the KV now (retryable)
    ├── PeerLostError                   the peer broke the connection or died (retryable)
    ├── TransferTimeoutError            a deadline passed: stalled peer or network (retryable)
    ├── TransportClosedError            *we* closed the sender/receiver (permanent)
    ├── BackendUnavailableError         the backend's native library is missing (permanent)
    ├── PeerRejectedError               TLS or the peer's identity refused the link (permanent)
    └── TlsConfigError                  this side's certificates cannot be loaded (permanent)

Foreign errors (OSError, asyncio.IncompleteReadError, ucxx.*) are translated into this tree in
the one module that calls them (`link.py`, `tcp.py`, `ucx.py`), always with ``raise ... from``.
"""

from __future__ import annotations

from typing import ClassVar


class TransportError(Exception):
    """Root of every transport error."""

    retryable: ClassVar[bool] = False


class WireFormatError(TransportError):
    """The bytes are not a valid KV transfer: bad magic/version/dtype, truncation, bounds."""


class ChecksumMismatchError(WireFormatError):
    """A layer's payload does not match the checksum its sender declared."""


class MalformedScalesError(WireFormatError):
    """A scaled (fp8) payload whose scales are not all finite and positive."""


class NonFiniteError(WireFormatError):
    """A layer's K or V values hold a NaN or an infinity (its checksum matched: the sender
    computed junk). Crosses the wire as a `WireFormatError`."""


class HeaderRejectedError(WireFormatError):
    """A well-formed header that does not match what the receiver expects (model, request)."""


class StaleEpochError(HeaderRejectedError):
    """The transfer's epoch is older than one the receiver has seen for that request."""


class PrefixMissingError(HeaderRejectedError):
    """A suffix-only transfer (its header names the prefix it extends) to a receiver that
    does not hold that prefix: the sender may send the whole KV instead."""


class BudgetExceededError(TransportError):
    """The receiver cannot hold this KV within its memory budget right now."""

    retryable = True


class PeerLostError(TransportError):
    """The peer closed or reset the connection, or died, in the middle of a transfer."""

    retryable = True


class TransferTimeoutError(TransportError):
    """A transfer deadline passed (stalled peer, overloaded link)."""

    retryable = True


class TransportClosedError(TransportError):
    """The local sender or receiver was closed; no further transfers are accepted."""


class BackendUnavailableError(TransportError):
    """The backend's native dependency (e.g. ucxx) is not installed or failed to load."""


class PeerRejectedError(TransportError):
    """The link was refused for who is at the other end: the TLS handshake failed (no
    certificate, another CA, plain TCP against TLS) or the peer's identity may not send
    (or receive) KV here. Crosses the wire without details."""


class TlsConfigError(TransportError):
    """This side's TLS files are missing or cannot be loaded (`transport.security`)."""
