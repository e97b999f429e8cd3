"""The KV transport backends by name, and which sender a receiver takes (pure).

One place for the list every chooser offers: ``pdorch worker|up|demo --transport``, the
operator's ``spec.transport.kind`` (and the CRD enum a test keeps equal), chaos scenarios'
``cluster.transport``. Kept apart from `transport.backends`, which builds them, so that a
parser, the operator's pure rendering and the chaos scenarios can name backends without
loading asyncio, the senders or UCX.

* ``ucx``: UCX tag messages (transport v1), the default.
* ``ucx-read``: UCX one-sided reads (transport v2, ``UcxConfig(one_sided=True)``): the
  decode worker pulls the segments from the prefill's registered memory, one message and
  one reply per transfer. Measured side by side on a 2-core VM (README
  "Transport performance"): 1.2–3× the tag path from 4 KiB to 16 MiB, level with it
  (0.9–1.1×) at 64–256 MiB.
* ``tcp``: payloads inline on the control connection; needs nothing installed.

On every backend a whole KV of at most the sender's bound (`transport.control.eager_bytes`:
128 KiB on ``ucx-read``, 4 MiB on ``ucx`` and ``tcp``, where each backend's own path starts
to win) goes inline in one message and one reply (eager: nothing registered, posted
or read).

**Pairing.** Control always travels on a TCP link and each sender says how it moves
payloads when it opens a transfer, so a UCX receiver takes either UCX sender: a prefill
worker on ``ucx-read`` and a decode worker on ``ucx`` work together. A TCP receiver takes
only a TCP sender; any other pairing fails the transfer at once (measured: within a
millisecond on loopback, never a hang): a one-sided OPEN is refused by a TCP receiver as a
header that does not match it (`HeaderRejectedError`), a tag sender finds no UCX worker
address in a TCP receiver's HELLO, and a UCX receiver drops a TCP sender's inline payload
frames with the connection (`PeerLostError`). An eager KV (at most
`transport.control.eager_bytes`, inline in its OPEN, on every backend) needs no data plane,
so its pairing is checked by the HELLOs' data-plane addresses instead, with the same
outcome as for a large KV: a tag sender finds none in a TCP receiver's HELLO (`NO_UCX_PEER`),
a TCP receiver refuses a UCX sender's OPEN as having no one-sided path, and a UCX receiver
refuses a TCP sender's (`TCP_SENDER_REFUSED`).
"""

from __future__ import annotations

from typing import Final, Literal

Backend = Literal["ucx", "ucx-read", "tcp"]

UCX: Final = "ucx"
UCX_READ: Final = "ucx-read"
TCP: Final = "tcp"
BACKENDS: Final[tuple[Backend, ...]] = (UCX, UCX_READ, TCP)
"""Every choice, the default first."""
DEFAULT: Final[Backend] = UCX

UCX_BACKENDS: Final = frozenset({UCX, UCX_READ})
"""Backends that need UCXX (the ``ucx`` extra) and move payloads outside the control link
(a TCP proxy in front of a decode worker's KV port sees only control messages — but for
eager KVs, at most `transport.control.eager_bytes`, inline in their OPEN;
KV faults for these backends are injected in the sender, `transport.testing.FaultInjector`,
which reaches those too)."""


def needs_ucx(backend: str) -> bool:
    return backend in UCX_BACKENDS


def receiver_takes(receiver: str, sender: str) -> bool:
    """Whether a receiver on backend ``receiver`` accepts transfers from a sender on
    ``sender`` (module notes: a UCX receiver takes either UCX sender)."""
    if receiver == TCP:
        return sender == TCP
    return needs_ucx(receiver) and needs_ucx(sender)


NO_UCX_PEER: Final = (
    "cannot reach peer over UCX: it has no UCX data plane (on --transport tcp?): both "
    "workers of a pair need a UCX --transport, or both tcp"
)


TCP_SENDER_REFUSED: Final = (
    "the sender has no UCX data plane (on --transport tcp?): a UCX receiver takes KV from "
    "UCX senders only; both workers of a pair need a UCX --transport, or both tcp"
)
