"""The sender's registration cache (`transport.registry`): each allocation registered once,
its registration gone the moment the allocation is freed, descriptors exact."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np

from transport.control import Descriptor
from transport.registry import Registry


class FakePlane:
    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.deregistered: list[tuple[int, int]] = []

    def register(self, address: int, length: int) -> tuple[bytes, object]:
        self.registered.append((address, length))
        return b"rkey", (address, length)

    def deregister(self, handle: object) -> None:
        assert isinstance(handle, tuple)
        self.deregistered.append(handle)


def _registry() -> tuple[Registry, FakePlane]:
    plane = FakePlane()
    return Registry(plane.register, plane.deregister), plane


def test_an_allocation_is_registered_once_whole_and_slices_are_offsets_into_it() -> None:
    reg, plane = _registry()
    block = np.zeros(4096, dtype=np.uint8)
    base = block.ctypes.data
    views = [block[i : i + 1024].data for i in range(0, 4096, 1024)]
    descs, used = reg.acquire(views)
    assert descs == [Descriptor(used[0].key.key_id, 0, 4096)]  # adjacent: one descriptor
    reg.release(used)
    descs, used2 = reg.acquire([block[1024:2048].data, block[3072:].data])
    key = used[0].key.key_id
    assert descs == [Descriptor(key, 1024, 1024), Descriptor(key, 3072, 1024)]  # a gap splits
    assert used2 == used
    assert plane.registered == [(base, 4096)]  # once, the whole allocation
    reg.release(used2)
    assert plane.deregistered == []  # alive: stays registered


def test_buffers_apart_are_a_block_list_in_order() -> None:
    reg, _ = _registry()
    a, b = np.zeros(100, dtype=np.uint8), np.zeros(200, dtype=np.uint8)
    descs, used = reg.acquire([a.data, b.data, a[:0].data])
    assert [(d.offset, d.length) for d in descs] == [(0, 100), (0, 200)]  # empty skipped
    assert len({d.key_id for d in descs}) == 2
    assert sum(d.length for d in descs) == 300  # the receiver checks they fill its slice
    reg.release(used)


def test_a_freed_allocation_is_deregistered_and_never_matched_again() -> None:
    reg, plane = _registry()
    block = np.ones(1 << 16, dtype=np.uint8)
    first = block.ctypes.data
    _, used = reg.acquire([block[:4096].data])
    old = used[0].key.key_id
    reg.release(used)
    del used, block
    gc.collect()
    reg.collect()
    assert plane.deregistered == [(first, 1 << 16)]
    assert old not in reg.live  # a link that told its receiver sends WITHDRAW next
    fresh = np.ones(1 << 16, dtype=np.uint8)  # may well land at the same address
    descs, used = reg.acquire([fresh.data])
    assert descs[0].key_id != old  # a new registration under a new key, never the old one
    assert len(plane.registered) == 2
    reg.release(used)


def test_memory_not_owned_by_a_numpy_array_is_registered_for_one_transfer() -> None:
    reg, plane = _registry()
    raw = bytearray(4096)
    _, used = reg.acquire([memoryview(raw)])
    assert used[0].transient
    key = used[0].key.key_id
    assert key in reg.live
    reg.release(used)  # the transfer ended: withdrawn
    assert key not in reg.live
    assert plane.deregistered == [plane.registered[0]]


def test_a_registration_in_use_by_two_transfers_is_kept_until_both_end() -> None:
    reg, plane = _registry()
    raw = bytearray(4096)
    _, a = reg.acquire([memoryview(raw)])
    _, b = reg.acquire([memoryview(raw)])
    reg.release(a)
    assert b[0].key.key_id in reg.live
    reg.release(b)
    assert len(plane.deregistered) == 2  # transient: one registration per transfer


def test_close_deregisters_everything() -> None:
    reg, plane = _registry()
    block = np.zeros(4096, dtype=np.uint8)
    _, used = reg.acquire([block.data])
    reg.release(used)
    reg.close()
    assert plane.deregistered == plane.registered
    assert not reg.live


def test_a_block_list_is_looked_up_block_by_block_never_compared_field_by_field() -> None:
    """A KV of many blocks apart is a registration per block: the transfer's bookkeeping
    (`Registry.acquire`, the sender's used list) asks "is this one already in?" per block.
    Registrations are distinct objects (each has its own key id), compared by identity — by
    value, each question compared every field of every registration before it (a 32-block
    4 MiB transfer spent ~15 % of its sender's time there)."""
    reg, _ = _registry()
    blocks = [np.zeros(256, dtype=np.uint8) for _ in range(64)]
    descs, used = reg.acquire([b.data for b in blocks])
    assert len(descs) == len(used) == 64
    assert len({r.key.key_id for r in used}) == 64
    twin = dataclasses.replace(used[0])  # every field equal, another registration
    assert twin != used[0]
    assert twin not in used
    assert len(set(used)) == 64  # hashable: usable as a set's members
    reg.release(used)
