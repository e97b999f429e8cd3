"""The request state machine (`orchestrator.core.state`), checked against a table written by hand.

The expected table is read off the module docstring's diagram, not derived from the module's own
tables, so a change to either the code or the drawing shows up here:

    queued ──▶ prefilling ──▶ transferring ──▶ decoding ──▶ done
      ▲ │           │                 │             │
      │ └──▶ decoding (aggregated: one worker runs the whole request)
      └─────────────┴─────────────────┴─────────────┘  requeued for failover, epoch + 1
    any non-terminal ──▶ failed | cancelled
"""

from __future__ import annotations

import itertools

import pytest

from orchestrator.core.state import TERMINAL, State, Transition, can_move, sources_for, transition
from orchestrator.errors import InvalidTransitionError

Q, P, T, D = State.QUEUED, State.PREFILLING, State.TRANSFERRING, State.DECODING
DONE, FAILED, CANCELLED = State.DONE, State.FAILED, State.CANCELLED

# Every move drawn in the docstring, and whether it bumps the epoch (only requeueing does).
DRAWN: dict[tuple[State, State], bool] = {
    (Q, P): False,
    (Q, D): False,  # aggregated
    (P, T): False,
    (T, D): False,
    (D, DONE): False,
    (P, Q): True,  # requeued for failover
    (T, Q): True,
    (D, Q): True,
}
NON_TERMINAL = (Q, P, T, D)
ENDINGS: dict[tuple[State, State], bool] = {
    (s, end): False for s in NON_TERMINAL for end in (FAILED, CANCELLED)
}

# (source, target) -> bumps the epoch; a pair absent from this table is forbidden.
EXPECTED: dict[tuple[State, State], bool] = {**DRAWN, **ENDINGS}

ALL_PAIRS = list(itertools.product(State, State))
ALLOWED_PAIRS = [pair for pair in ALL_PAIRS if pair in EXPECTED]
FORBIDDEN_PAIRS = [pair for pair in ALL_PAIRS if pair not in EXPECTED]


def pair_id(pair: tuple[State, State]) -> str:
    return f"{pair[0]}->{pair[1]}"


def test_the_expected_table_names_only_real_states() -> None:
    # Guards the table itself: a new State must be placed in it deliberately.
    assert set(State) == {Q, P, T, D, DONE, FAILED, CANCELLED}
    assert len(ALLOWED_PAIRS) == len(EXPECTED) == 16
    assert len(FORBIDDEN_PAIRS) == 49 - 16


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=pair_id)
def test_can_move_matches_the_table(pair: tuple[State, State]) -> None:
    source, target = pair
    assert can_move(source, target) is (pair in EXPECTED)


@pytest.mark.parametrize("pair", ALLOWED_PAIRS, ids=pair_id)
def test_allowed_transition_keeps_or_bumps_the_epoch(pair: tuple[State, State]) -> None:
    source, target = pair
    bumps = EXPECTED[pair]
    got = transition(source, target, 7)
    assert got == Transition(
        sources=frozenset({source}), target=target, epoch=7, new_epoch=8 if bumps else 7
    )


@pytest.mark.parametrize("pair", FORBIDDEN_PAIRS, ids=pair_id)
def test_forbidden_transition_raises(pair: tuple[State, State]) -> None:
    source, target = pair
    with pytest.raises(InvalidTransitionError, match=f"from {source} to {target}"):
        transition(source, target, 3)


@pytest.mark.parametrize("epoch", [0, 1, 41])
def test_bump_is_relative_to_the_epoch_given(epoch: int) -> None:
    assert transition(D, Q, epoch).new_epoch == epoch + 1
    assert transition(P, T, epoch).new_epoch == epoch


def test_only_done_failed_cancelled_are_terminal() -> None:
    assert frozenset({DONE, FAILED, CANCELLED}) == TERMINAL
    for state in State:
        assert state.terminal is (state in {DONE, FAILED, CANCELLED}), state


@pytest.mark.parametrize("source", [DONE, FAILED, CANCELLED])
def test_terminal_states_allow_nothing(source: State) -> None:
    for target in State:
        assert not can_move(source, target), target
        with pytest.raises(InvalidTransitionError):
            transition(source, target, 0)


@pytest.mark.parametrize("target", list(State))
def test_sources_for_matches_the_table(target: State) -> None:
    expected = frozenset(s for (s, t) in EXPECTED if t == target)
    assert sources_for(target) == expected


def test_sources_for_by_hand() -> None:
    assert sources_for(Q) == frozenset({P, T, D})
    assert sources_for(P) == frozenset({Q})
    assert sources_for(T) == frozenset({P})
    assert sources_for(D) == frozenset({Q, T})
    assert sources_for(DONE) == frozenset({D})
    assert sources_for(FAILED) == frozenset(NON_TERMINAL)
    assert sources_for(CANCELLED) == frozenset(NON_TERMINAL)


def test_states_are_their_wire_strings() -> None:
    # The store writes str(state) into Redis and its Lua compares against these literals.
    assert [str(s) for s in State] == [
        "queued",
        "prefilling",
        "transferring",
        "decoding",
        "done",
        "failed",
        "cancelled",
    ]
