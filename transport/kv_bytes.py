"""A KV's bytes as a sender hands them to the wire: pure functions, no I/O.

What `transport.sender` checks and shapes before a transfer: a layer given as pieces of
memory, checked against the header (`layer_pieces`); each layer's checksum and the frames
that carry them (`checksums`, `frames`); a small KV joined from its tensors in one call
(`joined`), or a KV laid out as on the wire in one allocation taken as one span (`span`);
one-sided, which segments of pieces apart are staged into one buffer (`staged`, `copy_into`).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from transport import control, errors, wire

Pieces = Sequence[memoryview]
"""K or V of a layer as pieces of memory, in wire order (`OutgoingTransfer.send_layer`)."""
Parts = list[tuple[int, list[memoryview], list[memoryview]]]
"""Layers of a segment: index, buffers as checksummed, buffers as sent."""


def layer_pieces(
    h: wire.KvHeader,
    index: int,
    k: Pieces,
    v: Pieces,
    scales: tuple[np.ndarray, np.ndarray] | None,
) -> list[memoryview]:
    """Layer ``index``'s K and V pieces as byte views, checked against the header."""
    if scales is not None or h.scales is not wire.ScaleLayout.NONE:
        raise errors.WireFormatError(f"layer {index}: a scaled layer cannot be sent in pieces")
    shape = h.layers[index]
    kn = shape.k_nbytes(h.dtype)
    out: list[memoryview] = []
    for p in (*k, *v):
        if not p.c_contiguous:
            raise errors.WireFormatError(f"layer {index}: a piece is not contiguous")
        out.append(p if p.format == "B" and p.ndim == 1 else p.cast("B"))
    got_k = sum(p.nbytes for p in out[: len(k)])
    got_v = sum(p.nbytes for p in out[len(k) :])
    if got_k != kn or got_v != shape.nbytes(h.dtype) - kn:
        raise errors.WireFormatError(
            f"layer {index}: pieces of {got_k} + {got_v} bytes; the header's layer is "
            f"{kn} + {shape.nbytes(h.dtype) - kn}"
        )
    return out


def checksums(layers: list[list[memoryview]]) -> list[int]:
    return [wire.checksum(*layer) for layer in layers]


STAGE_PIECE_BYTES = 256 << 10
"""One-sided: a segment of pieces smaller than this on average is staged (`staged`)."""


def staged(pieces: Sequence[memoryview], limit: int | None = None) -> bool:
    """Whether a one-sided segment of ``pieces`` apart (a paged cache's blocks, layers
    allocated apart) is staged: copied into one pooled, registered buffer (`copy_into`) and
    read as one region — at least two pieces, up to ``limit`` bytes, smaller than
    `STAGE_PIECE_BYTES` on average (a read per piece costs ~17 µs here, a copy of 256 KiB
    ~8) or more than one READ names (`control.MAX_REGIONS`)."""
    n = len(pieces)
    if n < 2:
        return False
    total = sum([p.nbytes for p in pieces])
    if limit is not None and total > limit:
        return False
    return total < STAGE_PIECE_BYTES * n or n > control.MAX_REGIONS


_GIL_FREE_COPY_BYTES = 16 << 10
"""`copy_into` copies a piece this large with numpy, which lets go of the GIL meanwhile;
smaller ones with a memoryview's slice assignment, which holds it (~0.3 µs a piece where
numpy's costs ~1.3: 16 MiB in 4 KiB pieces 6.1 → 2.6 ms). Staging runs in the checksum
thread, and copies that hold the GIL starved the event loop of the same process: with
every piece taken so (32 KiB), a 64 MiB KV's READs all went out only once its last segment
was copied (16 ms in, not 5), and it moved slower (38–41 → 42–48 ms)."""


def copy_into(buf: np.ndarray, pieces: Sequence[memoryview]) -> None:
    """``pieces`` (C-contiguous) one after another into the byte array ``buf`` (staging:
    `staged`)."""
    dst = buf.data.cast("B")
    pos = 0
    for p in pieces:
        end = pos + p.nbytes
        if p.nbytes >= _GIL_FREE_COPY_BYTES:
            buf[pos:end] = np.frombuffer(p, dtype=np.uint8)
        else:
            dst[pos:end] = p if p.format == "B" and p.ndim == 1 else p.cast("B")
        pos = end


def split_descriptors(
    descriptors: Sequence[control.Descriptor], sizes: Sequence[int]
) -> list[list[control.Descriptor]]:
    """``descriptors`` (of bytes one after another) cut into consecutive runs of ``sizes``
    bytes each — one READ's per segment of a group staged together — a descriptor that
    straddles two runs split between them."""
    if sum(sizes) != sum(d.length for d in descriptors) or any(n <= 0 for n in sizes):
        raise ValueError(f"descriptors of {sum(d.length for d in descriptors)} bytes; {sizes}")
    rest = list(reversed(descriptors))
    out: list[list[control.Descriptor]] = []
    for size in sizes:
        run: list[control.Descriptor] = []
        left = size
        while left:
            d = rest.pop()
            if d.length > left:  # the rest of it starts the next run
                rest.append(control.Descriptor(d.key_id, d.offset + left, d.length - left))
                d = control.Descriptor(d.key_id, d.offset, left)
            run.append(d)
            left -= d.length
        out.append(run)
    return out


def frames(parts: Parts, sums: list[int]) -> bytes:
    return b"".join(
        wire.encode_layer_frame(wire.LayerFrame(i, sum(b.nbytes for b in summed), c))
        for (i, summed, _), c in zip(parts, sums, strict=True)
    )


JOIN_EAGER_BYTES = 64 << 10
"""An eager KV up to this size is joined from its tensors (`joined`): the link joins a
message this small into one write anyway (`transport.link.Link.send_parts`)."""
_SHAPE = operator.attrgetter("shape")
_ITEMSIZE = operator.attrgetter("dtype.itemsize")


def joined(h: wire.KvHeader, cache: wire.KvCache) -> memoryview | None:
    """A small unscaled KV's payload in wire order as one new buffer, joined from its
    tensors (whatever their layout in memory), each checked against the header's shape and
    item size — the checks and the join one C call each, not a Python step per tensor: a
    32-layer 4 KiB KV in ~15 µs, where `span` checks each tensor's address (~40 µs) and
    its bytes are then copied into the message anyway. None when a tensor differs from the
    header, or is not C-contiguous or not exportable (the span or layer-by-layer path takes
    it, and says which layer differs)."""
    if h.scales is not wire.ScaleLayout.NONE or not h.payload_bytes:
        return None
    tensors = [t for pair in cache.layers for t in pair]
    shapes = wire.tensor_shapes(h)
    if tuple(map(_SHAPE, tensors)) != shapes or set(map(_ITEMSIZE, tensors)) != {h.dtype.itemsize}:
        return None
    try:
        joined = b"".join(cast(Any, tensors))  # numpy's stubs lack Buffer
    except (TypeError, ValueError, BufferError):  # not contiguous, or not exportable
        return None
    return memoryview(joined) if len(joined) == h.payload_bytes else None


def span(h: wire.KvHeader, cache: wire.KvCache) -> memoryview | None:
    """The whole KV as one byte view, when its K and V tensors lie back to back in wire
    order inside one numpy allocation that owns its memory, each with the header's shape
    and item size; else None (taken layer by layer). The view's exporter is a view of
    that allocation, so `Registry` registers the allocation, as it would for the layers."""
    if h.scales is not wire.ScaleLayout.NONE or not h.payload_bytes:
        return None
    itemsize, offsets = h.dtype.itemsize, h.bounds
    try:
        base = _addressof(_from_buffer(cache.layers[0][0]))
        for (k, v), shape, off in zip(cache.layers, h.layers, offsets, strict=False):
            if k.shape != shape.k or v.shape != shape.v:
                return None  # the layer-by-layer path says which layer differs
            if k.dtype.itemsize != itemsize or v.dtype.itemsize != itemsize:
                return None
            if _addressof(_from_buffer(k)) != base + off:
                return None
            if _addressof(_from_buffer(v)) != base + off + k.nbytes:
                return None
        root = cache.layers[0][0]
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or not root.flags.c_contiguous or not root.flags.owndata:
            return None
        start = base - _addressof(_from_buffer(root))
    except (TypeError, ValueError, BufferError):  # read-only, empty, not contiguous
        return None
    if start < 0 or start + h.payload_bytes > root.nbytes:
        return None
    flat: np.ndarray = root.reshape(-1).view(np.uint8)
    return flat[start : start + h.payload_bytes].data


_from_buffer: Callable[[Any], ctypes.c_char] = ctypes.c_char.from_buffer
"""Where an array's bytes start, with `_addressof` (~0.3 µs; ``ndarray.ctypes.data`` ~1.3)."""
_addressof = ctypes.addressof
