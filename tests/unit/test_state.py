"""The request lifecycle (`orchestrator.core.state`), checked against a table written by hand.

The expected table is read off the module docstring's diagram, not derived from the module's own
tables, so a change to either the code or the drawing shows up here:

    queued ─prefill─▶ prefilling ─kv_sent─▶ transferring ─kv_adopted─▶ decoding ─finish─▶ done
      │ ▲                                                              ▲
      │ └──────── requeue | take_over (epoch + 1) from any live state  │
      ├──aggregate─────────────────────────────────────────────────────┘
      └──finish──▶ done   (a failover or takeover found every token journalled already)
    any live state ──fail | expire──▶ failed      any live state ──cancel──▶ cancelled
"""

from __future__ import annotations

import itertools

import pytest

from orchestrator.core.state import (
    ENDING,
    INITIAL,
    LIVE,
    TERMINAL,
    Edge,
    State,
    apply,
    can_move,
    sources_for,
)
from orchestrator.errors import InvalidTransitionError

Q, P, T, D = State.QUEUED, State.PREFILLING, State.TRANSFERRING, State.DECODING
DONE, FAILED, CANCELLED = State.DONE, State.FAILED, State.CANCELLED
NON_TERMINAL = (Q, P, T, D)

# Every edge drawn in the docstring: its sources, its target, whether it bumps the epoch.
DRAWN: dict[Edge, tuple[frozenset[State], State, bool]] = {
    Edge.PREFILL: (frozenset({Q}), P, False),
    Edge.KV_SENT: (frozenset({P}), T, False),
    Edge.KV_ADOPTED: (frozenset({T}), D, False),
    Edge.AGGREGATE: (frozenset({Q}), D, False),
    Edge.FINISH: (frozenset({D, Q}), DONE, False),
    Edge.REQUEUE: (frozenset(NON_TERMINAL), Q, True),
    Edge.TAKE_OVER: (frozenset(NON_TERMINAL), Q, True),
    Edge.FAIL: (frozenset(NON_TERMINAL), FAILED, False),
    Edge.EXPIRE: (frozenset(NON_TERMINAL), FAILED, False),
    Edge.CANCEL: (frozenset(NON_TERMINAL), CANCELLED, False),
}
# (source, target) pairs some edge allows.
EXPECTED = {(s, t) for (sources, t, _) in DRAWN.values() for s in sources}
ALL_PAIRS = list(itertools.product(State, State))


def pair_id(pair: tuple[State, State]) -> str:
    return f"{pair[0]}->{pair[1]}"


def test_the_drawing_names_every_edge_and_state() -> None:
    # Guards the table itself: a new State or Edge must be placed in it deliberately.
    assert set(State) == {Q, P, T, D, DONE, FAILED, CANCELLED}
    assert set(DRAWN) == set(Edge)
    assert len(EXPECTED) == 18


@pytest.mark.parametrize("edge", list(Edge), ids=lambda e: e.wire)
def test_each_edge_matches_the_drawing(edge: Edge) -> None:
    sources, target, bumps = DRAWN[edge]
    assert (edge.sources, edge.target, edge.rule.bumps_epoch) == (sources, target, bumps)


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
def test_can_move_matches_the_table(pair: tuple[State, State]) -> None:
    assert can_move(*pair) is (pair in EXPECTED)


@pytest.mark.parametrize("edge", list(Edge), ids=lambda e: e.wire)
@pytest.mark.parametrize("state", list(State))
def test_apply_takes_an_edge_only_from_its_sources(edge: Edge, state: State) -> None:
    sources, target, bumps = DRAWN[edge]
    if state in sources:
        assert apply(edge, state, 7) == (target, 8 if bumps else 7)
    else:
        with pytest.raises(InvalidTransitionError, match=f"cannot {edge.wire} from {state}"):
            apply(edge, state, 7)


@pytest.mark.parametrize("epoch", [0, 1, 41])
def test_bump_is_relative_to_the_epoch_given(epoch: int) -> None:
    assert apply(Edge.REQUEUE, D, epoch) == (Q, epoch + 1)
    assert apply(Edge.REQUEUE, Q, epoch) == (Q, epoch + 1)  # a failed placement
    assert apply(Edge.KV_SENT, P, epoch) == (T, epoch)


def test_only_done_failed_cancelled_are_terminal() -> None:
    assert frozenset({DONE, FAILED, CANCELLED}) == TERMINAL
    assert frozenset(NON_TERMINAL) == LIVE
    assert INITIAL is Q
    for state in State:
        assert state.terminal is (state in {DONE, FAILED, CANCELLED}), state


@pytest.mark.parametrize("source", [DONE, FAILED, CANCELLED])
def test_terminal_states_allow_nothing(source: State) -> None:
    for target in State:
        assert not can_move(source, target), target
    for edge in Edge:
        with pytest.raises(InvalidTransitionError):
            apply(edge, source, 0)


def test_ending_edges_lead_to_their_state() -> None:
    assert set(ENDING) == set(TERMINAL)
    for state, edge in ENDING.items():
        assert edge.target is state


def test_sources_for_by_hand() -> None:
    assert sources_for(Q) == frozenset(NON_TERMINAL)
    assert sources_for(P) == frozenset({Q})
    assert sources_for(T) == frozenset({P})
    assert sources_for(D) == frozenset({Q, T})
    assert sources_for(DONE) == frozenset({D, Q})
    assert sources_for(FAILED) == frozenset(NON_TERMINAL)
    assert sources_for(CANCELLED) == frozenset(NON_TERMINAL)


def test_states_and_edges_are_their_wire_strings() -> None:
    # The store writes str(state) into Redis; its Lua looks edges up by these names.
    assert [str(s) for s in State] == [
        "queued",
        "prefilling",
        "transferring",
        "decoding",
        "done",
        "failed",
        "cancelled",
    ]
    assert [e.wire for e in Edge] == [
        "prefill",
        "kv_sent",
        "kv_adopted",
        "aggregate",
        "finish",
        "requeue",
        "take_over",
        "fail",
        "expire",
        "cancel",
    ]
