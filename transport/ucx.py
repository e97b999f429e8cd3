"""UCX backend: layer payloads travel as UCXX tag messages (v1, the default), or — with
``UcxConfig(one_sided=True)`` — the receiver reads each segment from the sender's registered
memory (one-sided ``get``, transport v2). Control stays on the TCP link either way.

One-sided (`transport.control` has the message flow): the sender registers each allocation
its KV lives in once (``ucp_mem_map`` and the packed remote key, `transport.registry`) and
tells each link's receiver its key once; per transfer it sends (key id, offset, length)
descriptors per segment — with the header in one message when the whole KV exists. The
receiver, which checked the header and reserved the (request id, epoch) and the bytes before
anything else, unpacks each remote key once per link (``ucp_ep_rkey_unpack``, kept in
`_Reads.keys` until WITHDRAW or the link goes), reads the regions into its own slice for
that segment (``ucp_get_nbx``: CMA between local processes, one copy done by the receiver's
own thread, or on its loop up to 1 MiB), verifies each layer as bytes and frame are both in
(the last segment's right after its read, in the same thread, when its checksums came
first: `DataPlane.read`'s ``then``), and answers DONE. The calls UCXX's Python API lacks
are in `transport.ucp` (ctypes on UCXX's own context, worker and endpoints).

**Pull, and why no stale write can land in re-used memory.** Only the receiver's own reads
ever write into its memory, and only into the slice of a buffer reserved for the (request
id, epoch) being received, whose length the regions must match exactly. A transfer that
fails stops its reads before its buffer can be re-used: `fail_channel` takes the channel's
lock (a read in progress finishes its current call first), marks it abandoned so nothing
more is issued, and aborts the link's endpoint, which cancels what is still outstanding;
the thread running the reads holds the buffer until they completed or were cancelled, and a
failed transfer's buffer never returns to the pool (it is freed once nothing refers to it).
A sender that died or stalled writes nothing anywhere: its memory is only read. On the
sender's side, a failed transfer's buffers stay referenced for the idle deadline (the
receiver's reads end within it), so never freed under a read; a registration lives exactly
as long as its allocation (it is dropped as the allocation is freed, and WITHDRAWn from the
links that hold its key before their next transfer), so no key ever names memory that was
freed and given to someone else; a receiver reading memory the prefill re-used for another
request's KV anyway gets bytes whose checksums do not match, and refuses them.
With push (the sender writing into memory the receiver announced), a stalled prefill
resumed after its transfer was failed and the blocks re-used would write into someone
else's KV — CMA does not revoke access on deregistration — unless those blocks were
quarantined for as long as the prefill process lives.

The configuration, and why (figures measured on the 2-core CI kind of machine; see README):

* Endpoints are created from **worker addresses** exchanged in HELLO. Tag (v1) endpoints have
  UCX endpoint error handling **off**: with it on, UCX only selects ``tcp`` lanes between
  processes (0.5–1 GB/s at 64 MiB); off, it may use shared memory / CMA (~7 GB/s, on par
  with ``ucx_perftest -t tag_bw``). UCXX's listener path (``create_listener``/
  ``create_endpoint``) cannot run without error handling, hence worker addresses.
* One-sided reads' endpoints have it **on**: a read from a peer that died fails with
  ``EIO`` at once (without it, libucx aborts the *reading process* when its CMA read finds
  the peer gone). With peer error handling and rendezvous both on, libucx 1.21 takes as
  bandwidth (get) lanes only transports whose memory domain can invalidate remote access;
  CMA's does not say so unless ``UCX_CMA_MEMORY_INVALIDATE=y``, and the shared-memory
  transports have no peer-failure support, so the reads would become "software emulation"
  over ``tcp/lo`` (``UCX_PROTO_INFO=y``; a 4 MiB read did not finish in 20 s). Every data
  plane therefore starts UCX with ``CMA_MEMORY_INVALIDATE=y``: only the reader's context
  needs it, and it changes nothing for endpoints without error handling (the tag lanes
  are the same). That invalidation serves UCX's rendezvous, which these endpoints never
  run, and our pull design never relies on it (the notes above). NIXL gets the same lanes
  by turning rendezvous off (``RNDV_THRESH=inf``), which would make v1's tag messages
  eager copies; a context started that way gets error-handling reads too. Where neither
  holds (UCXX started by someone else), reads keep error handling off.
* The worker's lock is a **mutex** (``USE_MT_MUTEX=y``; UCX's default is a spinlock). A CMA
  read copies inside ``ucp_worker_progress``, 512 KiB a call (``CMA_SEG_SIZE``), holding
  the worker's lock, and while a read is outstanding UCXX's progress thread progresses the
  same worker: with a spinlock it spun for as long as the reads copied — a 256 MiB
  transfer cost its receiver ~105 ms of CPU against v1's ~65, one more core busy on a
  2-core VM (per-thread ``schedstat``, load ~15). With a mutex the two threads share the
  copy and the receiver's CPU is ~65 ms; tag (v1) transfers are unchanged within noise.
* Otherwise peer-death detection comes from the control link: a killed peer's TCP
  connection is reset by its kernel within milliseconds, and a stalled peer trips the
  transfer's idle deadline (one-sided, the receiver's LANDED messages keep the sender's).
  Either way the transport cancels the posted UCX requests by aborting the link's endpoint
  (`fail_channel`) before the receive buffer is released.
* Endpoints are kept per control link (`Peer.channel`), created on its first payload and
  closed with it: a restarted peer's new links get fresh endpoints, the count is bounded by
  the connection caps, and cancelling one transfer's operations (aborting its link's
  endpoint) never touches another transfer to the same peer (issue 18).
* Sends and receives are posted on the endpoint's UCXX request API and awaited through
  `transport.completion.CompletionPoller`, not by ``Endpoint.send``/``recv``: those await
  ``UCXRequest.wait()``, which in ``thread`` progress mode (without UCXX's Python-future
  notifier) is a ``sleep(0)`` loop that keeps a whole core busy for as long as a request is
  pending — on 2 cores the core the CMA copy and the checksums need (64 MiB took ~20 ms per
  transfer that way, ~12 ms without). UCXX's notifier is no way out: it ties UCXX to the
  first event loop and its non-daemon thread keeps the interpreter from exiting.

* **Not encrypted, so keyed by one-time tokens.** UCXX has no TLS. Tag messages are matched
  only under the token the receiver issued on the (TLS) control link for that transfer
  (`transport.control`), and messages nobody's receive matched are taken off UCX's
  unexpected queue and dropped (`discard_unmatched`). One-sided reads need none: only the
  receiver writes into its memory, reading regions the authenticated link announced.

``ucxx`` is imported lazily here and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport import errors, ucp, ucx_env
from transport.backend_names import NO_UCX_PEER
from transport.base import DataPlane, Peer, TransportSettings
from transport.completion import CompletionPoller
from transport.control import RemoteRegion
from transport.receiver import KvReceiver
from transport.security import LinkTls
from transport.sender import KvSender
from transport.wire import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UcxConfig:
    """UCX options passed to ``ucxx.init`` (keys without the ``UCX_`` prefix)."""

    options: dict[str, str] = field(default_factory=dict)
    """E.g. ``{"TLS": "tcp"}`` to force TCP lanes; empty lets UCX choose (shm/cma locally)."""
    progress_mode: str = "thread"
    """UCXX progress. "thread" (a progress thread per process) is the one mode in which
    aborting an endpoint to a *stalled* peer returns: without a progress thread UCXX closes
    a no-error-handling endpoint by progressing until the peer acknowledges, which a
    SIGSTOPped peer never does, and the event loop hangs. "blocking" is faster on 2 cores
    (no extra threads) but is only safe where peers are trusted never to stall."""
    one_sided: bool = False
    """Payloads are read by the receiver from the sender's registered memory (``get``,
    transport v2) instead of sent as tagged messages (v1). Opt-in: measured side by side
    here (README "Transport performance", a 2-core VM) v2 is 1.2–3× v1 from 4 KiB to 16
    MiB and level with it at 64–256 MiB (0.96–1.00×, medians of 24 runs; either is ahead
    in a given run); it stays off until it is ≥ v1 at every size. A receiver takes either, as each
    sender opens it."""
    error_handling: bool = False
    """UCX endpoint peer-error handling on *tag* (v1) endpoints. Off: with it on, libucx
    1.21 gives them only ``tcp/lo`` lanes (0.5–1 GB/s). Peer failure is detected by the
    control link. Read endpoints always have it (module notes)."""


def _import_ucxx() -> Any:
    ucx_env.snapshot()  # before ucxx sets its defaults (another UCX program must not inherit them)
    # `import ucxx` sets UCX_MEMTYPE_CACHE, which libucx 1.21 no longer knows, and UCX then
    # prints an "unused environment variable" warning to *stdout* in every process.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx  # noqa: PLC0415 - lazy on purpose: native, optional dependency
    except Exception as exc:
        raise errors.BackendUnavailableError(
            f"the UCX backend needs ucxx (pip install 'pdorch[ucx]'): {exc}"
        ) from exc
    return ucxx


def ucx_available() -> bool:
    try:
        _import_ucxx()
    except errors.BackendUnavailableError:
        return False
    return True


class UcxDataPlane(DataPlane):
    name = "ucx"
    inline = False
    can_read = True

    def __init__(self, config: UcxConfig | None = None) -> None:
        self._config = config or UcxConfig()
        self.one_sided = self._config.one_sided
        self._ucxx: Any = None
        self._eps: dict[int, Any] = {}
        """UCX endpoint per channel (control link); lives as long as the link."""
        self._reading: dict[int, _Reads] = {}
        """One-sided reads per channel: guards its endpoint against an abort mid-call."""
        self._connecting: dict[int, asyncio.Lock] = {}
        self._array: Any = None
        self._tag: Any = None
        self._full_mask: Any = None

    async def start(self) -> bytes:
        if self._ucxx is None:
            ucxx = _import_ucxx()
            try:
                if not _initialised(ucxx):
                    options = {**_CONTEXT_OPTIONS, **self._config.options}
                    ucxx.init(options=options, progress_mode=self._config.progress_mode)
                    _CONTEXT.checked_reads = _reads_keep_cma(options)
                address = ucxx.get_worker_address().tobytes()
            except Exception as exc:
                raise errors.BackendUnavailableError(f"UCX failed to start: {exc}") from exc
            self._array, self._tag, self._full_mask = _request_api()
            self._ucxx = ucxx
            return bytes(address)
        return bytes(self._ucxx.get_worker_address().tobytes())

    async def _endpoint(self, peer: Peer, error_handling: bool) -> Any:
        """The channel's endpoint, created on first use. One per control link, not per peer:
        aborting it (`fail_channel`) cancels that link's transfer's sends and receives only
        (UCX tags match worker-wide, so a receive posted through any endpoint still gets
        its message). A link carries one sender's transfers, all tags or all reads, so its
        endpoint's error handling is decided once."""
        ep = self._eps.get(peer.channel)
        if ep is not None:
            return ep
        lock = self._connecting.setdefault(peer.channel, asyncio.Lock())
        async with lock:
            ep = self._eps.get(peer.channel)
            if ep is None:
                if not peer.data_address:  # its receiver has no UCX data plane
                    raise errors.PeerLostError(NO_UCX_PEER)
                check_worker_address(
                    peer.data_address, bytes(self._ucxx.get_worker_address().tobytes())
                )
                try:
                    address = self._ucxx.get_ucx_address_from_buffer(peer.data_address)
                    ep = await self._ucxx.create_endpoint_from_worker_address(
                        address, endpoint_error_handling=error_handling
                    )
                except Exception as exc:
                    raise errors.PeerLostError(f"cannot reach peer over UCX: {exc}") from exc
                self._eps[peer.channel] = ep
        self._connecting.pop(peer.channel, None)
        return ep

    async def send(self, peer: Peer, tag: int, buffers: Sequence[memoryview]) -> None:
        ep = await self._endpoint(peer, self._config.error_handling)
        try:
            raw = _requests(ep)
            buffer = self._array(_one_buffer(buffers))  # referenced until the send completes
            await _COMPLETIONS.wait(raw.tag_send(buffer, self._tag(tag)))
        except Exception as exc:
            raise errors.PeerLostError(f"UCX send failed: {exc}") from exc

    async def recv(self, peer: Peer, tag: int, into: memoryview) -> None:
        ep = await self._endpoint(peer, self._config.error_handling)
        try:
            raw = _requests(ep)
            buffer = self._array(into)  # referenced until the receive completes
            await _COMPLETIONS.wait(raw.tag_recv(buffer, self._tag(tag), self._full_mask))
        except Exception as exc:
            raise errors.PeerLostError(f"UCX receive failed: {exc}") from exc

    # ------------------------------------------------------------------ one-sided

    def register(self, address: int, length: int) -> tuple[bytes, object]:
        region = ucp.register(_context_handle(), address, length)
        return region.rkey, region

    def deregister(self, handle: object) -> None:
        assert isinstance(handle, ucp.Region)
        ucp.deregister(_context_handle(), handle)

    async def read(
        self,
        peer: Peer,
        regions: Sequence[RemoteRegion],
        into: memoryview,
        then: Callable[[], None] | None = None,
    ) -> None:
        ep = await self._endpoint(peer, _CONTEXT.checked_reads)
        reads = self._reads(peer)
        try:
            handle = int(_requests(ep).handle)
        except Exception as exc:
            raise errors.PeerLostError(f"UCX endpoint unusable: {exc}") from exc
        # A thread hop costs more than a small copy; not while the reader thread copies
        # (the loop would wait on the channel's lock for a whole segment).
        if into.nbytes <= _INLINE_READ_BYTES and not reads.chaining:
            rest = reads.in_place(handle, list(regions), into, then)
            if rest is not None:
                await rest
            return
        # The channel's reader thread holds ``into`` (so its memory outlives every read into
        # it) and the channel's lock while it calls into UCX on the endpoint.
        loop = asyncio.get_running_loop()
        queued = _Queued(handle, list(regions), into, loop, loop.create_future(), then)
        if reads.enqueue(queued):
            loop.run_in_executor(None, reads.drain).add_done_callback(_drained)
        try:
            await queued.future
        except asyncio.CancelledError:
            queued.skip = True  # not started yet: never started (one in progress finishes)
            raise

    def read_now(
        self,
        peer: Peer,
        regions: Sequence[RemoteRegion],
        into: memoryview,
        then: Callable[[], None] | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        ep = self._eps.get(peer.channel)
        reads = self._reads(peer)
        if ep is None or into.nbytes > _INLINE_READ_BYTES or reads.chaining:
            return self.read(peer, regions, into, then)
        try:
            handle = int(_requests(ep).handle)
        except Exception as exc:
            raise errors.PeerLostError(f"UCX endpoint unusable: {exc}") from exc
        return reads.in_place(handle, list(regions), into, then)

    def _reads(self, peer: Peer) -> _Reads:
        """The channel's reads (made once: a lock and an event cost ~20 µs to make)."""
        reads = self._reading.get(peer.channel)
        if reads is None:
            reads = self._reading[peer.channel] = _Reads()
        return reads

    def forget_keys(self, peer: Peer, key_ids: Sequence[int]) -> None:
        reads = self._reading.get(peer.channel)
        if reads is not None:
            reads.forget(key_ids)

    def discard_unmatched(self, keep: Callable[[int], bool]) -> list[tuple[int, int]]:
        if self._ucxx is None:
            return []
        return [(m.tag, m.length) for m in ucp.discard_unexpected(_worker_handle(), keep)]

    def fail_channel(self, peer: Peer) -> None:
        """Abort the channel's endpoint. One-sided reads in progress are let finish their
        current UCX call first (the lock: a CMA read copies inside the call, a segment at
        most) and issue nothing after; the abort cancels any still outstanding."""
        reads = self._reading.pop(peer.channel, None)
        ep = self._eps.pop(peer.channel, None)
        if reads is not None:
            with reads.lock:
                reads.abandoned.set()
                reads.drop_keys()  # now, or by the last read still in progress
                if ep is not None:
                    _abort(ep)
        elif ep is not None:
            _abort(ep)

    def release(self, peer: Peer) -> None:
        self.fail_channel(peer)  # nothing is pending on a link that closes cleanly

    async def close(self) -> None:
        while self._eps:
            _abort(self._eps.popitem()[1])


@dataclass(slots=True)
class _Queued:
    """A read waiting for its channel's reader thread."""

    endpoint: int
    regions: list[RemoteRegion]
    into: memoryview
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    then: Callable[[], None] | None = None
    """Run by the reader thread once the read completed (`UcxDataPlane.read`)."""
    skip: bool = False
    """Set by the awaiting transfer when it is cancelled: the read is not started."""

    def settle(self, exc: BaseException | None) -> None:
        """From the reader thread: complete the future on its loop (gone: nothing to tell)."""
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(_settle, self.future, exc)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _drained(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:  # drain itself never raises
        log.error("UCX reader thread failed", exc_info=done.exception())


class _Reads:
    """A channel's one-sided reads, run in threads (``ucp_get_nbx`` may copy inline), and
    the remote keys unpacked on its endpoint (once per key id, for the link's life)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = threading.Event()
        self.keys: dict[int, int] = {}
        """Key id → remote key unpacked on this channel's endpoint."""
        self.active = 0
        """Reads issued and not yet completed: keys are destroyed only when none are."""
        self.retired: list[int] = []
        """Keys forgotten while reads were active: destroyed with the last one."""
        self.chain_lock = threading.Lock()
        self.chain: collections.deque[_Queued] = collections.deque()
        """Reads waiting for the channel's reader thread (`drain`), in order."""
        self.chaining = False
        """Whether a reader thread is draining ``chain``."""

    def run(self, endpoint: int, regions: list[RemoteRegion], into: memoryview) -> None:
        self.finish(self.start(endpoint, regions, into), into)

    def enqueue(self, queued: _Queued) -> bool:
        """Queue a read for the channel's reader thread; True: none runs, start one."""
        with self.chain_lock:
            self.chain.append(queued)
            if self.chaining:
                return False
            self.chaining = True
            return True

    def drain(self) -> None:
        """The channel's reader thread: run the queued reads back to back, telling each
        one's event loop as it completes. A transfer's segments are read one after another
        with no loop turn and no thread hop between them (each cost 0.7-2.7 ms under load;
        two reads at once share the memory bandwidth instead, and the first lands late)."""
        while True:
            with self.chain_lock:
                if not self.chain:
                    self.chaining = False
                    return
                queued = self.chain.popleft()
            if queued.skip:
                continue
            try:
                self.run(queued.endpoint, queued.regions, queued.into)
                if queued.then is not None:
                    queued.then()
            except BaseException as exc:  # noqa: BLE001 - the awaiting transfer raises it
                queued.settle(exc)
            else:
                queued.settle(None)

    def start(self, endpoint: int, regions: list[RemoteRegion], into: memoryview) -> ucp.Gets:
        """Issue the reads (a CMA read copies right here) under the channel's lock."""
        gets = ucp.Gets(_worker_handle(), endpoint)
        base = _address(into)
        with self.lock:
            if self.abandoned.is_set():
                raise errors.PeerLostError("the transfer was abandoned")
            self.active += 1
            try:
                offset = 0
                for r in regions:
                    key = self.keys.get(r.key_id)
                    if key is None:
                        key = self.keys[r.key_id] = ucp.unpack_rkey(endpoint, r.rkey)
                    gets.issue(base + offset, r.length, r.address, key)
                    offset += r.length
            except BaseException:
                if gets.pending:  # e.g. a failed get after good ones: let those finish
                    with contextlib.suppress(errors.TransportError):
                        gets.wait(self.abandoned)
                self.active -= 1
                raise
        return gets

    def in_place(
        self,
        endpoint: int,
        regions: list[RemoteRegion],
        into: memoryview,
        then: Callable[[], None] | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """Issue the reads here (on the loop: a small segment); None once they completed
        (a CMA read copies inside the call) and ``then`` ran, else what waits for the rest
        in a thread, then runs ``then`` there."""
        gets = self.start(endpoint, regions, into)
        try:
            landed = gets.poll()
        except BaseException:  # a read failed: all of them completed
            self.done()
            raise
        if not landed:
            return asyncio.to_thread(self.finish, gets, into, then)
        self.done()
        if then is not None:
            then()  # (its failure is the transfer's: the reads are done with)
        return None

    def finish(
        self, gets: ucp.Gets, into: memoryview, then: Callable[[], None] | None = None
    ) -> None:
        """Wait for the reads (``into`` is held until they are done), then run ``then``."""
        try:
            gets.wait(self.abandoned)
        except errors.PeerLostError:
            if gets.pending:  # not cancelled: its keys may still be in use, leak them
                with self.lock:
                    self.keys.clear()
                    self.retired.clear()
                    self.active -= 1
                raise
            self.done()
            raise
        self.done()
        if then is not None:
            then()

    def done(self) -> None:
        with self.lock:
            self.active -= 1
            if not self.active:
                self._destroy(self.retired)
                self.retired = []
                if self.abandoned.is_set():
                    self.drop_keys()

    def forget(self, key_ids: Sequence[int]) -> None:
        """The sender withdrew these keys (between transfers: no read uses them)."""
        with self.lock:
            for key_id in key_ids:
                key = self.keys.pop(key_id, None)
                if key is not None:
                    self.retired.append(key)
            if not self.active:
                self._destroy(self.retired)
                self.retired = []

    def drop_keys(self) -> None:
        """The channel is going (called under the lock): destroy its keys unless a read
        still uses them (then the last read does)."""
        if not self.active:
            self._destroy([*self.keys.values(), *self.retired])
            self.keys.clear()
            self.retired = []

    @staticmethod
    def _destroy(keys: list[int]) -> None:
        for key in keys:
            ucp.destroy_rkey(key)


_CONTEXT_OPTIONS = {"CMA_MEMORY_INVALIDATE": "y", "USE_MT_MUTEX": "y"}
"""What every data plane starts UCX with (module notes): CMA stays eligible for reads'
error-handling endpoints, and the worker's lock is a mutex, not a spinlock."""

_INLINE_READ_BYTES = 1 << 20
"""Segments up to this size are read on the event loop (a CMA copy of 1 MiB: ~0.1 ms)."""


def _worker_handle() -> int:
    from ucxx import core  # noqa: PLC0415 - lazy like every ucxx import

    return int(core._get_ctx().worker.handle)


def _context_handle() -> int:
    from ucxx import core  # noqa: PLC0415 - lazy like every ucxx import

    return int(core._get_ctx().context.handle)


@dataclass(slots=True)
class _Context:
    """What this module knows of the process-wide UCXX context it started."""

    checked_reads: bool = False
    """Reads' endpoints get UCX peer error handling: CMA stays eligible for them in this
    context (otherwise they would be emulated over ``tcp/lo``)."""


_CONTEXT = _Context()

ADDRESS_VERSION_MASK = 0x0F
"""A packed UCX worker address's first byte: its format version in the low four bits (UCX's
``ucp/wireup/address.c``), flags above them."""
ADDRESS_MIN_BYTES = 9
"""The header byte and the worker's 64-bit uuid: no address is shorter."""


def check_worker_address(theirs: bytes, ours: bytes) -> None:
    """Refuse a peer's worker address (its HELLO's) that this UCX would not read: libucp
    *asserts* on an address version it does not know — the process aborts, every stream
    on the worker with it — so a peer's address must be at least a header and a uuid and
    carry this worker's own address version (both ends run one release: README, KV
    transport). What follows the header libucp checks itself and reports as an error."""
    if len(theirs) < ADDRESS_MIN_BYTES:
        raise errors.PeerLostError(
            f"cannot reach peer over UCX: its worker address is {len(theirs)} bytes, "
            f"not a UCX worker address"
        )
    version, own = theirs[0] & ADDRESS_VERSION_MASK, ours[0] & ADDRESS_VERSION_MASK
    if version != own:
        raise errors.PeerLostError(
            f"cannot reach peer over UCX: its worker address is of format version {version}, "
            f"this UCX's is {own} (both ends must run one UCX release)"
        )


def _reads_keep_cma(options: dict[str, str]) -> bool:
    """Whether error-handling endpoints keep CMA for reads in a context started with these
    ``ucxx.init`` options (else the environment's): CMA claims remote-access invalidation,
    or rendezvous is off (``import ucxx`` defaults ``UCX_RNDV_THRESH`` to 8192)."""

    def value(key: str) -> str:
        return options.get(key, os.environ.get(f"UCX_{key}", "")).strip().lower()

    return (
        value("CMA_MEMORY_INVALIDATE") in ("y", "yes", "on", "1") or value("RNDV_THRESH") == "inf"
    )


_COMPLETIONS = CompletionPoller()
"""One poller thread per process, shared by every UCX data plane and event loop."""


def _requests(ep: Any) -> Any:
    """The request API under UCXX's asyncio endpoint wrapper (None once aborted)."""
    raw = ep._ep
    if raw is None:
        raise errors.PeerLostError("UCX endpoint was aborted")
    return raw


def _request_api() -> tuple[Any, Any, Any]:
    try:
        from ucxx._lib.arr import Array  # noqa: PLC0415 - lazy like every ucxx import
        from ucxx.types import Tag, TagMaskFull  # noqa: PLC0415
    except Exception as exc:
        raise errors.BackendUnavailableError(f"this ucxx lacks the request API: {exc}") from exc
    return Array, Tag, TagMaskFull


def _initialised(ucxx: Any) -> bool:
    """Whether UCXX's process-wide context exists (a second data plane in one process)."""
    from ucxx import core  # noqa: PLC0415 - lazy like every ucxx import

    return core._ctx is not None


def _one_buffer(buffers: Sequence[memoryview]) -> memoryview | np.ndarray:
    """One message per segment (K and V of consecutive layers): each message costs a
    rendezvous round trip and Python overhead (~0.3 ms here). Adjacent in memory, as the
    reference engine lays out a prefill's KV, they go zero-copy; otherwise they are staged
    into one buffer (a memcpy)."""
    if len(buffers) == 1:
        return buffers[0]
    start = end = _address(buffers[0])
    for b in buffers:
        if _address(b) != end:
            return np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in buffers])
        end += b.nbytes
    first = np.frombuffer(buffers[0], dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(first, shape=(end - start,), strides=(1,))


def _address(b: memoryview) -> int:
    """Where a contiguous buffer's bytes start (ctypes is ~4x faster than numpy here: 32
    buffers a segment)."""
    if b.readonly or not b.nbytes:  # ctypes needs a writable, non-empty buffer
        return int(np.frombuffer(b, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(b))


def _abort(ep: Any) -> None:
    """Abort an endpoint: cancels its posted sends/receives (they raise UCXCanceledError)."""
    try:
        ep.abort(period=10**9)  # wait at most 1 s for UCX's own close steps
    except Exception:
        log.warning("UCX endpoint abort failed", exc_info=True)


def ucx_sender(
    settings: TransportSettings | None = None,
    config: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvSender:
    return KvSender(UcxDataPlane(config), settings or TransportSettings(), tls)


def ucx_receiver(
    settings: TransportSettings | None = None,
    model: ModelSpec | None = None,
    config: UcxConfig | None = None,
    tls: LinkTls | None = None,
) -> KvReceiver:
    return KvReceiver(UcxDataPlane(config), settings or TransportSettings(), model, tls)
