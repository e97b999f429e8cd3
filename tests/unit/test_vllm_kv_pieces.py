"""The pieces of a request's blocks in vLLM's paged layer tensor, concatenated, are exactly
what the connector's gather (``views.k[index][ids]``) produces, for both layouts."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.workers.vllm.kv_pieces import block_pieces

N, H, BS, HD = 10, 3, 4, 8


def _concat(memory: np.ndarray, view: np.ndarray, ids: list[int]) -> tuple[bytes, int]:
    """The bytes of ``view``'s blocks ``ids`` as pieces of ``memory``, and the piece count."""
    strides = tuple(s // view.itemsize for s in view.strides)
    offset = (view.ctypes.data - memory.ctypes.data) // view.itemsize
    pieces = block_pieces(view.shape, strides, offset, view.itemsize)
    assert pieces is not None
    flat = memory.reshape(-1).view(np.uint8)
    ranges = pieces.ranges(ids)
    return b"".join(flat[s : s + n].tobytes() for s, n in ranges), len(ranges)


IDS = [4, 5, 6, 1, 9]


@pytest.mark.parametrize("kv", [0, 1], ids=["K", "V"])
def test_cpu_layout_pieces_are_the_gather_one_per_block_and_head(kv: int) -> None:
    t = np.arange(N * H * BS * 2 * HD, dtype=np.float32).reshape(N, H, BS, 2 * HD)
    view = t.reshape(N, H, 2, BS, HD)[:, :, kv]  # the connector's split of "cpu-LBHNC"
    got, count = _concat(t, view, IDS)
    assert got == view[IDS].tobytes()
    assert count == len(IDS) * H  # K and V interleave: nothing merges


@pytest.mark.parametrize("kv", [0, 1], ids=["K", "V"])
def test_flash_layout_pieces_are_the_gather_consecutive_blocks_merged(kv: int) -> None:
    t = np.arange(2 * N * BS * H * HD, dtype=np.float32).reshape(2, N, BS, H, HD)
    view = t[kv]
    got, count = _concat(t, view, IDS)
    assert got == view[IDS].tobytes()
    assert count == 3  # 4-5-6, 1, 9


def test_a_single_head_cpu_layout_is_one_piece_per_block() -> None:
    t = np.arange(N * 1 * BS * 2 * HD, dtype=np.float32).reshape(N, 1, BS, 2 * HD)
    view = t.reshape(N, 1, 2, BS, HD)[:, :, 1]
    got, count = _concat(t, view, IDS)
    assert got == view[IDS].tobytes()
    assert count == len(IDS)


def test_a_layout_that_is_not_regular_runs_has_no_pieces() -> None:
    """Then the connector gathers."""
    t = np.zeros((N, BS, H, HD), np.float32)
    view = t.transpose(0, 2, 1, 3)  # heads before tokens, token-major: runs of HD, 2 strides
    assert block_pieces(view.shape, tuple(s // 4 for s in view.strides), 0, 4) is None
    odd = np.zeros((N, 3, 5, HD), np.float32)[:, ::2, ::2]
    assert block_pieces(odd.shape, tuple(s // 4 for s in odd.strides), 0, 4) is None
