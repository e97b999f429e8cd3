"""One-sided UCX: which memory regions a segment's buffers become (`transport.ucx._runs`)."""

from __future__ import annotations

import numpy as np

from transport.ucx import _runs


def test_adjacent_buffers_are_one_region() -> None:
    block = np.zeros(4096, dtype=np.uint8)
    views = [block[i : i + 1024].data for i in range(0, 4096, 1024)]
    assert _runs(views) == [(block.ctypes.data, 4096)]


def test_buffers_apart_are_a_block_list_in_order() -> None:
    a, b = np.zeros(100, dtype=np.uint8), np.zeros(200, dtype=np.uint8)
    got = _runs([a.data, b.data])
    assert got == [(a.ctypes.data, 100), (b.ctypes.data, 200)]
    assert sum(n for _, n in got) == 300  # the receiver checks regions add up to its slice


def test_empty_buffers_are_skipped_and_a_gap_splits_a_run() -> None:
    block = np.zeros(300, dtype=np.uint8)
    got = _runs([block[:100].data, block[100:100].data, block[200:].data])
    assert got == [(block.ctypes.data, 100), (block.ctypes.data + 200, 100)]
