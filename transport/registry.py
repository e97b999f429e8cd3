"""The sender's registered memory (one-sided transfers): each allocation registered once,
for as long as it lives, and its remote key sent once per link.

A KV buffer handed to the sender is a view of some allocation (a numpy array that owns its
memory: a prefill's KV block, a worker's KV pool). The first transfer that uses it registers
the *whole allocation* (`register`: ``ucp_mem_map`` plus the packed remote key) under a new
key id; later transfers of any part of it reuse that registration and send only
(key id, offset, length) descriptors. A link tells its receiver a key (KEYS) the first time
one of its transfers names it (`Link.keys_told`).

**Never outliving or aliasing freed memory.** An entry holds a *weak* reference to the
allocation and is removed the moment the allocation is freed (a weakref callback, run by
the deallocation itself, before the memory is returned), so no later buffer at the same
address can ever match it; its deregistration follows on the sender's event loop
(`collect`), and every link that told its receiver that key sends WITHDRAW before its next
transfer, so the receiver forgets it and refuses a READ that names it. A transfer holds its
buffers (strong references) until it ended — for a failed one, until the receiver's reads
stopped (`KvSender._quarantine`) — so an allocation is never freed under a read. Memory the
sender cannot tie to an owning numpy array is registered for the one transfer and withdrawn
after it (``transient``).

**Regions registered explicitly.** Memory that no numpy array owns but that lives long — an
engine's KV cache (vLLM's paged tensors, for the engine's lifetime) — is registered once by
its owner (`register_region`: address, length, and an object kept alive with the entry) and
matched like an allocation, by containment, before anything else; its key crosses each link
once. `unregister_region` (at close) retires it as a freed allocation is retired: the
deregistration waits for the transfers using it (as a transient one's does), and each link
that holds its key sends WITHDRAW before its next transfer. Such memory is not the
transfer's to hold: its owner keeps what is read stable until the transfer ended, and the
sender checksums it before the receiver is told where it lies (`transport.sender`), so a
read of memory re-used after a failed transfer is refused by its checksum.

Not thread-safe but for the weakref callback, which only appends to a deque.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport.control import Descriptor, RemoteKey

Register = Callable[[int, int], tuple[bytes, object]]
"""(address, length) → (packed remote key, handle for deregistration)."""
Deregister = Callable[[object], None]


@dataclass(slots=True, eq=False)
class Registration:
    key: RemoteKey
    handle: object
    transient: bool
    users: int = 0
    """Transfers using it now (a transient one is withdrawn when this drops to 0)."""
    finalizer: weakref.finalize[Any, Any] | None = field(default=None, repr=False)
    owner: object = field(default=None, repr=False)
    """An explicit region's owner (`Registry.register_region`), kept alive with it."""


class Registry:
    def __init__(self, register: Register, deregister: Deregister) -> None:
        self._register = register
        self._deregister = deregister
        self._by_owner: dict[int, Registration] = {}
        """Allocation id → its registration (removed as the allocation is freed)."""
        self.live: dict[int, Registration] = {}
        """Key id → registration, for every key a receiver may still be told or use."""
        self._regions: list[Registration] = []
        """Explicit regions (`register_region`), by address."""
        self._starts: list[int] = []
        """Their addresses, for bisection."""
        self._dead: collections.deque[Registration] = collections.deque()
        self._ids = itertools.count(1)
        self.registrations = 0
        """How many times memory was registered (tests: once per allocation)."""

    def acquire(self, buffers: list[memoryview]) -> tuple[list[Descriptor], list[Registration]]:
        """Descriptors of ``buffers`` (adjacent ones merged), registering what is new; the
        caller `release`s the returned registrations when its transfer ended."""
        self.collect()
        runs: list[list[int]] = []  # [key id, offset, length], adjacent buffers merged
        used: list[Registration] = []
        reg: Registration | None = None
        start = end = 0
        for b in buffers:
            if not b.nbytes:
                continue
            address = _address(b)
            # Inside the previous buffer's allocation (alive: its entry would be gone
            # otherwise, and live allocations never overlap)? Then it is that one.
            if reg is None or reg.transient or not start <= address < address + b.nbytes <= end:
                reg = self._for(b, address)
                start, end = reg.key.address, reg.key.address + reg.key.length
                if reg not in used:
                    reg.users += 1
                    used.append(reg)
            offset = address - start
            last = runs[-1] if runs else None
            if last and last[0] == reg.key.key_id and last[1] + last[2] == offset:
                last[2] += b.nbytes
            else:
                runs.append([reg.key.key_id, offset, b.nbytes])
        return [Descriptor(*run) for run in runs], used

    def register_region(self, address: int, length: int, owner: object) -> Registration:
        """Register ``length`` bytes at ``address`` until `unregister_region` (or `close`);
        ``owner`` (what keeps the memory alive) is referenced as long. Overlapping an
        explicit region already registered is an error (a piece must match one key)."""
        if address <= 0 or length <= 0:
            raise ValueError(f"cannot register {length} bytes at {address:#x}")
        at = bisect.bisect_left(self._starts, address)
        neighbours = self._regions[max(at - 1, 0) : at + 1]
        if any(_overlap(r.key, address, length) for r in neighbours):
            raise ValueError(f"{length} bytes at {address:#x} overlap a registered region")
        reg = self._new(address, length, transient=False)
        reg.owner = owner
        self._regions.insert(at, reg)
        self._starts.insert(at, address)
        return reg

    def unregister_region(self, reg: Registration) -> None:
        """Retire an explicit region: deregistered now, or when the last transfer using it
        ended; links that hold its key withdraw it before their next transfer."""
        if reg not in self._regions:
            return
        at = self._regions.index(reg)
        del self._regions[at], self._starts[at]
        reg.owner = None
        if reg.users:
            reg.transient = True  # `release` retires it with its last user
        else:
            self._retire(reg)
        self.collect()

    def release(self, used: list[Registration]) -> None:
        for reg in used:
            reg.users -= 1
            if reg.transient and reg.users == 0:
                self._retire(reg)
        self.collect()

    def collect(self) -> None:
        """Deregister what was freed or retired (on the sender's loop, not in a callback)."""
        while self._dead:
            reg = self._dead.popleft()
            if self.live.pop(reg.key.key_id, None) is not None:
                self._deregister(reg.handle)

    def close(self) -> None:
        for reg in list(self._by_owner.values()):
            if reg.finalizer is not None:
                reg.finalizer.detach()
        self._by_owner.clear()
        self._regions.clear()
        self._starts.clear()
        self._dead.extend(self.live.values())
        self.collect()

    def _retire(self, reg: Registration) -> None:
        self._dead.append(reg)

    def _for(self, b: memoryview, address: int) -> Registration:
        region = self._region(address, b.nbytes)
        if region is not None:
            return region
        owner = _owner(b)
        if owner is not None:
            reg = self._by_owner.get(id(owner))
            if reg is not None and _inside(reg.key, address, b.nbytes):
                return reg
            start, length = _extent(owner)
            if reg is None and start <= address and address + b.nbytes <= start + length:
                reg = self._new(start, length, transient=False)
                key = id(owner)
                self._by_owner[key] = reg
                reg.finalizer = weakref.finalize(owner, self._freed, key, reg)
                return reg
        return self._new(address, b.nbytes, transient=True)

    def _region(self, address: int, length: int) -> Registration | None:
        """The explicit region holding ``length`` bytes at ``address``, if any."""
        if not self._regions:
            return None
        at = bisect.bisect_right(self._starts, address) - 1
        if at >= 0 and _inside(self._regions[at].key, address, length):
            return self._regions[at]
        return None

    def _new(self, address: int, length: int, *, transient: bool) -> Registration:
        rkey, handle = self._register(address, length)
        self.registrations += 1
        reg = Registration(RemoteKey(next(self._ids), address, length, rkey), handle, transient)
        self.live[reg.key.key_id] = reg
        return reg

    def _freed(self, key: int, reg: Registration) -> None:
        """The allocation is being freed (weakref callback, any thread): forget it now, so
        nothing matches it again; deregister later (`collect`)."""
        if self._by_owner.get(key) is reg:
            del self._by_owner[key]
        self._dead.append(reg)


def _inside(key: RemoteKey, address: int, length: int) -> bool:
    return key.address <= address and address + length <= key.address + key.length


def _overlap(key: RemoteKey, address: int, length: int) -> bool:
    return address < key.address + key.length and key.address < address + length


def _owner(b: memoryview) -> np.ndarray | None:
    """The numpy array that owns ``b``'s memory, or None (not numpy, or a foreign owner)."""
    obj: Any = b.obj
    if not isinstance(obj, np.ndarray):
        return None
    root: np.ndarray = obj
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is not None or not root.flags.c_contiguous or not root.flags.owndata:
        return None
    return root


def _extent(owner: np.ndarray) -> tuple[int, int]:
    return int(owner.ctypes.data), int(owner.nbytes)


def _address(b: memoryview) -> int:
    if b.readonly:
        return int(np.frombuffer(b, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(b))
