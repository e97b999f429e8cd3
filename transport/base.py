"""Transfer semantics every backend shares: settings, the data-plane seam, the receiver inbox.

A *sender* opens a transfer to a receiver's address with a `KvHeader`, then sends layer *i*
as soon as it exists (`OutgoingTransfer.send_layer`), then `finish()`es, which returns only
when the receiver has verified every layer. A *receiver* checks each header against its
`Expectation` before reserving memory, verifies every layer's checksum, and files the
complete `KvCache` (or the transfer's error) in its `Inbox` under the request id, where the
decode side `take`s it. A partial transfer is discarded and its memory released.

Backends differ only in their `DataPlane`: where the layer payload bytes travel.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from transport import control, errors
from transport.control import RemoteRegion
from transport.wire import KvCache


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """Deadlines and bounds. Every network wait in the transport uses one of these."""

    connect_timeout_s: float = 2.0
    """TCP connect plus HELLO exchange."""
    idle_timeout_s: float = 5.0
    """Longest wait for the peer's next message or payload progress inside a transfer."""
    keepalive_s: float = 1.0
    """Sender, layer by layer: while a transfer waits for its producer's next layer (the
    engine's forward, `OutgoingTransfer.hold`), an ALIVE this often — well under every
    receiver's ``idle_timeout_s`` — so a slow forward is not taken for a dead peer.
    Receiver, one-sided: a LANDED at most this often while it reads (the sender's sign of
    life while it waits for DONE) — every half ``idle_timeout_s`` if that is shorter."""
    transfer_timeout_s: float = 120.0
    """Whole transfer, open to done."""
    max_kv_bytes: int = 1 << 30
    """Largest single KV a receiver accepts (1 GiB)."""
    memory_budget_bytes: int = 4 << 30
    """Receiver: total bytes of KV held at once (in flight plus waiting in the inbox)."""
    pooled_buffer_bytes: int = 1 << 30
    """Receiver: released KV buffers kept for reuse (fresh pages are slow to fill)."""
    body_reading_bytes: int = 256 << 20
    """Receiver: bytes of eager KVs' messages being read at once, over all its links (each
    message's buffer is taken as its head arrives, before anything in it can be checked);
    past it a read waits for room, its link unread, within the read's deadline."""
    max_connections_per_peer: int = 64
    """Sender: concurrent transfers to one receiver; more wait for a free slot."""
    connection_idle_s: float = 60.0
    """Receiver: a connection with no transfer open for this long is closed (a pooled link
    the sender left idle, or a peer that said HELLO and then nothing). The sender drops its
    idle links after half of it, so it rarely picks one the receiver is closing."""
    max_connections_per_host: int = 256
    """Receiver: connections from one remote IP address (four senders' worth of
    ``max_connections_per_peer``). At this cap a new connection makes room by closing that
    host's longest-idle connection (one between transfers); if all are moving KV it is refused
    with `BudgetExceededError`."""
    max_connections: int = 512
    """Receiver: connections in all (below the usual 1024 open files), handled the same way."""
    segment_bytes: int = 32 << 20
    """Out-of-band backends move consecutive layers in messages of about this size. Measured
    here at 64 MiB in 32 layers: one message per layer reached 0.4 of ucx_perftest, 8 MiB
    segments about 0.7, 32 MiB about 0.85 (fewer rendezvous round trips and thread hops)."""
    kv_hold_s: float = 30.0
    """Receiver: a received KV nobody takes within this lease is freed."""
    epoch_memory: int = 65536
    """Receiver: request ids whose highest epoch is remembered (LRU). It is the epoch fence
    and the replay guard: a (request id, epoch) is received at most once, so KV that was
    taken, released or reaped is never accepted again while its id is remembered. Bound:
    one entry per id, about 160 bytes plus the id (≤ 256 bytes), measured: 12 MiB at the
    default with 36-character ids, at most 26 MiB."""
    check_finite: bool = False
    """Receiver: refuse KV whose values (K and V; fp8 scales are always checked) hold a NaN
    or an infinity (`NonFiniteError`). Checked chunk by chunk in the checksum's pass, while
    each chunk is in cache. Off by default: it cost 13–18 % of UCX throughput here, and
    NaN KV comes from the sender's own computation (README "KV transport": the trade-off)."""

    @property
    def accept_timeout_s(self) -> float:
        """Receiver: a new connection's TLS handshake, then its HELLO, each within this —
        twice the sender's ``connect_timeout_s``. A TLS 1.3 sender is done with the
        handshake a flight before its receiver, and its deadline is the one that bounds
        the wait; a receiver held to the same deadline, counted from its own accept, cut
        handshakes its sender had seen succeed whenever its loop ran late (a vLLM decode
        worker on a loaded CPU), and the sender's next write found the link closed."""
        return 2 * self.connect_timeout_s


_channels = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Peer:
    """The remote end of one control connection, as it introduced itself in HELLO."""

    instance_id: bytes
    data_address: bytes
    channel: int = field(default_factory=lambda: next(_channels))
    """This connection's id in this process. A data plane keeps its per-peer state (UCX
    endpoints) per channel: a connection carries one transfer at a time, so cancelling a
    channel's operations cancels one transfer's and never another's (issue 18)."""


class DataPlane(abc.ABC):
    """Where layer payloads travel. One instance per sender or receiver process."""

    name: str
    inline: bool
    """True when payloads travel on the control connection itself (TCP)."""

    @abc.abstractmethod
    async def start(self) -> bytes:
        """Start; return this side's data address (sent to peers in HELLO)."""

    @abc.abstractmethod
    async def send(self, peer: Peer, tag: int, buffers: Sequence[memoryview]) -> None:
        """Send one layer's payload, the concatenation of ``buffers`` (out-of-band only)."""

    @abc.abstractmethod
    async def recv(self, peer: Peer, tag: int, into: memoryview) -> None:
        """Receive one layer's payload into ``into``, matching `send` (out-of-band only)."""

    one_sided: bool = False
    """Sender: open transfers whose receiver *reads* each segment from this side's
    registered memory (`register` here, `read` there) instead of `send`/`recv`."""
    can_read: bool = False
    """Receiver: whether it takes such one-sided transfers (`read`)."""

    def register(self, address: int, length: int) -> tuple[bytes, object]:
        """One-sided, sender: register ``length`` bytes at ``address`` for remote reads;
        return the packed remote key (for KEYS) and a handle for `deregister`."""
        raise NotImplementedError(f"{self.name} has no one-sided path")

    def deregister(self, handle: object) -> None:
        """One-sided, sender: undo `register` (the memory is being freed)."""
        raise NotImplementedError(f"{self.name} has no one-sided path")

    async def read(
        self,
        peer: Peer,
        regions: Sequence[RemoteRegion],
        into: memoryview,
        then: Callable[[], None] | None = None,
    ) -> None:
        """One-sided, receiver: read ``regions`` of ``peer``'s memory, in order, into
        ``into`` (exactly as long as they are together). Remote keys are unpacked once
        per (channel, key id) and kept until `forget_keys` or the channel's release.
        ``then`` runs once the read completed, where it completed (the reading thread, or
        here), before the read is reported done; what it raises, the read raises — a
        segment's verification, without a second thread hop and loop turn."""
        raise NotImplementedError(f"{self.name} has no one-sided path")

    def read_now(
        self,
        peer: Peer,
        regions: Sequence[RemoteRegion],
        into: memoryview,
        then: Callable[[], None] | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """One-sided, receiver: `read`, done right here when it can be (a small read on a
        link whose endpoint exists; ``then`` too): None once done, else what completes it."""
        return self.read(peer, regions, into, then)

    def forget_keys(self, peer: Peer, key_ids: Sequence[int]) -> None:
        """One-sided, receiver: the sender withdrew these keys; drop what `read` kept."""
        raise NotImplementedError(f"{self.name} has no one-sided path")

    def discard_unmatched(self, keep: Callable[[int], bool]) -> list[tuple[int, int]]:
        """Receiver, out of band: drop payload messages no posted receive matched (a spent
        or unannounced token) but those whose tag ``keep`` wants; return their (tag, length).
        Blocking: the receiver calls it in a thread. Nothing to do for inline planes."""
        return []

    @abc.abstractmethod
    def fail_channel(self, peer: Peer) -> None:
        """Cancel everything pending on ``peer``'s channel — that connection's transfer,
        and no other — and forget its endpoints. Returns once no posted operation can
        touch that transfer's buffers any more."""

    @abc.abstractmethod
    def release(self, peer: Peer) -> None:
        """``peer``'s connection closed: free what the plane holds for its channel."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class TransferTokens:
    """The one-time transfer tokens a receiver issues (`transport.control`, "The transfer
    token"): never two transfers with one token at once, and a spent token never issued
    again while it is remembered (the ``memory`` most recently spent, LRU; beyond that a
    repeat is a 1-in-2^48 draw). Not thread-safe; lives on the receiver's event loop."""

    def __init__(self, memory: int) -> None:
        self._live: set[int] = set()
        self._spent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._memory = memory

    def issue(self) -> int:
        while True:
            token = control.new_token()
            if token not in self._live and token not in self._spent:
                self._live.add(token)
                return token

    def spend(self, token: int) -> None:
        """The transfer ended (done or failed): its token is never valid again."""
        self._live.discard(token)
        self._spent[token] = None
        while len(self._spent) > self._memory:
            self._spent.popitem(last=False)

    def wants(self, tag: int) -> bool:
        """Whether a payload tag carries a live token (``token | segment``)."""
        return (tag & ~0xFFFF) in self._live

    def state(self, token: int) -> str:
        """``"live"``, ``"spent"`` or ``"unknown"`` (for logs and tests)."""
        if token in self._live:
            return "live"
        return "spent" if token in self._spent else "unknown"


@dataclass(slots=True)
class _Slot:
    epoch: int
    future: asyncio.Future[KvCache] = field(default_factory=asyncio.Future)
    nbytes: int = 0
    done_at: float | None = None
    """When the transfer completed or failed (monotonic); the hold lease starts then."""


class Inbox:
    """Received KV caches by request id, the epoch fence, and the receiver's memory budget.

    Each (request id, epoch) is received at most once: a transfer is refused if its epoch
    is older than one seen for the request (`StaleEpochError`), if that epoch is being or
    was received and is still held (`HeaderRejectedError`), and if it was received and then
    taken, released or reaped — a replay (`StaleEpochError`). The highest epoch per request
    id is remembered for the ``epoch_memory`` most recently seen ids (LRU), and a held slot
    fences its request even after that; an id forgotten by the LRU is fenced no more (a
    replay of it would be held unclaimed for the hold lease, then reaped).

    Not thread-safe; lives on the receiver's event loop.
    """

    def __init__(self, budget_bytes: int, epoch_memory: int) -> None:
        self._budget = budget_bytes
        self._in_use = 0
        self._slots: dict[str, _Slot] = {}
        self._epochs: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._epoch_memory = epoch_memory
        self._arrival = asyncio.Event()  # set and replaced whenever a transfer is admitted

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    def min_epoch(self, request_id: str) -> int:
        """The highest epoch seen for the request (older ones are refused; this one only
        while it is held)."""
        # A held slot fences its request even after the LRU has forgotten the epoch.
        slot = self._slots.get(request_id)
        seen = self._epochs.get(request_id, 0)
        return seen if slot is None else max(seen, slot.epoch)

    def _closed(self, request_id: str, epoch: int) -> bool:
        """Whether (request id, epoch) was received or released and is no longer held."""
        slot = self._slots.get(request_id)
        held = slot is not None and slot.epoch == epoch
        return not held and self._epochs.get(request_id, -1) >= epoch

    def _see_epoch(self, request_id: str, epoch: int) -> None:
        self._epochs[request_id] = max(epoch, self._epochs.get(request_id, epoch))
        self._epochs.move_to_end(request_id)
        while len(self._epochs) > self._epoch_memory:
            self._epochs.popitem(last=False)

    def reserve(self, request_id: str, epoch: int, nbytes: int) -> None:
        """Admit a transfer: fence its epoch, reserve its bytes. Raises before any alloc."""
        if epoch < self.min_epoch(request_id):
            raise errors.StaleEpochError(
                f"request {request_id!r}: epoch {epoch} < {self.min_epoch(request_id)}"
            )
        if self._closed(request_id, epoch):
            raise errors.StaleEpochError(
                f"request {request_id!r} epoch {epoch} was already received and taken or "
                "released: a replay, refused"
            )
        old = self._slots.get(request_id)
        if old is not None and old.epoch == epoch:
            state = "already received" if old.future.done() else "already being received"
            raise errors.HeaderRejectedError(f"request {request_id!r} epoch {epoch} is {state}")
        if self._in_use + nbytes > self._budget:
            raise errors.BudgetExceededError(
                f"{nbytes} bytes requested, {self._budget - self._in_use} of {self._budget} free"
            )
        self._see_epoch(request_id, epoch)
        if old is not None:  # superseded by a newer epoch: drop it
            self._drop(request_id, old, errors.StaleEpochError("superseded by a newer epoch"))
        self._slots[request_id] = _Slot(epoch=epoch, nbytes=nbytes)
        self._in_use += nbytes
        self._wake()

    def _wake(self) -> None:
        """Wake every waiting `take` to look again."""
        self._arrival.set()
        self._arrival = asyncio.Event()

    def complete(self, request_id: str, epoch: int, cache: KvCache) -> None:
        slot = self._slots.get(request_id)
        if slot is None or slot.epoch != epoch or slot.future.done():
            raise errors.StaleEpochError(f"request {request_id!r} epoch {epoch} was superseded")
        slot.future.set_result(cache)
        slot.done_at = time.monotonic()

    def fail(self, request_id: str, epoch: int, exc: errors.TransportError) -> None:
        """A transfer broke: release its memory; a waiting `take` sees ``exc``."""
        slot = self._slots.get(request_id)
        if slot is None or slot.epoch != epoch:
            return
        self._in_use -= slot.nbytes
        slot.nbytes = 0
        slot.done_at = time.monotonic()
        if not slot.future.done():
            slot.future.set_exception(exc)
            slot.future.exception()  # retrieved here: a take() may never come

    async def take(self, request_id: str, epoch: int, timeout_s: float) -> KvCache:
        """Wait for the KV of (request id, epoch) and hand it over (the inbox forgets it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if epoch < self.min_epoch(request_id):
                raise errors.StaleEpochError(f"request {request_id!r}: epoch {epoch} is stale")
            if self._closed(request_id, epoch):
                raise errors.StaleEpochError(
                    f"request {request_id!r} epoch {epoch}: its KV was already taken or released"
                )
            slot = self._slots.get(request_id)
            if slot is not None and slot.epoch == epoch:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.TransferTimeoutError(
                    f"no KV for request {request_id!r} epoch {epoch} within {timeout_s}s"
                )
            arrival = self._arrival
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrival.wait(), remaining)
        try:
            return await asyncio.wait_for(asyncio.shield(slot.future), deadline - time.monotonic())
        except TimeoutError:
            raise errors.TransferTimeoutError(
                f"KV for request {request_id!r} epoch {epoch} incomplete after {timeout_s}s"
            ) from None
        finally:
            if slot.future.done() and self._slots.get(request_id) is slot:
                self._drop(request_id, slot, None)

    def discard(self, request_id: str, epoch: int | None = None) -> bool:
        """Free what is held or arriving for ``request_id`` (cancel). True if anything was.

        With ``epoch`` (the orchestrator's Release of an attempt), only a transfer of that
        epoch or an older one is freed, and that epoch is closed even if its transfer has
        not arrived yet: a late one is refused instead of held unclaimed."""
        slot = self._slots.get(request_id)
        if epoch is not None:
            if slot is None or slot.epoch <= epoch:
                self._see_epoch(request_id, epoch)
                self._wake()  # a take waiting for that epoch learns it is closed
            if slot is not None and slot.epoch > epoch:
                return False
        if slot is None:
            return False
        self._drop(request_id, slot, errors.TransportClosedError("discarded"))
        return True

    def _drop(self, request_id: str, slot: _Slot, exc: errors.TransportError | None) -> None:
        self._slots.pop(request_id, None)
        self._see_epoch(request_id, slot.epoch)  # closed for good (if the LRU had forgotten)
        self._in_use -= slot.nbytes
        slot.nbytes = 0
        if not slot.future.done() and exc is not None:
            slot.future.set_exception(exc)
            slot.future.exception()

    def reap(self, now: float, hold_s: float) -> list[str]:
        """Drop what no decode call came for within ``hold_s`` of arriving (the orchestrator
        died, the client went away): the KV's memory and a failed transfer's error alike."""
        expired = [
            rid
            for rid, slot in self._slots.items()
            if slot.done_at is not None and now - slot.done_at > hold_s
        ]
        for rid in expired:
            slot = self._slots[rid]
            if slot.future.done() and slot.future.exception() is None:
                slot.future.result().release()
            self._drop(rid, slot, None)
        return expired

    def is_current(self, request_id: str, epoch: int) -> bool:
        slot = self._slots.get(request_id)
        return slot is not None and slot.epoch == epoch and not slot.future.done()

    def held(self) -> list[str]:
        return list(self._slots)
