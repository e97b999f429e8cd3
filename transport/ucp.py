"""The few libucp calls UCXX's Python API lacks: memory registration, remote keys, get, and
taking tag messages no receive matched (UCX's unexpected queue) to discard them.

UCXX 0.52 exposes tag, stream and active-message operations but no one-sided (RMA) ones
(checked with ``dir()`` on ``ucxx._lib.libucxx``). Its context is created with
``UCP_FEATURE_RMA`` and its worker in ``UCS_THREAD_MODE_MULTI``, so the one-sided calls can
be made on UCXX's own context, worker and endpoints through ctypes, on the ``libucp`` that
the ``libucx`` wheel ships (the one UCXX has loaded). Everything here is synchronous and
may block for a copy (UCX runs a CMA get inside ``ucp_get_nbx``): callers run it in a thread.

Only `transport.ucx` uses this module, and only after UCXX started (the library is loaded).
Structure layouts follow ``ucp/api/ucp.h`` of libucx 1.21 (``ucp_mem_map_params_t``,
``ucp_request_param_t``); `pdorch[ucx]` pins that minor version range through ucxx.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transport import errors

_MEM_MAP_ADDRESS = 1 << 0
_MEM_MAP_LENGTH = 1 << 1
_INPROGRESS = 1
_ERR_LAST = -100
_POLL_S = 50e-6
"""Between completion checks of a get that did not complete inline (tcp lanes)."""
_ABANDON_GRACE_S = 1.0


class _MemMapParams(ctypes.Structure):
    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    )


class _RequestParam(ctypes.Structure):
    _fields_ = (
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    )


class _TagRecvInfo(ctypes.Structure):
    _fields_ = (("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t))


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
_NO_PARAMS = _RequestParam()  # op_attr_mask 0: contiguous bytes, no callback


def _ucp() -> ctypes.CDLL:
    global _lib  # noqa: PLW0603 - one handle per process, loaded on first use
    with _lib_lock:
        if _lib is None:
            _lib = _load()
        return _lib


def _load() -> ctypes.CDLL:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        raise errors.BackendUnavailableError("libucx (from pdorch[ucx]) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libucp.so.0"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise errors.BackendUnavailableError(f"cannot load {path}: {exc}") from exc
    vp, st = ctypes.c_void_p, ctypes.c_int
    sigs: dict[str, tuple[object, list[object]]] = {
        "ucp_mem_map": (st, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)]),
        "ucp_mem_unmap": (st, [vp, vp]),
        "ucp_rkey_pack": (st, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_size_t)]),
        "ucp_rkey_buffer_release": (None, [vp]),
        "ucp_ep_rkey_unpack": (st, [vp, ctypes.c_char_p, ctypes.POINTER(vp)]),
        "ucp_rkey_destroy": (None, [vp]),
        "ucp_get_nbx": (
            vp,
            [vp, vp, ctypes.c_size_t, ctypes.c_uint64, vp, ctypes.POINTER(_RequestParam)],
        ),
        "ucp_request_check_status": (st, [vp]),
        "ucp_tag_probe_nb": (
            vp,
            [vp, ctypes.c_uint64, ctypes.c_uint64, st, ctypes.POINTER(_TagRecvInfo)],
        ),
        "ucp_tag_msg_recv_nbx": (
            vp,
            [vp, vp, ctypes.c_size_t, vp, ctypes.POINTER(_RequestParam)],
        ),
        "ucp_worker_progress": (ctypes.c_uint, [vp]),
        "ucp_request_free": (None, [vp]),
        "ucs_status_string": (ctypes.c_char_p, [st]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        text = _ucp().ucs_status_string(status).decode(errors="replace")
        raise errors.PeerLostError(f"{what} failed: {text}")


@dataclass(frozen=True, slots=True)
class Region:
    """Registered local memory whose remote key a peer may use to read it."""

    address: int
    length: int
    rkey: bytes
    memh: int


def register(context: int, address: int, length: int) -> Region:
    """Register ``length`` bytes at ``address`` with UCX and pack their remote key."""
    lib = _ucp()
    params = _MemMapParams(
        field_mask=_MEM_MAP_ADDRESS | _MEM_MAP_LENGTH, address=address, length=length
    )
    memh = ctypes.c_void_p()
    _check(lib.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    try:
        _check(
            lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)),
            "ucp_rkey_pack",
        )
    except BaseException:
        lib.ucp_mem_unmap(context, memh)
        raise
    rkey = ctypes.string_at(buf, size.value)
    lib.ucp_rkey_buffer_release(buf)
    return Region(address, length, rkey, int(memh.value or 0))


def deregister(context: int, region: Region) -> None:
    _ucp().ucp_mem_unmap(context, region.memh)


def unpack_rkey(endpoint: int, rkey: bytes) -> int:
    """A remote key unpacked on ``endpoint`` (destroy it with `destroy_rkey`, after every
    read using it completed)."""
    key = ctypes.c_void_p()
    _check(_ucp().ucp_ep_rkey_unpack(endpoint, rkey, ctypes.byref(key)), "ucp_ep_rkey_unpack")
    return int(key.value or 0)


def destroy_rkey(key: int) -> None:
    _ucp().ucp_rkey_destroy(key)


class Gets:
    """One-sided reads issued on an endpoint with unpacked remote keys: `issue` each, then
    `poll` or `wait`. The keys belong to the caller (kept per link, destroyed once no read
    uses them)."""

    def __init__(self, worker: int, endpoint: int) -> None:
        self._worker = worker
        self._ep = endpoint
        self._requests: list[int] = []
        self._failure = 0

    def issue(self, into: int, length: int, remote: int, key: int) -> None:
        lib = _ucp()
        ptr = lib.ucp_get_nbx(self._ep, into, length, remote, key, ctypes.byref(_NO_PARAMS))
        value = int(ptr or 0)
        if value == 0:
            return  # completed inline (CMA copies here)
        if value >= (1 << 64) + _ERR_LAST:
            _check(value - (1 << 64), "ucp_get_nbx")
        self._requests.append(value)

    def poll(self) -> bool:
        """Progress the worker, collect finished reads; True once none is pending (then
        the first failure, if any, is raised).

        Progress is made here rather than left to UCXX's progress thread: that thread
        sleeps on the worker's events, and a CMA read's completion raises none (reads then
        completed ~2 ms late at 1 MiB)."""
        if not self._requests:
            _check(self._failure, "ucp_get_nbx")
            return True
        lib = _ucp()
        while lib.ucp_worker_progress(self._worker):
            pass
        still = []
        for req in self._requests:
            status = lib.ucp_request_check_status(req)
            if status == _INPROGRESS:
                still.append(req)
            else:
                self._failure = self._failure or status
                lib.ucp_request_free(req)
        self._requests = still
        if still:
            return False
        _check(self._failure, "ucp_get_nbx")
        return True

    def wait(self, abandoned: threading.Event) -> None:
        """`poll` until every read completed. Deadlines are the caller's: it sets
        ``abandoned`` and aborts the endpoint, which cancels what is outstanding (those
        reads then complete, failed); after that, at most ``_ABANDON_GRACE_S`` (the keys
        in use are then leaked with the reads: never destroy a key in use)."""
        given_up_at: float | None = None
        while not self.poll():
            if abandoned.is_set():
                now = time.monotonic()
                given_up_at = given_up_at or now
                if now - given_up_at > _ABANDON_GRACE_S:
                    raise errors.PeerLostError("one-sided reads not cancelled by the abort")
            time.sleep(_POLL_S)

    @property
    def pending(self) -> int:
        return len(self._requests)


_SCRATCH = ctypes.create_string_buffer(4096)
"""Where discarded messages are received: a longer one is truncated (UCX then completes it
with an error at once, and its sender's send completes), so discarding costs no memory."""
_FULL_MASK = (1 << 64) - 1


def discard_unexpected(
    worker: int, keep: Callable[[int], bool], limit: int = 256
) -> list[Unmatched]:
    """Take tag messages no posted receive matched from the worker's unexpected queue and
    drop them, oldest first, up to ``limit``; stop at the first whose tag ``keep`` wants (a
    live transfer's segment that arrived before its receive was posted: that receive will
    match it). Returns what was dropped. Blocking: call it in a thread."""
    lib = _ucp()
    dropped: list[Unmatched] = []
    while lib.ucp_worker_progress(worker):
        pass
    while len(dropped) < limit:
        info = _TagRecvInfo()
        if not lib.ucp_tag_probe_nb(worker, 0, 0, 0, ctypes.byref(info)):
            break
        if keep(info.sender_tag):
            break
        # Take exactly that message (its tag in full: nothing else can want it).
        message = lib.ucp_tag_probe_nb(worker, info.sender_tag, _FULL_MASK, 1, ctypes.byref(info))
        if not message:
            break
        ptr = lib.ucp_tag_msg_recv_nbx(
            worker, _SCRATCH, len(_SCRATCH), message, ctypes.byref(_NO_PARAMS)
        )
        value = int(ptr or 0)
        if 0 < value < (1 << 64) + _ERR_LAST:  # in progress: complete it (it fits the scratch)
            deadline = time.monotonic() + _ABANDON_GRACE_S
            while lib.ucp_request_check_status(value) == _INPROGRESS:
                lib.ucp_worker_progress(worker)
                if time.monotonic() > deadline:
                    raise errors.PeerLostError("an unmatched UCX message did not complete")
                time.sleep(_POLL_S)
            lib.ucp_request_free(value)
        dropped.append(Unmatched(int(info.sender_tag), int(info.length)))
    return dropped


@dataclass(frozen=True, slots=True)
class Unmatched:
    """A tag message no receive wanted, dropped: its tag and length."""

    tag: int
    length: int
