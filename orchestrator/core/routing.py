"""KV-cache-aware routing: which worker to prefer given the prefixes they hold. Pure.

The scheduler (`orchestrator.core.scheduler.place`) calls this with a `Hint`: the request's
prompt length and, per worker, how many of its leading prompt tokens that worker holds in
its KV cache (`orchestrator.core.prefix.PrefixIndex.match`).

* **Prefill** goes to the worker whose queue *and* this prompt's uncached part clear first:
  ``(queued tokens + prompt - reused) / measured rate`` (tokens alone before rates are
  known) — the queue term is what placement always weighed; the reuse term is the prefill
  compute the worker's cache saves (Dynamo's KV router weighs the same two: blocks to
  prefill against the worker's load; llm-d adds a prefix-cache scorer to a queue scorer).
* **Decode** prefers, among the workers with KV room, the one holding the longest prefix
  (a conversation's previous turn ran there), as long as its batch is at most ``slack``
  sequences larger than the least loaded one's; otherwise least loaded as before. Without
  any prefix held, placement is exactly what it was without routing.

A stale index can only cost time: a worker credited with a prefix it evicted recomputes
it; the engine checks its own cache, never ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.core.prefix import PrefixIndex, iter_block_keys
from orchestrator.core.records import WorkerInfo


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    enabled: bool = True
    """Route by the prefixes workers report holding. Changes nothing while no worker
    reports a cache (the reference and simulated engines never do; vLLM workers do)."""
    suffix_only: bool = True
    """Move only the KV a decode worker lacks: when it holds a prefix of the request, the
    prefill sends the suffix's KV and the header names the prefix it extends (a worker that
    no longer holds it refuses; the prefill then sends the whole KV)."""
    decode_slack: int = 4
    """A decode worker holding the longest prefix wins if its batch is at most this many
    sequences above the least loaded fitting worker's (turn N+1 follows turn N unless that
    worker is clearly busier)."""


@dataclass(frozen=True, slots=True)
class Hint:
    prompt_tokens: int
    """Tokens the prefill computes without a cache (the prompt, + output after a failover)."""
    cached: Mapping[str, int] = field(default_factory=dict)
    """Worker id → leading prompt tokens whose KV it holds (the index's longest match)."""
    decode_slack: int = 4

    def reused(self, worker_id: str) -> int:
        """Prompt tokens ``worker_id`` need not compute. The last prompt token is always
        computed (its logits sample the first output token), as vLLM caps its hits."""
        return max(0, min(self.cached.get(worker_id, 0), self.prompt_tokens - 1))


def prefill_seconds(queued: int, compute: int, rate: float | None) -> float:
    """When a prefill of ``compute`` tokens behind ``queued`` ones ends (in tokens, when
    the worker's rate is not measured yet)."""
    tokens = queued + compute
    return tokens / rate if rate else float(tokens)


def pick_prefill(
    candidates: Sequence[tuple[WorkerInfo, int]],
    queued: Mapping[str, int],
    rates: Mapping[str, float],
    hint: Hint,
) -> tuple[WorkerInfo, str]:
    """The prefill worker (among ``(worker, active)``) whose prefill of this prompt ends
    first, ties broken by fewer active sequences; and a note for the request record."""

    def key(c: tuple[WorkerInfo, int]) -> tuple[float, int, str]:
        w, active = c
        compute = hint.prompt_tokens - hint.reused(w.worker_id)
        ends = prefill_seconds(queued.get(w.worker_id, 0), compute, rates.get(w.worker_id))
        return ends, active, w.worker_id

    best = min(candidates, key=key)[0]
    reused = hint.reused(best.worker_id)
    note = f"prefill reuses {reused}/{hint.prompt_tokens} cached tokens" if reused else ""
    return best, note


def pick_decode(
    fitting: Sequence[tuple[int, int, str, WorkerInfo]], hint: Hint
) -> tuple[WorkerInfo, str]:
    """The decode worker among ``fitting`` ((active, -free, id, worker), all with KV room):
    the least loaded, unless one within ``decode_slack`` of it holds a longer prefix."""
    least = min(fitting, key=lambda f: f[:3])
    near = [f for f in fitting if f[0] <= least[0] + hint.decode_slack]
    best = min(near, key=lambda f: (-hint.reused(f[2]), *f[:3]))
    if hint.reused(best[2]) <= hint.reused(least[2]):
        best = least  # no gain: keep the least loaded choice
    reused = hint.reused(best[3].worker_id)
    note = f"decode holds {reused}/{hint.prompt_tokens} prompt tokens" if reused else ""
    return best[3], note


def suffix_note(asked: int, extended: int, refused: bool, tokens: int) -> str:
    """The request record's word on a suffix-only transfer of ``tokens`` tokens' KV that
    asked to leave out the first ``asked`` (the decode worker's prefix, as indexed):
    ``extended`` were left out; ``refused``: the decode worker did not hold them."""
    if refused:
        return f"decode lacked the indexed {asked}-token prefix: whole KV sent"
    if extended:
        return f"KV suffix only: {tokens - extended}/{tokens} tokens sent"
    return "whole KV sent (the prefill worker cannot send a suffix)"


def hint_for(
    index: PrefixIndex,
    workers: Sequence[WorkerInfo],
    tokens: Sequence[int],
    policy: RoutingPolicy,
) -> Hint | None:
    """Bring ``index`` up to the live heartbeats, then the routing hint for a prefill of
    ``tokens`` (None when routing is off or no worker holds any prefix of them: placement
    then is exactly what it is without routing)."""
    if not policy.enabled or not tokens:
        return None
    index.sync({w.worker_id: (w.kv_block_size, w.kv_prefix) for w in workers if w.kv_block_size})
    return hint_from(index, tokens, policy)


def hint_from(index: PrefixIndex, tokens: Sequence[int], policy: RoutingPolicy) -> Hint | None:
    """`hint_for` with ``index`` already up to the live heartbeats (synced once per listing,
    `orchestrator.core.fleet.Fleet`)."""
    if not policy.enabled or not tokens or not len(index):
        return None
    matches = index.match({size: iter_block_keys(tokens, size) for size in index.sizes()})
    if not matches:
        return None
    cached = {wid: m.tokens for wid, m in matches.items()}
    return Hint(len(tokens), cached, policy.decode_slack)
