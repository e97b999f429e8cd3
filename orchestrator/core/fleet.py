"""One listing of the live workers, split once, and placement's candidates drawn from it. Pure.

Admission and placement run for every request over the workers this replica listed
(`orchestrator.control.directory`: one listing serves every request for
``workers_cache_s``). What depends only on the listing — the pools, the models they serve,
what their prefix caches hold — is derived once per listing here (`Fleet.of`), not per
request.

**Sampled candidates** (`Fleet.candidates`). Choosing the best worker of a pool is a scan
of the pool: ~1.5 µs per worker per request here (`pdorch bench placement`), 1.5 ms a
request at 1,000 workers. A pool larger than ``sample`` workers is represented by
``sample`` of them drawn at random for each request — the "power of d choices": with d of
a few dozen the chosen worker's load is within a small step of the pool's least-loaded,
and the random draw keeps every replica from piling onto the same worker — plus every
worker the request must consider whatever the draw: those holding a prefix of its tokens
(KV-aware routing). The ledger places over the whole listing after all when the draw has no
room or no usable pair (`orchestrator.control.ledger`). Pools of at most ``sample`` workers
are taken whole, so placement over a small fleet is exactly the scan it was. 0: never
sampled.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from orchestrator.core.records import WorkerInfo


@dataclass(frozen=True, slots=True)
class Fleet:
    workers: Sequence[WorkerInfo]
    """The listing, as listed."""
    prefill: tuple[WorkerInfo, ...]
    decode: tuple[WorkerInfo, ...]
    by_id: dict[str, WorkerInfo]
    fingerprints: frozenset[str]
    """The models the listing serves (more than one: a misconfigured fleet)."""
    prefixes: dict[str, tuple[int, str]]
    """Worker id -> (block size, encoded prefix keys) of every worker reporting a cache
    (`orchestrator.core.prefix.PrefixIndex.sync`)."""

    @classmethod
    def of(cls, workers: Sequence[WorkerInfo]) -> Fleet:
        return cls(
            workers=workers,
            prefill=tuple(w for w in workers if w.role == "prefill"),
            decode=tuple(w for w in workers if w.role == "decode"),
            by_id={w.worker_id: w for w in workers},
            fingerprints=frozenset(w.fingerprint for w in workers),
            prefixes={
                w.worker_id: (w.kv_block_size, w.kv_prefix) for w in workers if w.kv_block_size
            },
        )

    def sampled(self, sample: int) -> bool:
        """Whether a pool is larger than ``sample`` (0: never)."""
        return sample > 0 and (len(self.prefill) > sample or len(self.decode) > sample)

    def candidates(
        self, sample: int, rng: random.Random, keep: Collection[str] = ()
    ) -> Sequence[WorkerInfo]:
        """The workers one request chooses among: the whole listing when no pool is larger
        than ``sample``; else at most ``sample`` of each larger pool, drawn at random, and
        every worker of it whose id is in ``keep``."""
        if not self.sampled(sample):
            return self.workers
        out: list[WorkerInfo] = []
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if len(pool) <= sample:
                out += pool
                continue
            drawn = rng.sample(pool, sample)
            out += drawn
            if keep:
                have = {w.worker_id for w in drawn}
                kept = (self.by_id.get(wid) for wid in keep if wid not in have)
                out += [w for w in kept if w is not None and w.role == role]
        return out
