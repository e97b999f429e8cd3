"""The request state machine. Pure: the store executes these rules atomically (Lua).

    queued ──▶ prefilling ──▶ transferring ──▶ decoding ──▶ done
      ▲ │           │                 │             │
      │ └──▶ decoding (aggregated: one worker runs the whole request)
      └─────────────┴─────────────────┴─────────────┘  requeued for failover, epoch + 1
    any non-terminal ──▶ failed | cancelled

*transferring* means the prefill worker has sent the KV and the decode worker has not yet
adopted it. Every reassignment to another worker bumps the request's epoch; writes carrying
an older epoch are refused, so a zombie worker's late KV or tokens are never used.
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

_ALLOWED: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.PREFILLING, State.DECODING}),
    State.PREFILLING: frozenset({State.TRANSFERRING, State.QUEUED}),
    State.TRANSFERRING: frozenset({State.DECODING, State.QUEUED}),
    State.DECODING: frozenset({State.DONE, State.QUEUED}),
}
# Moves that take the request away from its workers (failover): they must bump the epoch.
_REASSIGN = frozenset(
    {
        (State.PREFILLING, State.QUEUED),
        (State.TRANSFERRING, State.QUEUED),
        (State.DECODING, State.QUEUED),
    }
)


@dataclass(frozen=True, slots=True)
class Transition:
    """A checked transition: from one of ``sources``, at ``epoch``, to ``target``."""

    sources: frozenset[State]
    target: State
    epoch: int
    new_epoch: int


def can_move(source: State, target: State) -> bool:
    if source.terminal:
        return False
    if target in (State.FAILED, State.CANCELLED):
        return True
    return target in _ALLOWED.get(source, frozenset())


def sources_for(target: State) -> frozenset[State]:
    """Every state from which ``target`` may be entered."""
    return frozenset(s for s in State if can_move(s, target))


def transition(source: State, target: State, epoch: int) -> Transition:
    """The transition from ``source`` (as the caller last saw it) to ``target``.

    Reassignments bump the epoch; others keep it. Raises InvalidTransitionError.
    """
    if not can_move(source, target):
        raise InvalidTransitionError(f"cannot go from {source} to {target}")
    bump = (source, target) in _REASSIGN
    return Transition(frozenset({source}), target, epoch, epoch + 1 if bump else epoch)
