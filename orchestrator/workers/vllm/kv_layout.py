"""Which of vLLM's KV blocks move, and what their transfer's header must say. Pure.

vLLM keeps a request's KV in fixed-size *blocks* (``block_size`` tokens each) scattered over
one paged tensor per layer. pdorch's connector moves whole blocks, never single tokens: on the
wire a layer is K then V, each shaped ``(n_blocks, *block_shape)`` in the order of the
request's block table, so each side's copy is one gather/scatter by block index and a
one-sided (RDMA-style) transport can later move the same blocks without a staging copy. The
last block is partial: the tokens past ``token_count`` in it are junk, copied and never read
(the decode computes its next token into that slot).

What the header carries and the receiver checks before it reserves a byte (transport.wire):
token count, dtype and layer count natively; the block size, the KV layout and the per-block
shape of K and V through `wire_fingerprint` (model fingerprint + layout + block size) and the
layer shapes, checked by `BlockModelSpec` — a `wire.ModelSpec` whose expected layer shape is
``(blocks for token_count, *block_shape)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transport import wire


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One engine's KV cache as the connector sees it (both sides must agree)."""

    n_layers: int
    block_size: int
    """Tokens per block (vLLM's ``cache_config.block_size``)."""
    block_shape: tuple[int, ...]
    """Shape of one block of K (and of V) in one layer, e.g. (kv_heads, block_size, head_dim)."""
    layout: str
    """Name of the physical layout (e.g. "LBHNC"); a mismatch is refused by fingerprint."""
    dtype: wire.DType
    """The cache's element type."""

    def __post_init__(self) -> None:
        if self.n_layers <= 0 or self.block_size <= 0 or not self.block_shape:
            raise ValueError(f"invalid block layout {self}")

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens (the last one possibly partial)."""
        return math.ceil(tokens / self.block_size)

    def layer_shape(self, tokens: int) -> wire.LayerShape:
        shape = (self.blocks_for(tokens), *self.block_shape)
        return wire.LayerShape(k=shape, v=shape)

    def kv_bytes(self, tokens: int, dtype: wire.DType | None = None) -> int:
        """Payload bytes of a transfer of ``tokens`` tokens in ``dtype`` (default: the cache's)."""
        return self.n_layers * self.layer_shape(tokens).nbytes(dtype or self.dtype)

    def fingerprint(self, model_fingerprint: str) -> str:
        return wire_fingerprint(model_fingerprint, self)


def wire_fingerprint(model_fingerprint: str, layout: BlockLayout) -> str:
    """The header's fingerprint: the model's plus what makes block bytes interchangeable."""
    return f"{model_fingerprint}|vllm-blocks:{layout.layout}:bs{layout.block_size}"


@dataclass(frozen=True, slots=True)
class BlockModelSpec(wire.ModelSpec):
    """The receiver's header check for block-shaped KV (``wire.check_expected`` calls
    `layer_shape`): every layer must be ``(blocks for token_count, *block_shape)``."""

    block_size: int = 1
    block_shape: tuple[int, ...] = ()

    def layer_shape(self, tokens: int) -> wire.LayerShape:
        shape = (math.ceil(tokens / self.block_size), *self.block_shape)
        return wire.LayerShape(k=shape, v=shape)


def model_spec(model_fingerprint: str, layout: BlockLayout, max_tokens: int) -> BlockModelSpec:
    return BlockModelSpec(
        fingerprint=wire_fingerprint(model_fingerprint, layout),
        n_layers=layout.n_layers,
        kv_heads=0,
        head_dim=0,
        max_tokens=max_tokens,
        block_size=layout.block_size,
        block_shape=layout.block_shape,
    )


def send_blocks(block_ids: list[int], tokens: int, block_size: int) -> list[int]:
    """The prefill's blocks that hold its first ``tokens`` tokens, in order."""
    n = math.ceil(tokens / block_size)
    if tokens <= 0 or n > len(block_ids):
        raise ValueError(f"{tokens} tokens need {n} blocks, the request has {len(block_ids)}")
    return block_ids[:n]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Where a received KV goes: wire block ``src[i]`` into local block ``dst[i]``."""

    src: range
    dst: tuple[int, ...]


def load_plan(
    block_ids: list[int], computed_tokens: int, load_tokens: int, block_size: int
) -> LoadPlan:
    """The received blocks to copy for tokens ``[computed_tokens, load_tokens)``.

    ``computed_tokens`` are already in the decode's own blocks (a local prefix-cache hit,
    always whole blocks, shared with other requests: never written); the blocks from there to
    the one holding token ``load_tokens - 1`` are written from the same positions of the
    received KV.
    """
    if computed_tokens % block_size:
        raise ValueError(f"{computed_tokens} locally computed tokens are not whole blocks")
    first, end = computed_tokens // block_size, math.ceil(load_tokens / block_size)
    if not 0 <= first <= end <= len(block_ids):
        raise ValueError(
            f"tokens [{computed_tokens}, {load_tokens}) do not fit {len(block_ids)} blocks"
        )
    return LoadPlan(src=range(first, end), dst=tuple(block_ids[first:end]))
