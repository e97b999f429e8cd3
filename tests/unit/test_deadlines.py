"""State deadlines: the backstop that keeps any request from sitting in a state forever."""

from __future__ import annotations

import pytest

from orchestrator.core.deadlines import StateDeadlines, overdue
from orchestrator.core.state import TERMINAL, State

D = StateDeadlines(queued_s=10, prefilling_s=20, transferring_s=30, decoding_s=40)


@pytest.mark.parametrize(
    ("state", "limit"),
    [(State.QUEUED, 10), (State.PREFILLING, 20), (State.TRANSFERRING, 30), (State.DECODING, 40)],
)
def test_each_live_state_has_its_deadline(state: State, limit: float) -> None:
    start = 1_000_000.0
    assert overdue(state, start, start + limit * 1000, D) is None  # exactly at: not yet
    reason = overdue(state, start, start + limit * 1000 + 1500, D)
    assert reason is not None
    assert str(state) in reason
    assert f"deadline {limit}s" in reason


def test_every_non_terminal_state_is_covered() -> None:
    for state in State:
        assert (D.limit(state) is None) == (state in TERMINAL)


def test_terminal_states_and_untracked_records_are_never_overdue() -> None:
    for state in TERMINAL:
        assert overdue(state, 1.0, 1e12, D) is None
    assert overdue(State.DECODING, 0.0, 1e12, D) is None  # no progress time recorded


def test_defaults_sit_behind_the_drivers_own_timeouts() -> None:
    d = StateDeadlines()
    assert d.prefilling_s > 120  # the driver's prefill timeout
    assert d.transferring_s > 30  # its KV adoption wait
    assert d.decoding_s > 60  # its token-silence timeout
