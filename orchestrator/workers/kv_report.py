"""What a worker's prefix cache holds, kept from its engine's block events. Pure.

An engine with a prefix cache (vLLM) says, step by step, which blocks it stored — with the
block's token ids, its own hash and its parent's — and which it evicted. `HeldBlocks` turns
that into pdorch's keys (`orchestrator.core.prefix`: the same chained hash over the same
token ids, so every worker and every orchestrator replica agree whatever seed or hash
function the engine runs with) and keeps them newest last, for the heartbeat
(`HeldBlocks.report`).

Re-hashing needs the parent's digest: a stored block whose parent this tracker never saw
(events lost, or the tracker started after the engine) is skipped — the index then lacks
it, which only makes routing slower. A gap in the engine's event sequence numbers clears
everything (the next stores rebuild it): never credit a worker with blocks it may have
evicted in the events we missed.

The reference and simulated engines have no prefix cache and report nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.core.prefix import DEFAULT_SEED, block_digests, encode_keys, key_of


class HeldBlocks:
    def __init__(self, block_size: int, seed: str = DEFAULT_SEED) -> None:
        self.block_size = block_size
        self.seed = seed
        self._digest: dict[object, bytes] = {}
        """Engine's block hash -> our digest, insertion order = store order (newest last)."""
        self._engine: dict[bytes, object] = {}
        """Our digest -> the engine's block hash (`holds`)."""
        self._last_seq: int | None = None
        self.skipped = 0
        """Blocks stored under a parent we never saw (not reported)."""
        self.gaps = 0
        """Event sequence gaps seen (each cleared the report)."""

    def __len__(self) -> int:
        return len(self._digest)

    def sequence(self, seq: int) -> None:
        """The engine's batch sequence number: a jump clears what we hold."""
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.gaps += 1
            self.cleared()
        self._last_seq = seq

    def stored(
        self, hashes: Sequence[object], parent: object | None, token_ids: Sequence[int]
    ) -> None:
        """The engine stored ``len(hashes)`` full blocks of ``token_ids`` after ``parent``."""
        if len(token_ids) != len(hashes) * self.block_size:
            self.skipped += len(hashes)
            return  # not this tracker's block size (another KV cache group): ignore
        prev: bytes | None = None
        if parent is not None:
            prev = self._digest.get(parent)
            if prev is None:
                self.skipped += len(hashes)
                return
        digests = block_digests(token_ids, self.block_size, parent=prev, seed=self.seed)
        for h, d in zip(hashes, digests, strict=True):
            self._digest.pop(h, None)
            self._digest[h] = d
            self._engine[d] = h

    def removed(self, hashes: Sequence[object]) -> None:
        for h in hashes:
            d = self._digest.pop(h, None)
            if d is not None and self._engine.get(d) == h:
                del self._engine[d]

    def cleared(self) -> None:
        self._digest.clear()
        self._engine.clear()

    def holds(self, digest: bytes) -> bool:
        """Whether the block of that chained digest is held (so, as the engine evicts a
        request's blocks last first, most likely the whole prefix it ends)."""
        return digest in self._engine

    def keys(self, limit: int | None = None) -> list[int]:
        """Our keys of the blocks held, newest last (the newest ``limit`` of them)."""
        digests = list(self._digest.values())
        if limit is not None:
            digests = digests[-limit:] if limit > 0 else []
        return [key_of(d) for d in digests]

    def report(self, limit: int) -> str:
        """The heartbeat's ``kv_prefix`` (`orchestrator.core.prefix.encode_keys`)."""
        return encode_keys(self.keys(limit))
