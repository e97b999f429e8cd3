"""Where a request's blocks lie in one layer of vLLM's paged KV tensor, as byte ranges. Pure.

With one-sided reads (``ucx-read``) the prefill does not gather a request's blocks: the
decode side reads them straight out of vLLM's cache. The wire layout stays the gather's —
per layer K then V, each ``(n_blocks, *block_shape)`` in the request's block order — so
the reads must be the pieces of memory that, concatenated, are those bytes. A block's K
(or V) in a layer is ``chunks`` equally spaced contiguous runs: one run in the flash layout
("2BNHC": a block's K is ``[block_size, heads, head_dim]`` in one piece), one per head in
the CPU layout ("cpu-LBHNC": each (block, head) holds ``block_size`` rows of K then of V,
so a head's K chunk lies between V chunks). Runs that touch (consecutive blocks, in the
flash layout) are merged, so the number of descriptors stays small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockPieces:
    """One layer's K (or V), per block: ``chunks`` runs of ``nbytes`` bytes, the first at
    ``offset + block * block_stride``, each next one ``chunk_stride`` further (bytes from
    the start of the memory the layer's tensor views)."""

    offset: int
    block_stride: int
    chunks: int
    chunk_stride: int
    nbytes: int

    def ranges(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """(start, length) of ``blocks``' pieces in wire order, touching runs merged."""
        out: list[list[int]] = []
        for b in blocks:
            base = self.offset + b * self.block_stride
            for c in range(self.chunks):
                start = base + c * self.chunk_stride
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1][1] += self.nbytes
                else:
                    out.append([start, self.nbytes])
        return [(start, length) for start, length in out]


def block_pieces(
    shape: Sequence[int], strides: Sequence[int], offset: int, itemsize: int
) -> BlockPieces | None:
    """The pieces of a K (or V) view whose first dimension is the block (``shape``,
    ``strides`` and ``offset`` in elements, as torch gives them); None when a block is not
    equally spaced contiguous runs (then the connector gathers)."""
    if len(shape) < 2 or len(shape) != len(strides) or min(shape) <= 0:
        return None
    # The contiguous tail: the trailing dimensions a run covers.
    d, run = len(shape), 1
    while d > 1 and (shape[d - 1] == 1 or strides[d - 1] == run):
        run *= shape[d - 1]
        d -= 1
    # Between the block and the tail: dimensions that must collapse into one regular stride.
    for i in range(1, d - 1):
        if shape[i + 1] != 1 and strides[i] != strides[i + 1] * shape[i + 1]:
            return None
    chunks = math.prod(shape[1:d])
    chunk_stride = strides[d - 1] if d > 1 else 0
    if chunks > 1 and chunk_stride < run:
        return None  # overlapping runs: not a layout this connector knows
    return BlockPieces(
        offset=offset * itemsize,
        block_stride=strides[0] * itemsize,
        chunks=chunks,
        chunk_stride=chunk_stride * itemsize,
        nbytes=run * itemsize,
    )
