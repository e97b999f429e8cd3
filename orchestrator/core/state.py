"""The request lifecycle: states and the named edges between them. Pure.

    queued ─prefill─▶ prefilling ─kv_sent─▶ transferring ─kv_adopted─▶ decoding ─finish─▶ done
      │ ▲                                                              ▲
      │ └──────── requeue | take_over (epoch + 1) from any live state  │
      ├──aggregate─────────────────────────────────────────────────────┘
      └──finish──▶ done   (a failover or takeover found every token journalled already)
    any live state ──fail | expire──▶ failed      any live state ──cancel──▶ cancelled

*transferring* means the prefill worker has sent the KV and the decode worker has not yet
adopted it. Every reassignment (``requeue``, ``take_over``) bumps the request's epoch; writes
carrying an older epoch are refused, so a zombie worker's late KV or tokens are never used.

`Edge` is the one table of the lifecycle. Every call site names the edge it takes; the store
executes it atomically (its Lua scripts are rendered from this table by
`orchestrator.store.lua`), and `apply` is the same rule in Python (the in-memory store, tests).
The terminal set is `TERMINAL`; everything else (Lua, the chaos checker) derives from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from orchestrator.errors import InvalidTransitionError


class State(enum.StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({State.DONE, State.FAILED, State.CANCELLED})
LIVE = frozenset(set(State) - TERMINAL)
INITIAL = State.QUEUED
"""The state a request is created in."""


@dataclass(frozen=True, slots=True)
class Rule:
    wire: str
    """The edge's name in the store's scripts (distinct: edges with the same move differ)."""
    sources: frozenset[State]
    target: State
    bumps_epoch: bool = False
    """A reassignment: the request leaves its workers, so the epoch fences them off."""


class Edge(enum.Enum):
    """Every move a request can make, by what it means. ``edge.value`` is its `Rule`."""

    PREFILL = Rule("prefill", frozenset({State.QUEUED}), State.PREFILLING)
    """Placed disaggregated: a prefill worker computes the KV."""
    KV_SENT = Rule("kv_sent", frozenset({State.PREFILLING}), State.TRANSFERRING)
    """The prefill worker sent the KV to the decode worker."""
    KV_ADOPTED = Rule("kv_adopted", frozenset({State.TRANSFERRING}), State.DECODING)
    """The decode worker adopted the KV (its first token arrived)."""
    AGGREGATE = Rule("aggregate", frozenset({State.QUEUED}), State.DECODING)
    """Placed aggregated: one worker runs the whole request."""
    FINISH = Rule("finish", frozenset({State.DECODING, State.QUEUED}), State.DONE)
    """Every token is out. From queued when a failover or takeover found the journal full."""
    REQUEUE = Rule("requeue", LIVE, State.QUEUED, bumps_epoch=True)
    """Failover: the attempt failed; placed again (from queued too: a placement that failed
    before the request moved)."""
    TAKE_OVER = Rule("take_over", LIVE, State.QUEUED, bumps_epoch=True)
    """Another replica takes the request whose owner's lease lapsed."""
    FAIL = Rule("fail", LIVE, State.FAILED)
    EXPIRE = Rule("expire", LIVE, State.FAILED)
    """The deadline reaper: the request sat in its state past the state's deadline."""
    CANCEL = Rule("cancel", LIVE, State.CANCELLED)

    @property
    def rule(self) -> Rule:
        rule: Rule = self.value
        return rule

    @property
    def target(self) -> State:
        return self.rule.target

    @property
    def sources(self) -> frozenset[State]:
        return self.rule.sources

    @property
    def wire(self) -> str:
        """The edge's name in the store's scripts."""
        return self.rule.wire


ENDING = {State.DONE: Edge.FINISH, State.FAILED: Edge.FAIL, State.CANCELLED: Edge.CANCEL}
"""The edge a driver takes to end a request in each terminal state."""


def can_move(source: State, target: State) -> bool:
    """Whether some edge leads from ``source`` to ``target`` (derived from `Edge`)."""
    return any(source in e.sources and e.target is target for e in Edge)


def sources_for(target: State) -> frozenset[State]:
    """Every state from which ``target`` may be entered."""
    return frozenset(s for s in State if can_move(s, target))


def apply(edge: Edge, state: State, epoch: int) -> tuple[State, int]:
    """The state and epoch after taking ``edge`` from ``state`` at ``epoch``.

    Raises InvalidTransitionError when ``state`` is not one of the edge's sources."""
    rule = edge.rule
    if state not in rule.sources:
        raise InvalidTransitionError(f"cannot {edge.wire} from {state} (to {rule.target})")
    return rule.target, epoch + 1 if rule.bumps_epoch else epoch
