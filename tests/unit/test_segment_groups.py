"""Segments grouped on the way (issue 16, the vLLM connector's layer-by-layer path): a group
staged together is named segment by segment (`kv_bytes.split_descriptors`: each READ names
exactly its segment's bytes, in order), and consecutive segments the receiver reads as one
keep their regions in order, the two that meet merged when adjacent (`incoming._joined`);
a group's pieces are staged one after another (`kv_bytes.copy_into`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transport import control, kv_bytes
from transport.incoming import _joined
from transport.kv_bytes import copy_into, split_descriptors

D = control.Descriptor


def _bytes_named(descriptors: list[D]) -> list[tuple[int, int]]:
    """(key id, offset) of every byte, in order."""
    return [(d.key_id, d.offset + i) for d in descriptors for i in range(d.length)]


def test_one_staging_buffer_split_into_its_segments() -> None:
    got = split_descriptors([D(3, 100, 60)], [10, 20, 30])
    assert got == [[D(3, 100, 10)], [D(3, 110, 20)], [D(3, 130, 30)]]


def test_a_descriptor_straddling_two_segments_is_split_between_them() -> None:
    got = split_descriptors([D(1, 0, 5), D(2, 40, 10)], [8, 7])
    assert got == [[D(1, 0, 5), D(2, 40, 3)], [D(2, 43, 7)]]


@pytest.mark.parametrize("sizes", [[10, 11], [21], [5, 5, 5], [0, 20], [-1, 21]])
def test_sizes_that_are_not_the_descriptors_bytes_are_refused(sizes: list[int]) -> None:
    with pytest.raises(ValueError, match="descriptors of 20 bytes"):
        split_descriptors([D(1, 0, 20)], sizes)


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 400), max_size=8),
)
def test_split_names_every_byte_once_in_order(lengths: list[int], cuts: list[int]) -> None:
    descriptors = [D(k, 1000 * k, n) for k, n in enumerate(lengths)]
    total = sum(lengths)
    points = sorted({c for c in cuts if c < total})
    sizes = [b - a for a, b in zip([0, *points], [*points, total], strict=True)]
    runs = split_descriptors(descriptors, sizes)
    assert [sum(d.length for d in run) for run in runs] == sizes
    assert all(d.length > 0 for run in runs for d in run)
    flat = [d for run in runs for d in run]
    assert _bytes_named(flat) == _bytes_named(descriptors)


def _region(key_id: int, address: int, length: int) -> control.RemoteRegion:
    return control.RemoteRegion(address, length, b"rkey-%d" % key_id, key_id)


def test_adjacent_regions_of_one_key_are_read_as_one() -> None:
    got = _joined([_region(1, 0, 8), _region(1, 100, 16)], [_region(1, 116, 4), _region(2, 0, 4)])
    assert got == [_region(1, 0, 8), _region(1, 100, 20), _region(2, 0, 4)]


@pytest.mark.parametrize(
    "more",
    [_region(2, 116, 4), _region(1, 117, 4), _region(1, 90, 4)],
    ids=["other-key", "gap", "before"],
)
def test_regions_that_do_not_meet_stay_apart_in_order(more: control.RemoteRegion) -> None:
    first = [_region(1, 100, 16)]
    assert _joined(first, [more]) == [*first, more]


def test_staging_copies_pieces_of_any_shape_one_after_another() -> None:
    """`kv_bytes.copy_into`: byte views, float views and 2-d views, small and large (taken
    two ways), each as its bytes, in order, filling exactly the buffer."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(16).astype(np.float32)
    b = rng.integers(0, 255, 40, dtype=np.uint8)
    c = rng.standard_normal((3, 5)).astype(np.float16)
    big = rng.integers(0, 255, kv_bytes._GIL_FREE_COPY_BYTES + 3, dtype=np.uint8)
    pieces = [memoryview(a), memoryview(b), memoryview(c), memoryview(a).cast("B")[8:24]]
    pieces += [memoryview(big), memoryview(big)[5:]]
    buf = np.full(sum(p.nbytes for p in pieces), 0xAB, dtype=np.uint8)
    copy_into(buf, pieces)
    assert buf.tobytes() == b"".join(p.tobytes() for p in pieces)
